"""The trainer's weights into the engine through verl's own weight-sync path.

``TrioCheckpointManager.update_weights(global_steps)`` (the trainer's
``checkpoint_manager.update_weights`` each step) runs the actor workers' ``update_weights``:
here verl's own ``ActorRolloutRefWorker.update_weights`` method
(``verl/workers/engine_workers.py``), on two stand-in ranks that carry only what it reads
(the config, ``actor.engine.get_per_tensor_param``, the checkpoint engine verl's
``CheckpointEngineRegistry.new("trio", ...)`` builds).  Then the engine's tokens carry
``global_steps`` and their logprobs are the trained weights'.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("verl", reason="needs the verl venv: make test-integrations")

from omegaconf import OmegaConf  # noqa: E402
from verl.checkpoint_engine.base import CheckpointEngineRegistry  # noqa: E402
from verl.utils.config import omega_conf_to_dataclass  # noqa: E402
from verl.utils.import_utils import import_external_libs, load_class_from_fqn  # noqa: E402
from verl.workers.engine_workers import ActorRolloutRefWorker  # noqa: E402
from verl_doubles import generation_batch, load_model, perturbed_state, recompute_logprobs  # noqa: E402

from engine.errors import InvalidRequestError  # noqa: E402
from engine.integrations.verl import ENGINES, TrioAgentLoopManager, TrioCheckpointManager  # noqa: E402


class ActorRank:
    """One actor worker rank: verl's ``ActorRolloutRefWorker.update_weights`` on an object
    with the attributes that method reads (a model whose per-tensor parameters it sends)."""

    def __init__(self, checkpoint_config, rank: int) -> None:
        self.config = OmegaConf.create({"rollout": {"checkpoint_engine": {"backend": checkpoint_config.backend}}})
        self.model = None
        self.sent = 0
        self.actor = SimpleNamespace(engine=SimpleNamespace(get_per_tensor_param=self._per_tensor_param))
        self.checkpoint_engine = CheckpointEngineRegistry.new(
            checkpoint_config.backend, is_master=rank == 0,
            bucket_size=checkpoint_config.update_weights_bucket_megabytes << 20,
            **checkpoint_config.engine_kwargs.get(checkpoint_config.backend, {}))

    def _per_tensor_param(self, **kwargs):
        def gen():
            for name, tensor in self.model.state_dict().items():
                self.sent += 1
                yield name, tensor
        return gen(), None

    async def update_weights(self, global_steps=None, mode="auto"):
        return await ActorRolloutRefWorker.update_weights(self, global_steps=global_steps, mode=mode)


class ActorWorkerGroup:
    """``actor_wg.update_weights(...)`` as verl's RayWorkerGroup (ONE_TO_ALL, non-blocking):
    one awaitable per rank."""

    def __init__(self, ranks):
        self.ranks = ranks

    def update_weights(self, global_steps=None, mode="auto"):
        return [rank.update_weights(global_steps=global_steps, mode=mode) for rank in self.ranks]


@pytest.fixture
def synced(compose_config, engine, fresh_weights):
    config = compose_config()
    manager = TrioAgentLoopManager.create(config=config, llm_client=None, engine=engine)
    checkpoint_config = omega_conf_to_dataclass(config.actor_rollout_ref.rollout.checkpoint_engine)
    import_external_libs(checkpoint_config.custom_backend_module)  # as each worker process does
    wg = ActorWorkerGroup([ActorRank(checkpoint_config, rank) for rank in range(2)])
    cls = load_class_from_fqn(config.actor_rollout_ref.rollout.checkpoint_manager_class, "CheckpointEngineManager")
    checkpoint_manager = cls(config=checkpoint_config, actor_wg=wg, replicas=[])  # as RayPPOTrainer.init_workers
    yield manager, checkpoint_manager, wg, checkpoint_config
    manager.close()


def test_weight_updates_reach_the_engine_with_their_step(synced, tiny, engine):
    manager, checkpoint_manager, wg, checkpoint_config = synced
    checkpoint_manager.sleep_replicas()  # what the trainer calls around it: no-ops
    base = load_model(tiny)
    weights_dir = checkpoint_config.engine_kwargs["trio"]["weights_dir"]
    for step, seed in ((1, 1), (2, 2)):
        trained = perturbed_state(base, seed=seed)
        for rank in wg.ranks:
            rank.model = load_model(tiny, trained)
        metrics = checkpoint_manager.update_weights(step)
        assert metrics["trio/weights_mb"] > 0 and engine.version == step
        assert all(rank.sent == step * len(trained) for rank in wg.ranks)  # every rank consumed its generator
        out = manager.generate_sequences(generation_batch(2, n=2, step=step))
        nt = out.non_tensor_batch
        assert nt["min_global_steps"].tolist() == [step] * 4 and nt["max_global_steps"].tolist() == [step] * 4
        mask = out.batch["response_mask"].bool()
        diff = (recompute_logprobs(load_model(tiny, trained), out) - out.batch["rollout_log_probs"]).abs()[mask]
        assert float(diff.max()) < 1e-4, float(diff.max())
    from pathlib import Path

    assert sorted(p.name for p in Path(weights_dir).iterdir()) == ["step-2"]  # the previous step's folder removed
    assert (Path(weights_dir) / "step-2" / "config.json").is_file()


def test_the_checkpoint_manager_needs_the_agent_loop_manager(compose_config, synced):
    _, checkpoint_manager, wg, _ = synced
    checkpoint_manager.engine_name = "elsewhere"
    with pytest.raises(InvalidRequestError, match="no engine named 'elsewhere'.*agent_loop_manager_class"):
        checkpoint_manager.update_weights(1)
    assert "default" in ENGINES
    config = compose_config("actor_rollout_ref.rollout.checkpoint_engine.backend=naive")
    with pytest.raises(InvalidRequestError, match="backend='naive'.*set checkpoint_engine.backend=trio"):
        TrioCheckpointManager(config=omega_conf_to_dataclass(config.actor_rollout_ref.rollout.checkpoint_engine),
                              actor_wg=wg, replicas=[])

"""The config lines: verl's ``ppo_trainer`` config composed as verl's trainer composes it
(hydra, ``verl/trainer/config``), with ``engine.integrations.verl.CONFIG_OVERRIDES``,
resolves to the adapter's classes through verl's own loaders (``load_class_from_fqn`` as
``RayPPOTrainer.init_workers`` calls it, ``CheckpointEngineRegistry`` after
``custom_backend_module``, ``RolloutReplicaRegistry`` / ``get_rollout_class`` for the
rollout name), and the typed configs verl converts them to accept them.
"""

from __future__ import annotations

import pytest

pytest.importorskip("verl", reason="needs the verl venv: make test-integrations")

from hydra.errors import ConfigCompositionException  # noqa: E402
from verl.checkpoint_engine.base import CheckpointEngineRegistry  # noqa: E402
from verl.utils.config import omega_conf_to_dataclass  # noqa: E402
from verl.utils.import_utils import import_external_libs, load_class_from_fqn  # noqa: E402
from verl.workers.config import CheckpointEngineConfig, RolloutConfig  # noqa: E402
from verl.workers.rollout.base import get_rollout_class  # noqa: E402
from verl.workers.rollout.replica import get_rollout_replica_class  # noqa: E402

from engine.integrations import verl as adapter  # noqa: E402


def test_the_config_lines_resolve_to_the_adapter(compose_config):
    config = compose_config("+actor_rollout_ref.rollout.custom.trio_rollout.max_attempts=5")
    rollout = config.actor_rollout_ref.rollout
    # as RayPPOTrainer.init_workers reads them
    fqn = rollout.get("agent", {}).get("agent_loop_manager_class")
    assert load_class_from_fqn(fqn, "AgentLoopManager") is adapter.TrioAgentLoopManager
    assert load_class_from_fqn(rollout.get("checkpoint_manager_class"), "CheckpointEngineManager") \
        is adapter.TrioCheckpointManager
    # the typed configs verl builds from them (AgentLoopWorker, the workers, the replicas)
    typed: RolloutConfig = omega_conf_to_dataclass(rollout)
    assert typed.name == "trio" and typed.calculate_log_probs is True
    assert typed.agent.agent_loop_manager_class == "engine.integrations.verl.TrioAgentLoopManager"
    assert adapter.TrioVerlSettings.from_custom(typed.custom).max_attempts == 5
    ce: CheckpointEngineConfig = omega_conf_to_dataclass(rollout.checkpoint_engine)
    assert ce.backend == "trio" and ce.engine_kwargs["trio"]["weights_dir"]
    # what a worker process does with custom_backend_module before CheckpointEngineRegistry.new
    import_external_libs(ce.custom_backend_module)
    assert CheckpointEngineRegistry.get("trio") is adapter.TrioCheckpointEngine
    # rollout name "trio": LLMServerManager's replica class and the workers' rollout class
    assert get_rollout_replica_class(typed.name) is adapter.TrioReplica
    assert get_rollout_class(typed.name, typed.mode) is adapter.TrioRolloutAdapter


def test_without_plus_hydra_refuses_the_keys_verl_yaml_lacks(compose_config):
    """Why three overrides start with ``+``: verl's YAML has no ``agent_loop_manager_class``,
    ``checkpoint_manager_class`` or ``custom`` key, and hydra refuses to override a key that
    does not exist."""
    for line in adapter.CONFIG_OVERRIDES:
        if line.startswith("+"):
            with pytest.raises(ConfigCompositionException):
                compose_config(line[1:], adapter=False)


def test_bad_settings_name_the_field(compose_config, engine):
    config = compose_config("+actor_rollout_ref.rollout.custom.trio_rollout.max_attempt=2")
    with pytest.raises(ValueError, match=r"trio_rollout: unknown key\(s\) \['max_attempt'\]"):
        adapter.TrioAgentLoopManager.create(config=config, llm_client=None, engine=engine)
    config = compose_config("actor_rollout_ref.rollout.logprobs_mode=raw_logprobs")
    with pytest.raises(ValueError, match="logprobs_mode='raw_logprobs'.*use processed_logprobs"):
        adapter.TrioAgentLoopManager.create(config=config, llm_client=None, engine=engine)


def test_the_engine_factory_line(compose_config, tiny, tok, monkeypatch):
    """``trio_rollout.engine`` names a factory called with verl's config (how a trainer
    process, which cannot be handed a Python object, gets its engine); the manager owns
    what it built and closes it."""
    import verl_doubles

    from engine import EngineConfig, HFBackend, RolloutEngineThread

    built = []

    def make_engine(config):
        backend = HFBackend(tiny, tok, device="cpu", dtype="float32")
        built.append((config, RolloutEngineThread(backend, EngineConfig()).start()))
        return built[-1][1]

    monkeypatch.setattr(verl_doubles, "make_engine", make_engine, raising=False)
    config = compose_config("+actor_rollout_ref.rollout.custom.trio_rollout.engine=verl_doubles:make_engine")
    manager = adapter.TrioAgentLoopManager.create(config=config, llm_client=None)
    (seen, thread), = built
    assert seen is config and adapter.ENGINES["default"].engine is manager.engine
    assert len(manager.generate_sequences(__import__("verl_doubles").generation_batch(1, n=1))) == 1
    manager.close()
    assert "default" not in adapter.ENGINES
    with pytest.raises(Exception, match="closed"):
        thread.version


WORKER_ORDER = r"""
import sys, warnings
warnings.simplefilter("ignore", DeprecationWarning)
from hydra import compose, initialize_config_dir
import verl
from verl.utils.config import omega_conf_to_dataclass
from verl.workers.rollout.base import get_rollout_class
with initialize_config_dir(config_dir=sys.argv[1], version_base=None):
    config = compose(config_name="ppo_trainer", overrides=sys.argv[2:])
assert "engine.integrations.verl" not in sys.modules
try:
    get_rollout_class("trio", "async")
    raise SystemExit("registered before the model config was built")
except AssertionError:
    pass
omega_conf_to_dataclass(config.actor_rollout_ref.model)   # ActorRolloutRefWorker.init_model, first line
cls = get_rollout_class("trio", "async")                   # step 3 of init_model: the worker's rollout
print(f"{cls.__module__}.{cls.__qualname__}")
"""


def test_a_worker_finds_the_trio_rollout_before_it_builds_it(tiny):
    """In a fresh process, as verl's ``ActorRolloutRefWorker.init_model`` goes: building the
    model config imports ``external_lib`` (the adapter), which registers rollout ``trio``
    before the worker asks ``get_rollout_class`` for it."""
    import subprocess
    import sys
    from pathlib import Path

    import verl

    config_dir = str(Path(verl.__file__).parent / "trainer" / "config")
    proc = subprocess.run([sys.executable, "-c", WORKER_ORDER, config_dir, *adapter.CONFIG_OVERRIDES,
                           f"actor_rollout_ref.model.path={tiny}"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "engine.integrations._verl_weights.TrioRolloutAdapter"

"""The rest of AReaL's ``InferenceEngine`` API on the adapter, and what the bridge guarantees.

pause / resume and pause_generation / continue_generation hold the engine independently;
``staleness_manager`` (and ``workflow_executor.staleness_manager``, the trainer's SPMD path)
reflect the engine's admission, ``on_version_recovered`` included; ``export_stats`` carries
AReaL's ``stats_tracker`` and the engine's counts; ``agenerate`` works from your own asyncio
code too; 64 episodes are in flight at once with no thread per call; ``destroy`` cancels what is
running, the workflows' asyncio tasks included; a class given with the same kwargs is built
once; and each unsupported use is one clear error.
"""

from __future__ import annotations

import asyncio
import threading

import pytest

pytest.importorskip("areal", reason="needs the areal venv: make test-integrations")

import torch  # noqa: E402
import trio  # noqa: E402
from areal.api import ModelRequest, ModelResponse, RolloutWorkflow, WeightUpdateMeta  # noqa: E402
from areal.api.cli_args import GenerationHyperparameters, InferenceEngineConfig  # noqa: E402
from areal.workflow import RLVRWorkflow  # noqa: E402
from areal_doubles import AREAL_WARNINGS, SeededInference, prompts, seeded_backend  # noqa: E402
from areal_rewards import constant_reward  # noqa: E402
from torchdata.stateful_dataloader import StatefulDataLoader  # noqa: E402

from engine import MockBackend  # noqa: E402
from engine import ModelResponse as OurResponse  # noqa: E402
from engine.errors import InvalidRequestError  # noqa: E402
from engine.integrations.areal import AReaLInferenceEngine  # noqa: E402
from engine.testing import build_tiny_tokenizer  # noqa: E402

torch.set_num_threads(1)

pytestmark = AREAL_WARNINGS


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer()


def _config(**kw):
    base = dict(experiment_name="api", trial_name="t0", consumer_batch_size=2, max_concurrent_rollouts=4,
                max_head_offpolicyness=1)
    return InferenceEngineConfig(**{**base, **kw})


@pytest.fixture
def adapter(tok):
    engine = AReaLInferenceEngine(_config(), backend=seeded_backend(SeededInference(tok.eos_token_id)))
    engine.initialize()
    yield engine
    engine.destroy()


@pytest.fixture
def rlvr(tok):
    return RLVRWorkflow(reward_fn=constant_reward, gconfig=GenerationHyperparameters(max_new_tokens=4), tokenizer=tok)


def test_the_two_pauses_hold_the_engine_independently(adapter, rlvr):
    adapter.pause()
    adapter.pause_generation()
    adapter.continue_generation()  # the trainer's weight update ends inside its pause(): still held
    assert adapter.workflow_executor.is_paused()
    adapter.submit(prompts(1)[0], workflow=rlvr)
    with pytest.raises(TimeoutError):
        adapter.wait(count=1, timeout=1.0)
    assert adapter.statistics().queued == 1
    adapter.resume()
    assert not adapter.workflow_executor.is_paused()
    assert adapter.wait(count=1, timeout=30)[0] is not None


def test_the_staleness_manager_is_the_engines_admission(adapter, rlvr):
    for sm in (adapter.staleness_manager, adapter.workflow_executor.staleness_manager):
        assert (sm.max_concurrent_rollouts, sm.consumer_batch_size, sm.max_staleness) == (4, 2, 1)
        assert sm.get_pending_limit() == 4
    assert adapter.staleness_manager.get_capacity() == 4  # min(C, (eta + v + 1) * B)
    for item in prompts(4):
        adapter.submit(item, workflow=rlvr)
    adapter.wait(count=4, timeout=30)
    stats = adapter.staleness_manager.get_stats()
    assert (stats.accepted, stats.running, stats.enqueued) == (4, 0, 0)
    assert adapter.staleness_manager.get_capacity() == 0  # (1 + 0 + 1) * 2 - 4: version 0 is full
    # AReaL's trainer after a checkpoint recovery at version 5 (rl_trainer: on_version_recovered)
    adapter.workflow_executor.staleness_manager.on_version_recovered(5)
    assert adapter.get_version() == 5
    assert adapter.staleness_manager.get_capacity() == 4  # accepted = 5 * B: the bound is (eta + 1) * B again


def test_export_stats_has_areals_tracker_and_the_engines_counts(adapter, rlvr):
    adapter.rollout_batch(prompts(2), workflow=rlvr, group_size=2)
    stats = adapter.export_stats()
    assert stats["rollout/reward"] == 1.0  # recorded by RLVRWorkflow into AReaL's stats_tracker
    assert stats["trio_rollout/accepted"] == 2.0 and stats["trio_rollout/failed"] == 0.0
    assert all(isinstance(v, float) for k, v in stats.items() if k.startswith("trio_rollout/"))


def test_agenerate_from_your_own_asyncio_code(adapter, tok):
    req = ModelRequest(input_ids=[3, 10, 11, 12], gconfig=GenerationHyperparameters(max_new_tokens=4), tokenizer=tok)

    async def main():
        return await asyncio.gather(*(adapter.agenerate(req.copy()) for _ in range(3)))

    responses = asyncio.run(main())
    assert all(isinstance(r, ModelResponse) for r in responses)
    assert all(r.input_tokens == [3, 10, 11, 12] and r.output_len == len(r.output_logprobs) for r in responses)
    assert all(r.output_versions == [0] * r.output_len for r in responses)
    with pytest.raises(InvalidRequestError, match="n_samples"):  # AReaL: a ValueError
        asyncio.run(adapter.agenerate(ModelRequest(input_ids=[3], gconfig=GenerationHyperparameters(n_samples=2))))


def test_64_episodes_in_flight_at_once_without_a_thread_each(tok):
    """Every episode parks inside agenerate until all 64 are there: with a thread per call
    (a pool of min(32, cpus + 4)) the 64th would never arrive and the wait would time out."""
    arrived, threads = [], []
    release = trio.Event()

    async def handler(request, budget):
        arrived.append(request.rid)
        if len(arrived) == 64:
            threads.append(threading.active_count())
            release.set()
        await release.wait()
        return OurResponse(input_tokens=list(request.input_ids), output_tokens=[tok.eos_token_id],
                           output_logprobs=[-0.5], output_versions=[0], stop_reason="stop")

    engine = AReaLInferenceEngine(_config(max_concurrent_rollouts=64, consumer_batch_size=64,
                                          max_head_offpolicyness=0), backend=MockBackend(handler))
    engine.initialize()
    try:
        baseline = threading.active_count()
        workflow = RLVRWorkflow(reward_fn=constant_reward, gconfig=GenerationHyperparameters(max_new_tokens=2),
                                tokenizer=tok)
        for item in prompts(64, tag="many"):
            engine.submit(item, workflow=workflow)
        results = engine.wait(count=64, timeout=120)
    finally:
        engine.destroy()
    assert all(r is not None for r in results)
    assert threads == [baseline]  # all 64 in flight, not one thread more


def test_destroy_cancels_running_episodes_and_their_asyncio_tasks(tok):
    started, cancelled = threading.Event(), threading.Event()

    class Stuck(RolloutWorkflow):
        async def arun_episode(self, engine, data):
            started.set()
            try:
                await asyncio.Event().wait()  # an asyncio wait that never ends
            except asyncio.CancelledError:
                cancelled.set()
                raise

    engine = AReaLInferenceEngine(_config(), backend=seeded_backend(SeededInference(tok.eos_token_id)))
    engine.initialize()
    try:
        engine.submit(prompts(1)[0], workflow=Stuck())
        assert started.wait(30)
    finally:
        engine.destroy()
    assert cancelled.is_set()
    assert not engine.initialized


def test_a_class_with_the_same_kwargs_is_built_once(adapter, tok):
    built = []

    class Counted(RLVRWorkflow):
        def __init__(self, **kw):
            built.append(1)
            super().__init__(**kw)

    kwargs = dict(reward_fn=constant_reward, gconfig=GenerationHyperparameters(max_new_tokens=2), tokenizer=tok)
    for item in prompts(3):
        adapter.submit(item, workflow=Counted, workflow_kwargs=kwargs)
    assert all(r is not None for r in adapter.wait(count=3, timeout=30))
    assert built == [1]  # AReaL's remote engine builds one per submit
    with pytest.raises(ValueError, match="workflow_kwargs is required"):
        adapter.submit(prompts(1)[0], workflow=Counted)


def test_unsupported_uses_are_one_clear_error(adapter, rlvr, tok):
    with pytest.raises(InvalidRequestError, match="needs backend="):
        AReaLInferenceEngine(_config()).initialize()
    with pytest.raises(RuntimeError, match="not initialized"):
        AReaLInferenceEngine(_config(), backend=seeded_backend(SeededInference(4))).submit({}, workflow=rlvr)
    with pytest.raises(NotImplementedError, match="single-controller"):
        adapter.submit(prompts(1)[0], workflow=rlvr, callback_addr="http://x")
    with pytest.raises(NotImplementedError, match="weight_update_mode=disk"):
        adapter.init_weights_update_group(WeightUpdateMeta(type="xccl"))
    with pytest.raises(ValueError, match="batch_size is 3 but the consumer batch size is 2"):
        adapter.prepare_batch(StatefulDataLoader(prompts(6), batch_size=3, collate_fn=lambda r: r), workflow=rlvr)
    with pytest.raises(InvalidRequestError, match="use_beam_search"):
        asyncio.run(adapter.agenerate(ModelRequest(input_ids=[3], gconfig=GenerationHyperparameters(
            use_beam_search=True))))


def test_the_trainer_hook_refuses_what_it_cannot_run(monkeypatch):
    from areal.api.cli_args import GRPOConfig

    from engine.integrations.areal import AReaLPPOTrainer

    monkeypatch.delenv("AREAL_SPMD_MODE", raising=False)
    with pytest.raises(RuntimeError, match="AREAL_SPMD_MODE=1"):
        AReaLPPOTrainer(GRPOConfig(), backend=lambda: None)
    monkeypatch.setenv("AREAL_SPMD_MODE", "1")
    with pytest.raises(ValueError, match="must be a callable"):
        AReaLPPOTrainer(GRPOConfig(), backend=object())
    with pytest.raises(ValueError, match="weight_update_mode=disk"):
        AReaLPPOTrainer(GRPOConfig(), backend=lambda: None)  # AReaL's default is xccl

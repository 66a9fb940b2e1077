"""Each episode member collects its own reward outcomes and drift events (the engine sets the
collectors without context managers, engine._episode.Episodes._member) and leaves its task's context as
it found it: an episode started from an ended one's task (the engine admits the successor there)
sees only its own collectors."""

from __future__ import annotations

import pytest
import torch

from engine import EngineConfig, MockBackend, ModelRequest, ModelResponse, open_rollout_engine
from engine.chat._delta import _DRIFT_EVENTS
from engine.chat import collect_drift_events, record_drift
from engine.trajectory import trajectory_from_response
from engine.types import GenerationHyperparameters
from rewards._context import _COLLECTOR
from workflows import RolloutWorkflow

torch.set_num_threads(1)


async def _echo(req, budget):
    return ModelResponse(input_tokens=list(req.input_ids), output_tokens=[7, 8], output_logprobs=[-0.1, -0.2],
                         output_versions=[0, 0], stop_reason="stop")


class Probe(RolloutWorkflow):
    def __init__(self) -> None:
        self.seen: list[tuple[int, object]] = []

    async def arun_episode(self, engine, data):
        collector = _COLLECTOR.get()
        self.seen.append((len(_DRIFT_EVENTS.get()), None if collector is None else len(collector)))
        record_drift(f"probe {data}")
        resp = await engine.agenerate(ModelRequest(input_ids=[1, 2], gconfig=GenerationHyperparameters(max_new_tokens=2)))
        return trajectory_from_response(resp, 1.0)


@pytest.mark.parametrize("group_size", [1, 3])
async def test_each_member_sees_only_its_own_collectors(reward_pool, group_size):
    probe = Probe()
    config = EngineConfig(max_concurrent_rollouts=1)  # each successor starts from its predecessor's task
    with collect_drift_events() as outer:  # the caller's own block sees every event too
        async with open_rollout_engine(MockBackend(_echo), config, reward_pool=reward_pool) as engine:
            batch = await engine.rollout_batch(list(range(6)), probe, group_size=group_size)
            stats = engine.statistics()
        assert len(_DRIFT_EVENTS.get()) == 1  # the caller's context is as it was
    assert batch.batch_size[0] == 6 * group_size
    # one sink of the caller's block, one of the member's; a fresh, empty outcome list each time
    assert probe.seen == [(2, 0)] * (6 * group_size)
    assert stats.retokenization_drifts == 6 * group_size
    assert len(outer) == 6 * group_size
    assert _COLLECTOR.get() is None and _DRIFT_EVENTS.get() == ()


class Mixed(RolloutWorkflow):
    """Two drift events and three reward outcomes (one a fallback) per member, interleaved."""

    async def arun_episode(self, engine, data):
        from rewards import RewardOutcome
        from rewards._context import record_outcome

        record_outcome(RewardOutcome(reward=1.0, is_fallback=False, attempts=1, latency_s=0.0))
        record_drift(f"first {data}")
        record_outcome(RewardOutcome(reward=0.0, is_fallback=True, attempts=2, latency_s=0.0))
        record_drift(f"second {data}")
        record_outcome(RewardOutcome(reward=0.5, is_fallback=False, attempts=1, latency_s=0.0))
        resp = await engine.agenerate(ModelRequest(input_ids=[1, 2], gconfig=GenerationHyperparameters(max_new_tokens=2)))
        return trajectory_from_response(resp, 1.0)


@pytest.mark.parametrize("group_size", [1, 3])
async def test_fallbacks_and_drifts_are_counted_apart(reward_pool, group_size):
    async with open_rollout_engine(MockBackend(_echo), reward_pool=reward_pool) as engine:
        batch = await engine.rollout_batch(list(range(4)), Mixed(), group_size=group_size)
        stats = engine.statistics()
    assert batch.batch_size[0] == 4 * group_size
    assert stats.reward_fallbacks == 4 * group_size
    assert stats.retokenization_drifts == 2 * 4 * group_size


class Parked(RolloutWorkflow):
    """Parks until released, so that a test can look at its episode task's coroutines."""

    def __init__(self) -> None:
        import trio

        self.release = trio.Event()
        self.tasks: list = []

    async def arun_episode(self, engine, data):
        import trio

        self.tasks.append(trio.lowlevel.current_task())
        await self.release.wait()
        resp = await engine.agenerate(ModelRequest(input_ids=[1, 2], gconfig=GenerationHyperparameters(max_new_tokens=2)))
        return trajectory_from_response(resp, 1.0)


def _chain(task) -> list[str]:
    coro, names = task.coro, []
    while coro is not None and hasattr(coro, "cr_code"):
        names.append(coro.cr_code.co_name)
        coro = coro.cr_await
    return names[: names.index("arun_episode") + 1]


@pytest.mark.parametrize("group_size", [1, 2])
async def test_a_single_member_runs_with_no_frame_between_it_and_the_episode_task(reward_pool, group_size):
    # every frame alive for the episode's whole run is an object the GC promotes (benchmarks/README.md)
    import trio.testing

    wf = Parked()
    async with open_rollout_engine(MockBackend(_echo), reward_pool=reward_pool) as engine:
        engine.submit(0, wf, group_size=group_size)
        await trio.testing.wait_all_tasks_blocked()
        chains = [_chain(t) for t in wf.tasks]
        wf.release.set()
        (result,) = await engine.wait_results(1)
    assert result.status == "accepted" and result.trajectory.batch_size[0] == group_size
    if group_size == 1:
        assert chains == [["_run_episode", "_member", "arun_episode"]]
    else:  # each member in its own task
        assert chains == [["_member", "arun_episode"]] * 2

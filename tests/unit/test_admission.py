"""Unit tier: staleness-bounded admission, pause/resume, versions, the bounded
buffer, groups and filters (mock backend, virtual time)."""

from __future__ import annotations

import itertools

import pytest
import torch
import trio
import trio.testing

from engine import EngineConfig, MockBackend, ModelResponse, open_rollout_engine
from engine.trajectory import trajectory_from_response
from engine.executor import sample_index
from engine.staleness import StalenessManager, staleness_capacity
from workflows import RolloutWorkflow


async def _never(req, budget):  # the gated workflows below never call the backend
    raise AssertionError("unexpected generation")


def _traj(version: int = 0, reward: float = 1.0, n_out: int = 2):
    resp = ModelResponse(input_tokens=[1, 2], output_tokens=[5] * n_out, output_logprobs=[-1.0] * n_out,
                         output_versions=[version] * n_out)
    return trajectory_from_response(resp, reward)


class Gated(RolloutWorkflow):
    """Episodes wait on ``data["go"]`` and then end as ``data["mode"]`` says.

    Tokens are tagged with the engine version read when the episode started.
    """

    def __init__(self):
        self.started = 0

    async def arun_episode(self, engine, data):
        self.started += 1
        version = engine.version
        await data["go"].wait()
        mode = data.get("mode", "accept")
        if mode == "reject":
            return None
        if mode == "fail":
            raise RuntimeError("boom")
        return _traj(version, data.get("reward", 1.0))


def _items(n, **kw):
    return [{"go": trio.Event(), **kw} for _ in range(n)]


def _invariant(s):
    assert s.submitted == s.queued + s.running + s.accepted + s.rejected + s.failed


@pytest.mark.parametrize(
    ("C", "B", "eta", "v", "running", "accepted", "expected"),
    [
        (8, 4, 1, 0, 2, 3, 3),  # staleness-bound: (1+0+1)*4 - 5
        (8, 4, 5, 0, 2, 3, 6),  # concurrency-bound: 8 - 2
        (8, 4, 0, 2, 0, 12, 0),  # exactly caught up: (0+2+1)*4 - 12
        (8, 4, 0, 3, 1, 12, -1 + 4),  # a version bump opens B slots
        (8, 4, None, 0, 3, 999, 5),  # no staleness bound
    ],
)
def test_capacity_formula_table(C, B, eta, v, running, accepted, expected):
    assert staleness_capacity(max_concurrent=C, consumer_batch_size=B, max_head_offpolicyness=eta,
                              version=v, running=running, accepted=accepted) == expected


def test_restore_resets_accepted_to_version_times_batch():
    m = StalenessManager(max_concurrent=100, consumer_batch_size=8, max_head_offpolicyness=1, accepted=500)
    assert m.capacity(10) < 0
    m.restore(10)
    assert (m.accepted, m.capacity(10)) == (80, 16)


@pytest.mark.parametrize(("C", "B", "eta"), list(itertools.product([1, 3, 8], [1, 2, 5], [0, 1, 3])))
async def test_engine_admits_exactly_the_capacity(C, B, eta, reward_pool, autojump_clock):
    wf = Gated()
    config = EngineConfig(max_concurrent_rollouts=C, consumer_batch_size=B, max_head_offpolicyness=eta)
    async with open_rollout_engine(MockBackend(_never), config, reward_pool=reward_pool) as engine:
        items = _items(40)
        for item in items:
            engine.submit(item, wf)
        await trio.testing.wait_all_tasks_blocked()
        expected = min(C, (eta + 1) * B)
        assert engine.statistics().running == expected == wf.started
        # accept one: admission refills up to min(C - running, (eta+1)*B - (accepted + running))
        items[0]["go"].set()
        await trio.testing.wait_all_tasks_blocked()
        s = engine.statistics()
        assert s.accepted == 1
        assert s.running == min(C, (eta + 1) * B - 1)
        # a rejection does not count against staleness
        items[1]["mode"] = "reject"
        items[1]["go"].set()
        await trio.testing.wait_all_tasks_blocked()
        assert engine.statistics().running == min(C, (eta + 1) * B - 1)
        _invariant(engine.statistics())


async def test_set_version_wakes_idle_admission(reward_pool, autojump_clock):
    wf = Gated()
    config = EngineConfig(max_concurrent_rollouts=100, consumer_batch_size=2, max_head_offpolicyness=0)
    async with open_rollout_engine(MockBackend(_never), config, reward_pool=reward_pool) as engine:
        items = _items(6)
        for item in items:
            engine.submit(item, wf)
        for item in items[:2]:
            item["go"].set()
        await trio.testing.wait_all_tasks_blocked()
        s = engine.statistics()
        assert (s.accepted, s.running, s.queued, s.capacity) == (2, 0, 4, 0)
        assert len(await engine.wait(2)) == 2  # the trainer takes the batch for version 0 ...
        await trio.testing.wait_all_tasks_blocked()
        assert wf.started == 2  # ... which does not open admission by itself
        engine.set_version(1)
        await trio.testing.wait_all_tasks_blocked()
        s = engine.statistics()
        assert (s.running, s.queued, wf.started) == (2, 2, 4)


async def test_pause_stops_admission_and_new_segments_resume_restarts(reward_pool, autojump_clock):
    calls = []

    async def echo(req, budget):
        calls.append(req.rid)
        return ModelResponse(input_tokens=list(req.input_ids), output_tokens=[5], output_logprobs=[-1.0],
                             output_versions=[0], stop_reason="stop")

    class TwoSegments(RolloutWorkflow):
        async def arun_episode(self, engine, data):
            from engine import ModelRequest

            first = await engine.agenerate(ModelRequest(input_ids=[1]))
            await data["go"].wait()
            await engine.agenerate(ModelRequest(input_ids=[1]))
            return trajectory_from_response(first, 0.0)

    async with open_rollout_engine(MockBackend(echo), reward_pool=reward_pool) as engine:
        a = {"go": trio.Event()}
        engine.submit(a, TwoSegments())
        await trio.testing.wait_all_tasks_blocked()
        assert len(calls) == 1
        engine.pause()
        engine.submit({"go": trio.Event()}, TwoSegments())
        a["go"].set()
        await trio.testing.wait_all_tasks_blocked()
        s = engine.statistics()
        assert s.paused and len(calls) == 1 and s.queued == 1 and s.running == 1
        engine.resume()
        await trio.testing.wait_all_tasks_blocked()
        assert len(calls) == 3  # a's second segment + b's first
        assert engine.statistics().accepted == 1


class Sampled(RolloutWorkflow):
    """Member i finishes after (n - i) seconds with reward r[i] (reverse order)."""

    def __init__(self, n, rewards, fail=(), reject=()):
        self.n, self.rewards, self.fail, self.reject = n, rewards, fail, reject

    async def arun_episode(self, engine, data):
        i = sample_index.get()
        await trio.sleep(self.n - i)
        if i in self.fail:
            raise ValueError(f"member {i} failed")
        if i in self.reject:
            return None
        return _traj(reward=self.rewards[i], n_out=1 + i)


async def test_group_results_are_ordered_by_sample_index_not_completion(reward_pool, autojump_clock):
    async with open_rollout_engine(MockBackend(_never), reward_pool=reward_pool) as engine:
        batch = await engine.rollout_batch([{}, {}], Sampled(4, [0.0, 1.0, 2.0, 3.0]), group_size=4)
    assert batch["rewards"].tolist() == [0.0, 1.0, 2.0, 3.0] * 2
    assert batch["loss_mask"].sum(dim=1).tolist() == [1, 2, 3, 4] * 2
    assert batch["group_id"].tolist() == [0] * 4 + [1] * 4
    assert batch["group_size"].tolist() == [4] * 8


async def test_partial_groups_keep_group_ids_and_true_sizes(reward_pool, autojump_clock):
    async with open_rollout_engine(MockBackend(_never), reward_pool=reward_pool) as engine:
        tid = engine.submit({}, Sampled(4, [0.0, 1.0, 2.0, 3.0], fail=(1,), reject=(2,)), group_size=4)
        result = await engine.wait_for_task(tid)
    assert result.status == "accepted"
    assert result.trajectory["rewards"].tolist() == [0.0, 3.0]
    assert result.trajectory["group_size"].tolist() == [2, 2]
    assert result.member_errors == ((1, "workflow_error", "ValueError", "member 1 failed"),)


async def test_drop_incomplete_group_and_reward_normalization(reward_pool, autojump_clock):
    config = EngineConfig(drop_incomplete_group=True, reward_normalization=True)
    async with open_rollout_engine(MockBackend(_never), config, reward_pool=reward_pool) as engine:
        bad = engine.submit({}, Sampled(3, [1.0, 2.0, 3.0], reject=(0,)), group_size=3)
        good = engine.submit({}, Sampled(3, [1.0, 2.0, 6.0]), group_size=3)
        r_bad, r_good = await engine.wait_for_task(bad), await engine.wait_for_task(good)
        s = engine.statistics()
    assert (r_bad.status, r_bad.reason) == ("rejected", "incomplete_group")
    raw = torch.tensor([1.0, 2.0, 6.0])
    expected = (raw - raw.mean()) / (raw.std(unbiased=False) + 1e-8)
    assert torch.allclose(r_good.trajectory["rewards"], expected)
    assert r_good.trajectory["original_rewards"].tolist() == [1.0, 2.0, 6.0]
    assert s.rejected_by_reason == {"incomplete_group": 1}


async def test_buffer_backpressure_bounds_memory(reward_pool, autojump_clock):
    wf = Gated()
    config = EngineConfig(buffer_capacity=2)
    async with open_rollout_engine(MockBackend(_never), config, reward_pool=reward_pool) as engine:
        items = _items(5)
        for item in items:
            engine.submit(item, wf)
            item["go"].set()
        await trio.testing.wait_all_tasks_blocked()
        s = engine.statistics()
        assert (s.buffer_size, s.accepted, s.running) == (2, 2, 3)  # three wait to deposit
        got = await engine.wait_results(1)
        await trio.testing.wait_all_tasks_blocked()
        s = engine.statistics()
        assert got[0].status == "accepted"
        assert (s.buffer_size, s.accepted, s.running, s.buffer_peak) == (2, 3, 2, 2)
        _invariant(s)


async def test_filter_rejecting_one_of_four_inside_rollout_batch_returns(reward_pool, autojump_clock):
    async def accept(traj):
        return traj["rewards"].item() != 2.0

    wf = Gated()
    async with open_rollout_engine(MockBackend(_never), reward_pool=reward_pool) as engine:
        items = [{"go": trio.Event(), "reward": float(r)} for r in range(4)]
        for item in items:
            item["go"].set()
        batch = await engine.rollout_batch(items, wf, should_accept_fn=accept)
        s = engine.statistics()
    assert batch["rewards"].tolist() == [0.0, 1.0, 3.0]
    assert s.rejected_by_reason == {"filtered": 1}


async def test_filter_errors_and_timeouts_are_rejections_with_reasons(reward_pool, autojump_clock):
    async def boom(traj):
        raise KeyError("nope")

    async def slow(traj):
        await trio.sleep(3600)
        return True

    wf = Gated()
    config = EngineConfig(should_accept_timeout_s=5)
    async with open_rollout_engine(MockBackend(_never), config, reward_pool=reward_pool) as engine:
        a = engine.submit({"go": _set()}, wf, should_accept_fn=boom)
        b = engine.submit({"go": _set()}, wf, should_accept_fn=slow)
        ra, rb = await engine.wait_for_task(a), await engine.wait_for_task(b)
    assert (ra.status, ra.reason, ra.error_type) == ("rejected", "filter_error", "KeyError")
    assert (rb.status, rb.reason) == ("rejected", "filter_timeout")


async def test_sync_filters_run_in_a_thread(reward_pool):  # real time: a thread is involved
    import threading

    threads = []

    def accept_odd(traj):
        threads.append(threading.current_thread())
        return traj["rewards"].item() % 2 == 1

    async with open_rollout_engine(MockBackend(_never), reward_pool=reward_pool) as engine:
        items = [{"go": _set(), "reward": float(r)} for r in range(4)]
        batch = await engine.rollout_batch(items, Gated(), should_accept_fn=accept_odd)
    assert batch["rewards"].tolist() == [1.0, 3.0]
    assert threading.main_thread() not in threads and len(threads) == 4


def _set():
    ev = trio.Event()
    ev.set()
    return ev


@pytest.mark.parametrize("policy", ["drop", "flag"])
async def test_trajectories_that_turn_stale_in_the_buffer(policy, reward_pool, autojump_clock):
    wf = Gated()
    config = EngineConfig(max_head_offpolicyness=1, consumer_batch_size=4, staleness_policy=policy)
    async with open_rollout_engine(MockBackend(_never), config, reward_pool=reward_pool) as engine:
        items = _items(2)
        for item in items:
            engine.submit(item, wf)
            item["go"].set()
        await trio.testing.wait_all_tasks_blocked()
        engine.set_version(1)  # 1 behind: not stale yet
        assert engine.statistics().accepted == 2
        engine.set_version(2)  # 2 behind > eta = 1
        s = engine.statistics()
        out = await engine.wait(2)
    if policy == "drop":
        assert out == [None, None]
        assert (s.accepted, s.rejected, s.rejected_by_reason) == (0, 2, {"stale": 2})
    else:
        assert s.accepted == 2 and all(t["is_stale"].tolist() == [True] for t in out)


async def test_prepare_batch_returns_batches_and_overlaps(reward_pool, autojump_clock):
    class Instant(RolloutWorkflow):
        async def arun_episode(self, engine, data):
            await trio.sleep(1)
            return None if data["i"] % 3 == 0 else _traj(engine.version, float(data["i"]))

    loader = [[{"i": i} for i in range(k, k + 4)] for k in range(0, 40, 4)]
    config = EngineConfig(consumer_batch_size=4, max_head_offpolicyness=1, max_concurrent_rollouts=16)
    async with open_rollout_engine(MockBackend(_never), config, reward_pool=reward_pool) as engine:
        b1 = await engine.prepare_batch(loader, Instant())
        engine.set_version(1)
        b2 = await engine.prepare_batch(loader, Instant())
        dyn = await engine.prepare_batch(loader, Instant(), dynamic_bs=True)
        s = engine.statistics()
    assert b1.batch_size[0] == 4 and b2.batch_size[0] == 4
    assert 0 < dyn.batch_size[0] <= 4
    assert not set(b1["rewards"].tolist()) & set(b2["rewards"].tolist())
    assert all(r % 3 != 0 for r in b1["rewards"].tolist() + b2["rewards"].tolist())
    _invariant(s)


async def test_cancelled_wait_and_closed_engine_lose_nothing(reward_pool, autojump_clock):
    wf = Gated()
    async with open_rollout_engine(MockBackend(_never), EngineConfig(buffer_capacity=1),
                                   reward_pool=reward_pool) as engine:
        items = _items(4)
        for item in items:
            engine.submit(item, wf)
        items[0]["go"].set()
        items[1]["go"].set()
        with trio.move_on_after(5):
            await engine.wait(3)  # cancelled: consumes nothing
        assert engine.statistics().results_waiting == 1
    # closing: episode 1 (finished, waiting to deposit) is kept; 2 and 3 are cancelled
    s = engine.statistics()
    _invariant(s)
    assert (s.accepted, s.failed, s.failed_by_reason) == (2, 2, {"cancelled": 2})
    results = await engine.wait_results(4)
    by_id = {r.task_id: r.status for r in results}
    assert by_id == {0: "accepted", 1: "accepted", 2: "failed", 3: "failed"}


async def test_a_wait_that_times_out_says_when_staleness_holds_episodes_back(reward_pool, autojump_clock):
    wf = Gated()
    config = EngineConfig(consumer_batch_size=1, max_head_offpolicyness=0)
    async with open_rollout_engine(MockBackend(_never), config, reward_pool=reward_pool) as engine:
        first = engine.submit({"go": _set()}, wf)
        second = engine.submit({"go": _set()}, wf)
        assert (await engine.wait_for_task(first)).status == "accepted"
        with pytest.raises(TimeoutError, match="staleness bound .* set_version"):
            await engine.wait_for_task(second, timeout=10)
        engine.set_version(1)
        assert (await engine.wait_for_task(second, timeout=10)).status == "accepted"

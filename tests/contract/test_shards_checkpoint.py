"""Engine shards (issue 16 follow-up): ``state_dict`` / ``load_state_dict`` on a sharded
engine, in the single engine's format (:mod:`engine._checkpoint`): a state saved
mid-run (episodes queued, running on the shards, finished and not consumed) loads
into a fresh sharded engine or a single engine, and a single engine's into a sharded
one; every episode then ends exactly once.

Inline shards (the coordinator, shard code and wire format in this trio loop) run in
virtual time; one test spawns two real shard processes (slow)."""

from __future__ import annotations

import io

import pytest
import torch
import trio

from engine import EngineConfig, open_rollout_engine
from engine.errors import WorkflowError
from engine.shards import open_sharded_engine
from engine.staleness import staleness_capacity
from shard_fixtures import Echo, invariant, sim

C, B, ETA = 4, 2, 2
CONFIG = EngineConfig(max_concurrent_rollouts=C, consumer_batch_size=B, max_head_offpolicyness=ETA)


def _items():
    """12 episodes with staggered durations; one is rejected before the save, one fails after it."""
    return [{"i": i, "sleep": 1 + i % 3, "reject": i == 2, "fail": i == 9} for i in range(12)]


def _roundtrip(state):
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)  # plain containers and tensors only


def _open(kind, reward_pool):
    if kind == "sharded":
        return open_sharded_engine(sim(1.0), CONFIG, shards=2, shard_backend="inline")
    return open_rollout_engine(sim(1.0), CONFIG, reward_pool=reward_pool)


async def _save_mid_run(engine, items):
    """Submit ``items``, consume one batch, publish version 1, wait for two unconsumed
    results; returns (task ids, consumed, statistics at the save, state, buffered results)."""
    ids = [engine.submit(item, Echo()) for item in items]
    consumed = await engine.wait_results(B)
    engine.set_version(1)
    await engine._buffer.wait_until(lambda: len(engine._buffer) >= 2)
    before = engine.statistics()
    state = _roundtrip(engine.state_dict())
    return ids, consumed, before, state, {r.task_id: r for r in engine._buffer.results()}


async def _train(engine, n):
    """A trainer: take results one at a time and publish a new version after each ``B`` accepted."""
    results: list = []
    accepted = 0
    while len(results) < n:
        got = await engine.wait_results(1)
        results += got
        accepted += sum(r.status == "accepted" for r in got)
        if accepted == B:
            accepted = 0
            engine.set_version(engine.version + 1)
    return results


@pytest.mark.parametrize(("source", "target"), [("sharded", "sharded"), ("sharded", "single"),
                                                ("single", "sharded")])
async def test_a_state_saved_mid_run_resumes_with_every_episode_ending_once(source, target, reward_pool,
                                                                          autojump_clock):
    items = _items()
    async with _open(source, reward_pool) as engine:
        ids, consumed, before, state, buffered = await _save_mid_run(engine, items)
        if source == "sharded":  # episodes were out on the shards: saved as running
            assert sum(len(s.inflight) for s in engine._shards) == before.running
    assert before.results_waiting >= 2 and before.running > 0 and before.queued > 0
    assert before.rejected == 1  # (the rejected one is among the saved results)
    pending = [p["task_id"] for p in state["pending"]]
    saved = [r["task_id"] for r in state["results"]]
    assert len(pending) == before.queued + before.running and len(saved) == before.results_waiting
    assert sorted([r.task_id for r in consumed] + saved + pending) == ids  # each episode in exactly one place
    assert state["version"] == 1 and state["accounting"]["generated_tokens"] == before.generated_tokens > 0
    saved_accepted = sum(r["status"] == "accepted" for r in state["results"])

    async with _open(target, reward_pool) as engine:
        assert engine.load_state_dict(state, Echo()) == pending
        s = engine.statistics()
        assert (s.version, s.accepted, s.rejected, s.failed) == (1, before.accepted, before.rejected, before.failed)
        assert s.queued + s.running == len(pending) and s.results_waiting == len(saved)
        assert s.generated_tokens == before.generated_tokens
        invariant(s)
        # AReaL's restore (version * B) plus the accepted results put back; the capacity follows from it
        assert engine._admission.staleness.accepted == 1 * B + saved_accepted
        assert s.capacity == staleness_capacity(max_concurrent=C, consumer_batch_size=B, max_head_offpolicyness=ETA,
                                                version=1, running=s.running, accepted=1 * B + saved_accepted)
        rest = await _train(engine, len(saved) + len(pending))
        end = engine.statistics()
    assert [r.task_id for r in rest[:len(saved)]] == saved  # unconsumed results come first, in order
    for r in rest[:len(saved)]:
        assert r.status == buffered[r.task_id].status and r.data == items[r.task_id]
        if r.trajectory is not None:
            assert torch.equal(r.trajectory["input_ids"], buffered[r.task_id].trajectory["input_ids"])
    ended = [r.task_id for r in consumed + rest]
    assert sorted(ended) == ids  # every task id ended exactly once, none lost or added
    assert all(r.data == items[r.task_id] for r in rest)
    assert {r.task_id: r.status for r in rest if r.status != "accepted"} == {2: "rejected", 9: "failed"}
    assert (end.submitted, end.accepted, end.rejected, end.failed) == (12, 10, 1, 1)
    assert end.running == end.queued == end.results_waiting == 0
    assert end.generated_tokens > before.generated_tokens  # the restored count plus the re-run episodes'


async def test_load_state_dict_refuses_what_it_cannot_restore_before_loading_anything(reward_pool, autojump_clock):
    async with open_sharded_engine(sim(1.0), EngineConfig(max_concurrent_rollouts=1), shards=2,
                                   shard_backend="inline") as a:
        a.submit({"i": 0}, Echo())
        a.submit({"i": 1}, Echo())
        state = a.state_dict()
        with pytest.raises(ValueError, match="fresh engine; this one has submitted 2"):
            a.load_state_dict(state, Echo())

    import threading

    class Locked(Echo):  # holds a lock: neither pickle nor cloudpickle can send it
        def __init__(self):
            super().__init__()
            self.lock = threading.Lock()

    async with open_sharded_engine(sim(1.0), EngineConfig(), shards=2, shard_backend="inline") as b:
        with pytest.raises(ValueError, match="holds 2 queued or running episodes; pass the workflow"):
            b.load_state_dict(state)
        with pytest.raises(ValueError, match="unknown state format 7"):
            b.load_state_dict({**state, "format": 7}, Echo())
        with pytest.raises(ValueError, match="data_position must be a DataStream state"):
            b.load_state_dict({**state, "data_position": {"epoch": 1}}, Echo())
        with pytest.raises(WorkflowError, match="cannot be pickled"):
            b.load_state_dict(state, Locked())
        unpicklable = {**state, "pending": [*state["pending"], {"task_id": 5, "data": {"lock": threading.Lock()},
                                                                 "group_size": 1}]}
        with pytest.raises(ValueError, match="data of pending task 5 cannot be pickled"):
            b.load_state_dict(unpicklable, Echo())
        s = b.statistics()
        assert (s.submitted, s.version, b._admission.staleness.accepted, s.results_waiting) == (0, 0, 0, 0)  # nothing half-loaded
        assert b.load_state_dict(state, Echo()) == [0, 1]  # still fresh: the good state loads
        assert sorted(r.task_id for r in await b.wait_results(2)) == [0, 1]


@pytest.mark.slow
async def test_two_shard_processes_save_and_resume_into_two_fresh_ones():
    # the quick episodes end, the slow ones (one real second each) are running or queued at the save
    items = [{"i": i, "sleep": 0 if i < 4 else 1.0} for i in range(10)]
    config = EngineConfig(max_concurrent_rollouts=4, consumer_batch_size=2)
    async with open_sharded_engine(sim(0.0), config, shards=2) as engine:
        ids = [engine.submit(item, Echo()) for item in items]
        consumed = await engine.wait_results(2)
        engine.set_version(3)
        await engine._buffer.wait_until(lambda: len(engine._buffer) >= 2)
        before = engine.statistics()
        state = _roundtrip(engine.state_dict())
        old_pids = set(engine.shard_pids)
    assert before.running > 0 and before.queued > 0
    pending = [p["task_id"] for p in state["pending"]]
    async with open_sharded_engine(sim(0.0), config, shards=2) as engine:
        assert engine.load_state_dict(state, Echo()) == pending
        assert engine._admission.staleness.accepted == 3 * 2 + sum(r["status"] == "accepted" for r in state["results"])
        with trio.fail_after(60):
            rest = await engine.wait_results(len(state["results"]) + len(pending))
        s = engine.statistics()
        pids = {int(r.trajectory["shard_pid"][0]) for r in rest if r.task_id in pending}
        assert pids <= set(engine.shard_pids) and not pids & old_pids  # re-run on the new shards
    assert sorted(r.task_id for r in consumed + rest) == ids
    assert (s.version, s.submitted, s.accepted, s.running, s.queued, s.results_waiting) == (3, 10, 10, 0, 0, 0)

"""Unit tier: the blocking facade, driven from plain threads (sim backend,
in-process reward pool)."""

from __future__ import annotations

from contextlib import asynccontextmanager

import threading

import pytest
import trio

from engine.testing import InProcessRewardPool
from engine import EngineConfig, MockBackend, SimBackend, SimConfig
from engine.trajectory import trajectory_from_response
from engine.sync import RolloutEngineThread
from engine.types import ModelRequest
from workflows import RolloutWorkflow


class OneGen(RolloutWorkflow):
    async def arun_episode(self, engine, data):
        if data.get("reject"):
            return None
        resp = await engine.agenerate(ModelRequest(input_ids=[1, 2, 3]))
        return trajectory_from_response(resp, float(data["i"]))


def _engine(**config):
    backend = SimBackend(SimConfig(vocab_size=50, out_len_median=4, seed=1))
    return RolloutEngineThread(backend, EngineConfig(**config), reward_pool=InProcessRewardPool())


def test_blocking_calls_from_several_threads():
    errors = []
    with _engine() as engine:
        def worker(k):
            try:
                ids = [engine.submit({"i": k * 10 + j}, OneGen()) for j in range(5)]
                for tid in ids:
                    assert engine.wait_for_task(tid).status == "accepted"
            except BaseException as exc:  # surfaced below
                errors.append(exc)

        threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        s = engine.statistics()
        batch = engine.rollout_batch([{"i": 1}, {"i": 2, "reject": True}, {"i": 3}], OneGen())
    assert errors == []
    assert (s.submitted, s.accepted) == (20, 20)
    assert batch["rewards"].tolist() == [1.0, 3.0]


def test_errors_are_reraised_with_their_type_and_close_is_clean():
    engine = _engine().start()
    with pytest.raises(ValueError, match="unknown or already consumed"):
        engine.wait_for_task(12345)
    engine.submit({"i": 0}, _Hang())
    with pytest.raises(TimeoutError):
        engine.wait(1, timeout=0.01)
    assert engine.statistics().running == 1  # the timed-out wait lost nothing
    engine.close()
    engine.close()  # idempotent
    with pytest.raises(trio.ClosedResourceError):
        engine.submit({"i": 1}, OneGen())
    assert not any(t.name == "trio-rollout-engine" for t in threading.enumerate())


class _Hang(RolloutWorkflow):
    async def arun_episode(self, engine, data):
        await trio.sleep_forever()


def test_prepare_batch_and_versions_from_a_training_loop():
    loader = [[{"i": i} for i in range(k, k + 2)] for k in range(0, 8, 2)]
    with _engine(consumer_batch_size=2, max_head_offpolicyness=0) as engine:
        for step in range(3):
            batch = engine.prepare_batch(loader, OneGen())
            assert batch.batch_size[0] == 2
            assert (batch["versions"][batch["loss_mask"].bool()] == step).all()
            engine.set_version(step + 1)
        assert engine.version == 3


def test_a_backend_that_fails_to_start_is_reported_with_its_cause():
    class Broken(MockBackend):
        @asynccontextmanager
        async def open(self):
            raise OSError("model file missing")
            yield self

    async def never(req, budget):
        raise AssertionError

    engine = RolloutEngineThread(Broken(never), reward_pool=InProcessRewardPool())
    with pytest.raises(RuntimeError, match="failed to start") as info:
        engine.start()
    assert "model file missing" in repr(info.value.__cause__)


def test_state_dict_moves_unconsumed_and_pending_episodes_to_another_engine():
    with _engine(max_concurrent_rollouts=2) as first:
        first.pause()  # nothing starts: every episode is pending in the state
        ids = [first.submit({"i": i}, OneGen()) for i in range(4)]
        state = first.state_dict()
    assert [p["task_id"] for p in state["pending"]] == ids
    with _engine() as second:
        assert second.load_state_dict(state, OneGen()) == ids
        results = second.wait_results(4)
    assert sorted(r.task_id for r in results) == ids and {r.status for r in results} == {"accepted"}

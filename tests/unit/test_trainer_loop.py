"""Unit tier: the engine behind a trainer's loop (issue 18): run-ahead refilled on
every step, bounded failure, dataloaders as trainers build them, the data
position, timeouts that say why.  Sim/mock backends, in-process rewards, virtual
time (the training step is a virtual-time sleep: in a real trainer it runs in a
thread, ``trio.to_thread.run_sync``, while the engine generates)."""

from __future__ import annotations

import logging
import time

import pytest
import torch
import trio

from engine.testing import InProcessRewardPool
from engine import EngineConfig, SimBackend, SimConfig, open_rollout_engine
from engine.trajectory import trajectory_from_response
from engine.datastream import DataStream
from engine.errors import DataExhaustedError, DatasetError, EpisodeFailuresError
from engine.sync import RolloutEngineThread
from engine.types import ModelRequest
from workflows import RolloutWorkflow

torch.set_num_threads(1)


class OneGen(RolloutWorkflow):
    """One generation; reward = the item's ``i``; optionally fails or rejects."""

    def __init__(self):
        self.broken = False
        self.seen = []

    async def arun_episode(self, engine, data):
        self.seen.append(data["i"])
        resp = await engine.agenerate(ModelRequest(input_ids=[5, 6, 7]))
        if self.broken:
            raise KeyError("answer")
        return trajectory_from_response(resp, float(data["i"]))


def _sim(per_token_s=0.02, out_len=25):  # 0.5 s per episode
    return SimBackend(SimConfig(vocab_size=50, out_len_median=out_len, per_token_s=per_token_s, seed=1))


def _invariant(s):
    assert s.submitted == s.queued + s.running + s.accepted + s.rejected + s.failed


# -- 1. run-ahead on every step --------------------------------------------------------------
async def test_run_ahead_is_refilled_on_every_step_so_no_step_waits_after_warm_up(autojump_clock):
    loader = [{"i": i} for i in range(1000)]
    config = EngineConfig(consumer_batch_size=4, max_head_offpolicyness=1, max_concurrent_rollouts=16)
    waits, seen = [], []
    async with open_rollout_engine(_sim(), config, reward_pool=InProcessRewardPool()) as engine:
        for step in range(8):
            t0 = trio.current_time()
            batch = await engine.prepare_batch(loader, OneGen())
            waits.append(trio.current_time() - t0)
            seen += batch["rewards"].tolist()
            assert (batch["versions"][batch["loss_mask"].bool()] >= step - 1).all()  # eta = 1
            await trio.sleep(1.2)  # the training step, longer than a batch's generation (0.5 s)
            engine.set_version(step + 1)
        s = engine.statistics()
    assert waits[0] > 0  # warm-up
    assert waits[1:] == [0.0] * 7, waits
    assert len(set(seen)) == len(seen) == 32  # no item repeated
    assert s.data_position["position"] >= 32
    _invariant(s)


def test_run_ahead_through_the_blocking_facade():
    loader = [{"i": i} for i in range(1000)]
    backend = _sim(per_token_s=0.002, out_len=25)  # 50 ms per episode
    config = EngineConfig(consumer_batch_size=4, max_head_offpolicyness=1, max_concurrent_rollouts=16)
    ready_before, waits = [], []
    with RolloutEngineThread(backend, config, reward_pool=InProcessRewardPool()) as engine:
        for step in range(5):
            ready_before.append(engine.statistics().buffer_size)
            t0 = time.perf_counter()
            batch = engine.prepare_batch(loader, OneGen())
            waits.append(time.perf_counter() - t0)
            assert batch.batch_size[0] == 4
            time.sleep(0.4)  # the training step (real time: the engine's thread generates meanwhile)
            engine.set_version(step + 1)
    # after warm-up a full batch is already buffered when the trainer asks for it
    assert ready_before[0] == 0 and all(r >= 4 for r in ready_before[1:]), (ready_before, waits)


# -- 2. bounded failure ------------------------------------------------------------------------
async def test_an_always_failing_workflow_raises_within_a_bounded_number_of_episodes(autojump_clock, caplog):
    loader = [{"i": i} for i in range(10)]
    wf = OneGen()
    wf.broken = True
    config = EngineConfig(consumer_batch_size=4, max_concurrent_rollouts=64, failure_breaker_consecutive=16)
    caplog.set_level(logging.WARNING, logger="rollout.engine.executor")
    async with open_rollout_engine(_sim(), config, reward_pool=InProcessRewardPool()) as engine:
        with pytest.raises(EpisodeFailuresError, match=r"16 consecutive episodes failed; dominant reason "
                                                       r"workflow_error .* KeyError: 'answer'") as info:
            await engine.prepare_batch(loader, wf, timeout=1000)
        assert info.value.trip.dominant_reason == "workflow_error"
        while engine.statistics().running:  # what was in flight ends; nothing new is submitted
            await engine.wait_results(engine.statistics().results_waiting + 1)
        s = engine.statistics()
        assert s.submitted <= 16 + 64  # the breaker plus what was already in flight
        assert s.queued + s.running == 0 and s.breaker_open and s.breaker_trips == 1  # open until called again
        wf.broken = False  # the cause is fixed: the run continues
        batch = await engine.prepare_batch(loader, wf, timeout=1000)
        assert batch.batch_size[0] == 4
        _invariant(engine.statistics())
    failures = [r for r in caplog.records if "fail" in r.getMessage()]
    assert len(failures) <= 3, [r.getMessage() for r in failures]  # rate-limited, not one line per episode


async def test_rollout_batch_stops_when_the_breaker_opens(autojump_clock):
    wf = OneGen()
    wf.broken = True
    config = EngineConfig(max_concurrent_rollouts=4, failure_breaker_consecutive=8)
    async with open_rollout_engine(_sim(), config, reward_pool=InProcessRewardPool()) as engine:
        with pytest.raises(EpisodeFailuresError, match="rollout_batch: stopped submitting"):
            await engine.rollout_batch([{"i": i} for i in range(100)], wf)
        s = engine.statistics()
    assert len(wf.seen) <= 8 + 2 * 4  # the trip, what was running, and what started before the call woke
    assert s.failed == 100 and s.failed_by_reason["cancelled"] >= 100 - 16  # not started: withdrawn, counted
    _invariant(s)


class Mixed(RolloutWorkflow):
    """One generation; ``data["fail"]``: raise it, ``data["reject"]``: return None."""

    async def arun_episode(self, engine, data):
        resp = await engine.agenerate(ModelRequest(input_ids=[5, 6, 7]))
        if "fail" in data:
            raise data["fail"]
        return None if data.get("reject") else trajectory_from_response(resp, float(data["i"]))


async def test_a_rollout_batch_that_accepts_nothing_because_episodes_failed_raises_one_typed_error(autojump_clock):
    """Regression (new-user trial): every episode of a small batch failed (fewer than the breaker
    needs to open) and rollout_batch returned a TensorDict with no keys: the trainer died later,
    on a KeyError far from the cause."""
    items = [{"i": 0, "fail": KeyError("answer")}, {"i": 1, "fail": ValueError("bad\nrow")},
             {"i": 2, "fail": KeyError("answer")}, {"i": 3, "reject": True}]
    async with open_rollout_engine(_sim(), reward_pool=InProcessRewardPool()) as engine:
        with pytest.raises(EpisodeFailuresError) as info:
            await engine.rollout_batch(items[:3], Mixed())
        assert str(info.value) == (
            "rollout_batch: none of 3 episodes was accepted: 3 failed (workflow_error: 3); first failures: "
            "task 0: KeyError: 'answer'; task 1: ValueError: bad row")
        assert info.value.trip.by_reason == {"workflow_error": 3} and info.value.trip.seen == 3
        with pytest.raises(EpisodeFailuresError, match=r"^rollout_batch: none of 2 episodes was accepted: 1 failed "
                                                        r"\(workflow_error: 1\), 1 rejected; first failures: task 3: KeyError"):
            await engine.rollout_batch(items[2:], Mixed())
        assert (await engine.rollout_batch(items[3:], Mixed())).batch_size[0] == 0  # only rejected: AReaL's []
        batch = await engine.rollout_batch([items[0], {"i": 7}], Mixed())  # one accepted: the batch, no error
        assert batch["rewards"].tolist() == [7.0]
        s = engine.statistics()
    _invariant(s)
    assert (s.accepted, s.rejected, s.failed) == (1, 2, 5)  # each episode ended once, as before


def test_the_blocking_facade_raises_it_too():
    with RolloutEngineThread(_sim(per_token_s=0.0), reward_pool=InProcessRewardPool()) as engine:
        with pytest.raises(EpisodeFailuresError, match=r"^rollout_batch: none of 2 episodes was accepted"):
            engine.rollout_batch([{"i": 0, "fail": KeyError("answer")}] * 2, Mixed())


async def test_prepare_batch_with_dynamic_bs_that_accepts_nothing_raises_it_too(autojump_clock):
    loader = [{"i": i, "fail": KeyError("answer")} for i in range(4)]
    async with open_rollout_engine(_sim(), EngineConfig(consumer_batch_size=4, max_concurrent_rollouts=4),
                                   reward_pool=InProcessRewardPool()) as engine:
        with pytest.raises(EpisodeFailuresError, match=r"^prepare_batch: none of 4 episodes was accepted: 4 failed"):
            await engine.prepare_batch(loader, Mixed(), dynamic_bs=True)


def test_failure_breaker_rate_rule():
    from engine._breaker import FailureBreaker
    from engine.executor import EpisodeResult

    breaker = FailureBreaker(None, window=10, failure_rate=0.8)
    for k in range(10):  # 8 of 10 failed, never 8 in a row
        ok = k in (3, 7)
        breaker.record(EpisodeResult(k, "accepted" if ok else "failed", reason=None if ok else "reward_error",
                                     error_type="E", error_message="m"))
    assert breaker.open and breaker.trip.rule == "8 of the last 10 episodes failed"
    breaker.reset()
    assert not breaker.open
    breaker.record(EpisodeResult(11, "failed", reason="cancelled"))  # cancellations are not failures
    assert breaker.recent_failures() == ""


# -- 3. dataloaders as trainers build them ------------------------------------------------------
def _chat_rows(n):
    return [{"messages": [{"role": "user", "content": f"q{i}"}], "answer": str(i), "i": i} for i in range(n)]


async def test_a_default_collate_dataloader_is_refused_with_the_fix(autojump_clock):
    from torch.utils.data import DataLoader

    async with open_rollout_engine(_sim(), EngineConfig(consumer_batch_size=2),
                                   reward_pool=InProcessRewardPool()) as engine:
        with pytest.raises(DatasetError, match=r"default collate.*collate_fn=lambda rows: rows"):
            await engine.prepare_batch(DataLoader(_chat_rows(8), batch_size=2), OneGen())
        with pytest.raises(DatasetError, match="collated batch"):
            await engine.rollout_batch(next(iter(DataLoader(_chat_rows(8), batch_size=2))), OneGen())
        assert engine.statistics().submitted == 0
        wf = OneGen()
        loader = DataLoader(_chat_rows(8), batch_size=2, collate_fn=lambda rows: rows)
        batch = await engine.prepare_batch(loader, wf)
    assert batch.batch_size[0] == 2 and set(batch["rewards"].tolist()) <= {float(i) for i in range(8)}
    assert all(isinstance(i, int) for i in wf.seen)  # rows arrive as rows, not collated


# -- 4. the data position ----------------------------------------------------------------------
async def test_a_new_list_per_call_is_an_error_not_a_silent_restart(autojump_clock):
    rows = [{"i": i} for i in range(6)]
    config = EngineConfig(consumer_batch_size=2, max_head_offpolicyness=0)
    async with open_rollout_engine(_sim(), config, reward_pool=InProcessRewardPool()) as engine:
        first = await engine.prepare_batch(rows, OneGen())
        with pytest.raises(DatasetError, match=r"different object .* engine.reset_data_stream\(\)"):
            await engine.prepare_batch(list(rows), OneGen())
        engine.set_version(1)
        second = await engine.prepare_batch(rows, OneGen())  # the same object continues
        assert engine.data_stream.source is rows
        engine.reset_data_stream()
        other = DataStream([{"i": 100 + i} for i in range(4)])
        engine.set_version(2)
        third = await engine.prepare_batch(other, OneGen())
    assert sorted(first["rewards"].tolist()) == [0.0, 1.0]
    assert sorted(second["rewards"].tolist()) == [2.0, 3.0]
    # items already in flight from the old stream come first (oldest first), then the new stream's
    assert set(third["rewards"].tolist()) <= {4.0, 5.0, 100.0, 101.0}


def test_data_stream_epochs_batches_and_restore():
    stream = DataStream([[{"i": 0}, {"i": 1}], [{"i": 2}]])  # batches as lists of rows
    taken = [stream.take()[1]["i"] for _ in range(5)]
    assert taken == [0, 1, 2, 0, 1]
    assert (stream.epoch, stream.position, stream.items_taken) == (1, 2, 5)
    restored = DataStream([[{"i": 0}, {"i": 1}], [{"i": 2}]])
    restored.load_state_dict(stream.state_dict())
    assert restored.take()[1]["i"] == 2 and restored.epoch == 1
    with pytest.raises(DatasetError, match="yielded no items"):
        DataStream([]).take()


# -- 13.4: one-pass dataloaders --------------------------------------------------------------------
async def test_a_generator_dataloader_returns_what_there_is_then_says_exhausted(autojump_clock):
    def rows():
        for i in range(7):
            yield {"i": i}

    config = EngineConfig(consumer_batch_size=3, max_head_offpolicyness=None, max_concurrent_rollouts=4)
    got = []
    async with open_rollout_engine(_sim(), config, reward_pool=InProcessRewardPool()) as engine:
        gen = rows()
        for _ in range(3):
            got.append(sorted((await engine.prepare_batch(gen, OneGen()))["rewards"].tolist()))
        with pytest.raises(DataExhaustedError, match="exhausted after 7 items"):
            await engine.prepare_batch(gen, OneGen())
        with pytest.raises(DataExhaustedError):
            await engine.prepare_batch(gen, OneGen())
        s = engine.statistics()
    assert [len(b) for b in got] == [3, 3, 1]  # the last batch is partial
    assert sorted(sum(got, [])) == [float(i) for i in range(7)]  # every item exactly once, none lost
    assert (s.submitted, s.accepted, s.results_waiting) == (7, 7, 0)


# -- 5. timeouts say why -----------------------------------------------------------------------------
async def test_prepare_batch_timeouts_say_why(autojump_clock):
    rows = [{"i": i} for i in range(100)]
    config = EngineConfig(consumer_batch_size=2, max_head_offpolicyness=0)
    async with open_rollout_engine(_sim(), config, reward_pool=InProcessRewardPool()) as engine:
        await engine.prepare_batch(rows, OneGen())
        await trio.sleep(5)
        with pytest.raises(TimeoutError, match=r"staleness bound .* set_version\(\)"):
            await engine.prepare_batch(rows, OneGen(), timeout=10)
        engine.set_version(1)
        await engine.prepare_batch(rows, OneGen())
        engine.pause()
        engine.set_version(2)
        with pytest.raises(TimeoutError, match=r"paused \(call resume\(\)\)"):
            await engine.prepare_batch(rows, OneGen(), timeout=10)
        engine.resume()

    wf = OneGen()
    wf.broken = True
    config = EngineConfig(consumer_batch_size=2, max_concurrent_rollouts=2, failure_breaker_consecutive=None,
                          failure_breaker_rate=None)
    async with open_rollout_engine(_sim(), config, reward_pool=InProcessRewardPool()) as engine:
        with pytest.raises(TimeoutError, match=r"ended episodes failed \(workflow_error: \d+\)"):
            await engine.prepare_batch(rows, wf, timeout=10)


async def test_config_rejects_bad_breaker_settings():
    with pytest.raises(ValueError, match="failure_breaker_rate"):
        EngineConfig(failure_breaker_rate=1.5)
    with pytest.raises(ValueError, match="failure_breaker_consecutive"):
        EngineConfig(failure_breaker_consecutive=0)


# -- the data position in a trainer's checkpoint ---------------------------------------------------
async def test_state_dict_carries_the_data_position_so_a_restored_trainer_continues(autojump_clock):
    rows = [{"i": i} for i in range(40)]
    config = EngineConfig(consumer_batch_size=2, max_head_offpolicyness=0)
    seen = []
    async with open_rollout_engine(_sim(), config, reward_pool=InProcessRewardPool()) as engine:
        for step in range(2):
            seen += (await engine.prepare_batch(rows, OneGen()))["rewards"].tolist()
            engine.set_version(step + 1)
        state = engine.state_dict()
    assert state["data_position"]["position"] == engine.statistics().data_position["position"] > 4
    async with open_rollout_engine(_sim(), config, reward_pool=InProcessRewardPool()) as restored:
        restored.load_state_dict(state, OneGen())  # in-flight episodes are re-submitted
        for _ in range(6):
            seen += (await restored.prepare_batch(rows, OneGen()))["rewards"].tolist()
            restored.set_version(restored.version + 1)
    assert len(seen) == len(set(seen)) == 16  # no item read twice across the checkpoint


async def test_after_a_fix_the_failures_still_in_flight_do_not_trip_the_breaker_again(autojump_clock):
    """Regression (new-user trial): with many episodes in flight when the breaker opened,
    the calls after the fix raised again on the old episodes' failures."""
    loader = [{"i": i} for i in range(1000)]
    wf = OneGen()
    wf.broken = True
    config = EngineConfig(consumer_batch_size=4, max_concurrent_rollouts=128, failure_breaker_consecutive=8)
    backend = SimBackend(SimConfig(vocab_size=50, out_len_median=25, out_len_sigma=1.0, per_token_s=0.02, seed=1))
    async with open_rollout_engine(backend, config, reward_pool=InProcessRewardPool()) as engine:
        with pytest.raises(EpisodeFailuresError):
            await engine.prepare_batch(loader, wf)
        assert engine.statistics().running > 8  # many still in flight with the broken workflow
        fixed = OneGen()
        batch = await engine.prepare_batch(loader, fixed)  # the first call after the fix works
        assert batch.batch_size[0] == 4


async def test_a_long_wait_without_a_timeout_logs_why(autojump_clock, caplog):
    rows = [{"i": i} for i in range(100)]
    config = EngineConfig(consumer_batch_size=2, max_head_offpolicyness=0)
    caplog.set_level(logging.WARNING, logger="rollout.engine.executor")
    async with open_rollout_engine(_sim(), config, reward_pool=InProcessRewardPool()) as engine:
        await engine.prepare_batch(rows, OneGen())
        async with trio.open_nursery() as nursery:
            nursery.start_soon(engine.prepare_batch, rows, OneGen())  # no timeout: set_version forgotten
            await trio.sleep(130)
            engine.set_version(1)  # the trainer remembers; the call returns
    waits = [r.getMessage() for r in caplog.records if "prepare_batch has waited" in r.getMessage()]
    assert len(waits) == 2 and "staleness bound" in waits[0] and "set_version()" in waits[0]


def test_the_facade_switches_data_streams():
    rows = [{"i": i} for i in range(20)]
    with RolloutEngineThread(_sim(per_token_s=0.001), EngineConfig(consumer_batch_size=2),
                             reward_pool=InProcessRewardPool()) as engine:
        engine.prepare_batch(rows, OneGen())
        assert engine.data_stream.source is rows
        with pytest.raises(DatasetError, match="reset_data_stream"):
            engine.prepare_batch(list(rows), OneGen())
        engine.reset_data_stream()
        assert engine.prepare_batch(list(rows), OneGen()).batch_size[0] == 2

"""Tests of reward actors, AsyncRewardWrapper, micro-batching, statistics and shutdown.

Tier: contract: real spawn worker processes (trio-parallel), real (short)
timeouts; the in-process ``async def`` tests use ``autojump_clock`` (no process
involved there).  Synchronisation with a running worker goes through a named
pipe, never a sleep; the only real-time loop waits (with a deadline) for the OS
to reap processes after the pool closed.  Worker-side code lives in
``tests/fixtures/reward_fixtures.py``.
"""

from __future__ import annotations

import functools
import os
import threading
from pathlib import Path

import pytest
import trio

import reward_fixtures as fx
from engine.errors import RewardError
from rewards import (
    AsyncRewardWrapper,
    RewardActor,
    collect_reward_outcomes,
    current_reward_pool,
    open_reward_pool,
)

ARGS = ("What is 6 * 3?", "6 * 3 = 18\n#### 18", [1, 2, 3], [4, 5])


def make_fifo(tmp_path: Path) -> str:
    path = tmp_path / "pid.fifo"
    os.mkfifo(path)
    return str(path)


async def read_pid(fifo: str) -> int:
    """Block (in a thread) until the worker has written its pid into ``fifo``."""
    with trio.fail_after(30):
        text = await trio.to_thread.run_sync(Path(fifo).read_text, abandon_on_cancel=True)
    return int(text)


def lines(path: Path) -> list[str]:
    return path.read_text().split() if path.exists() else []


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


async def wait_until_gone(pids: set[int], within_s: float = 10.0) -> None:
    """Poll (real time, with a deadline) until the OS has reaped every pid."""
    with trio.fail_after(within_s):
        while any(alive(pid) for pid in pids):
            await trio.sleep(0.05)


# ------------------------------------------------------------------ the pool


async def test_hang_is_killed_within_timeout_while_20_others_complete(tmp_path):
    fifo = make_fifo(tmp_path)
    timeout = 2.0
    async with open_reward_pool(max_workers=2, timeout_seconds=timeout, max_retries=0) as pool:
        await pool.score(fx.return_pid, *ARGS)  # a warm worker for the hung call
        hung, others = {}, []

        async def hang() -> None:
            hung["outcome"] = await pool.score(fx.announce_pid_then_sleep, *ARGS, fifo=fifo)

        async def other() -> None:
            others.append(await pool.score(fx.return_pid, *ARGS))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(hang)
            hung_pid = await read_pid(fifo)
            during = pool.statistics()
            for _ in range(20):
                nursery.start_soon(other)
        stats = pool.statistics()
    outcome = hung["outcome"]
    assert outcome.is_fallback and outcome.reward == 0.0
    assert timeout <= outcome.latency_s <= timeout + 1.0
    assert not alive(hung_pid)
    assert len(others) == 20 and not any(o.is_fallback for o in others)
    assert hung_pid not in {int(o.reward) for o in others}
    assert during.workers_busy == 1
    assert (stats.fallbacks, stats.successes, stats.timeouts) == (1, 21, 1)
    assert (stats.workers_killed, stats.worker_restarts, stats.workers_busy) == (1, 1, 0)
    assert stats.workers_idle >= 1
    assert 0.0 <= stats.latency_p50_s <= stats.latency_p99_s


async def test_closing_the_pool_leaves_no_worker_process(tmp_path):
    async with open_reward_pool(max_workers=2, timeout_seconds=10.0) as pool:
        outcomes = []

        async def call() -> None:
            outcomes.append(await pool.score(fx.PidActor(str(tmp_path / "s")), *ARGS, seconds=0.2))

        async with trio.open_nursery() as nursery:
            for _ in range(4):
                nursery.start_soon(call)
        pids = {int(o.reward) for o in outcomes}
        assert pids and all(alive(pid) for pid in pids)
    await wait_until_gone(pids)
    assert pool.statistics().workers_idle == 0


# ---------------------------------------------------------------- reward actors


async def test_actor_setup_runs_once_per_worker_and_again_after_a_kill(tmp_path):
    log = tmp_path / "setup.log"
    actor = fx.CountingActor(str(log))
    async with open_reward_pool(max_workers=1, timeout_seconds=2.0, max_retries=0) as pool:
        served = [(await pool.score(actor, *ARGS)).reward for _ in range(3)]
        assert served == [1.0, 2.0, 3.0]  # state survives between calls
        assert len(lines(log)) == 1

        hung = await pool.score(actor, *ARGS, hang=True)  # killed at the timeout
        assert hung.is_fallback
        after = await pool.score(actor, *ARGS)
        assert after.reward == 1.0  # a fresh process, a fresh setup()
        first_pid, second_pid = lines(log)
        assert first_pid != second_pid and not alive(int(first_pid))

        other = fx.CountingActor(str(log))  # another actor: its own setup
        assert (await pool.score(other, *ARGS)).reward == 1.0
        assert (await pool.score(actor, *ARGS)).reward == 2.0
        stats = pool.statistics()
    assert lines(log) == [first_pid, second_pid, second_pid]
    assert (stats.workers_killed, stats.worker_restarts, stats.fallbacks) == (1, 1, 1)


async def test_actor_is_set_up_once_in_each_worker_that_serves_it(tmp_path):
    log = tmp_path / "setup.log"
    actor = fx.PidActor(str(log))
    async with open_reward_pool(max_workers=2, timeout_seconds=10.0) as pool:
        outcomes = []

        async def call() -> None:
            outcomes.append(await pool.score(actor, *ARGS, seconds=0.05))

        async with trio.open_nursery() as nursery:
            for _ in range(10):
                nursery.start_soon(call)
    setups = lines(log)
    assert len(setups) == len(set(setups))  # never twice in one process
    assert set(setups) == {str(int(o.reward)) for o in outcomes}


async def test_actor_setup_has_its_own_timeout():
    # setup takes longer than a call may: it runs under setup_timeout_seconds.
    async with open_reward_pool(max_workers=1, timeout_seconds=1.0, max_retries=0) as pool:
        await pool.score(fx.return_pid, *ARGS)  # start the worker outside the timed call
        outcome = await pool.score(fx.SlowSetupActor(1.5), *ARGS)
    assert not outcome.is_fallback and outcome.attempts == 1 and outcome.latency_s > 1.5


async def test_actor_setup_error_is_retried_then_reward_error(tmp_path):
    log = tmp_path / "setup.log"
    async with open_reward_pool(max_workers=1, timeout_seconds=10.0, max_retries=1) as pool:
        with pytest.raises(RewardError) as info:
            await pool.score(fx.BrokenSetupActor(str(log)), *ARGS)
    message = str(info.value)
    assert "BrokenSetupActor" in message and "ValueError" in message and "no grader" in message
    assert len(lines(log)) == 2  # setup is retried: it was never registered


async def test_actor_state_need_not_be_picklable_if_made_in_setup():
    async with open_reward_pool(max_workers=1, timeout_seconds=10.0) as pool:
        assert (await pool.score(fx.LockInSetupActor(), *ARGS)).reward == 0.5
        with pytest.raises(RewardError, match="LockInInitActor.*cannot be pickled.*setup"):
            await pool.score(fx.LockInInitActor(), *ARGS)


def test_actor_key_survives_pickling_and_copies():
    import copy
    import pickle

    actor = fx.CountingActor("log")
    assert pickle.loads(pickle.dumps(actor)).actor_key == actor.actor_key
    assert copy.copy(actor).actor_key == actor.actor_key
    assert fx.CountingActor("log").actor_key != actor.actor_key


class Judge(RewardActor):
    """An async actor (an LLM judge): async setup, state across calls."""

    def __init__(self) -> None:
        self.setups = 0

    async def setup(self) -> None:
        await trio.sleep(5)  # connect, warm up
        self.setups += 1
        self.seen = 0

    async def __call__(self, prompt, completions, prompt_ids, completion_ids, *, hang=False, **d):
        if hang:
            await trio.sleep_forever()
        await trio.sleep(1)
        self.seen += 1
        return self.seen


async def test_async_actor_setup_once_then_calls_keep_state(autojump_clock):
    judge = Judge()
    async with open_reward_pool(timeout_seconds=2.0) as pool:  # setup 5 s > 2 s: own timeout
        outcomes = []

        async def call() -> None:
            outcomes.append(await pool.score(judge, *ARGS))

        async with trio.open_nursery() as nursery:
            for _ in range(3):  # concurrent first calls: one setup
                nursery.start_soon(call)
        assert judge.setups == 1
        assert sorted(o.reward for o in outcomes) == [1.0, 2.0, 3.0]
        assert all(o.attempts == 1 and not o.is_fallback for o in outcomes)


async def test_async_actor_timeout_retries_then_falls_back(autojump_clock):
    judge = Judge()
    async with open_reward_pool(timeout_seconds=3.0, max_retries=2) as pool:
        start = trio.current_time()
        outcome = await pool.score(judge, *ARGS, hang=True)
        elapsed = trio.current_time() - start
        stats = pool.statistics()
    assert outcome.is_fallback and outcome.reward == 0.0 and outcome.attempts == 3
    assert elapsed == pytest.approx(5.0 + 3 * 3.0)  # setup once, then three attempts
    assert (stats.timeouts, stats.retries, stats.fallbacks, stats.workers_killed) == (3, 2, 1, 0)


# ---------------------------------------------------------- AsyncRewardWrapper


async def test_wrapper_owns_a_pool_inside_async_with(tmp_path):
    wrapper = AsyncRewardWrapper(fx.sleep_forever, timeout_seconds=1, max_workers=1, max_retries=0)
    async with wrapper as w:
        reward = await w(*ARGS)
        assert current_reward_pool() is w._pool
    assert reward == 0.0 and type(reward) is float
    assert (w.calls, w.fallbacks) == (1, 1) and w.last_outcome.is_fallback
    with pytest.raises(RuntimeError, match="no reward pool"):
        await w(*ARGS)


async def hang_async(prompt, completions, prompt_ids, completion_ids, **data):
    await trio.sleep_forever()


async def length_async(prompt, completions, prompt_ids, completion_ids, **data):
    await trio.sleep(0.5)
    return len(completions)


async def test_bare_wrapper_uses_the_current_pool_with_its_own_policy(autojump_clock):
    hanging = AsyncRewardWrapper(hang_async, timeout_seconds=2, max_retries=1)
    length = AsyncRewardWrapper(length_async)
    with pytest.raises(RuntimeError, match="no reward pool"):
        await length(*ARGS)
    async with open_reward_pool(timeout_seconds=100.0, max_retries=3) as pool:
        results = {}

        async def episode() -> None:  # a task started inside the pool's scope
            with collect_reward_outcomes() as outcomes:
                results["length"] = await length(*ARGS)
                start = trio.current_time()
                results["hang"] = await hanging(*ARGS)
                results["hang_s"] = trio.current_time() - start
            results["outcomes"] = outcomes

        async with trio.open_nursery() as nursery:
            nursery.start_soon(episode)
        stats = pool.statistics()
    assert results["length"] == float(len(ARGS[1]))
    assert results["hang"] == 0.0 and results["hang_s"] == pytest.approx(4.0)  # 2 s x 2
    assert [o.is_fallback for o in results["outcomes"]] == [False, True]
    assert (stats.calls, stats.fallbacks, stats.timeouts) == (2, 1, 2)
    assert (hanging.fallbacks, length.fallbacks) == (1, 0)
    assert current_reward_pool() is None


async def test_wrapper_runs_sync_functions_and_actors_in_workers(tmp_path):
    log = tmp_path / "setup.log"
    async with open_reward_pool(max_workers=1, timeout_seconds=10.0):
        length = AsyncRewardWrapper(fx.length_reward)
        assert await length(*ARGS) == float(len(ARGS[1]))
        keywords = dict(prompt="q", completions="abc", prompt_ids=[], completion_ids=[])
        assert await length(**keywords) == 3.0  # AReaL passes arguments through unchanged
        counting = AsyncRewardWrapper(fx.CountingActor(str(log)))
        assert [await counting(*ARGS) for _ in range(2)] == [1.0, 2.0]
        outcome = await counting.score(*ARGS)
        assert (outcome.reward, outcome.is_fallback) == (3.0, False)
    assert len(lines(log)) == 1


def test_wrapper_rejects_bad_arguments_at_construction():
    lock = threading.Lock()

    def uses_lock(*args, **kwargs):
        return float(lock.locked())

    with pytest.raises(RewardError, match="uses_lock.*cannot be pickled"):
        AsyncRewardWrapper(uses_lock)
    with pytest.raises(ValueError, match="timeout_seconds"):
        AsyncRewardWrapper(fx.length_reward, timeout_seconds=-1)
    with pytest.raises(ValueError, match="max_retries"):
        AsyncRewardWrapper(fx.length_reward, max_retries=-1)
    with pytest.raises(ValueError, match="max_workers"):
        AsyncRewardWrapper(fx.length_reward, max_workers=0)
    AsyncRewardWrapper(hang_async)  # async: runs in-process, need not pickle


# --------------------------------------------------------------- micro-batching


async def test_batching_keeps_each_calls_result_and_errors(tmp_path):
    async with open_reward_pool(max_workers=1, timeout_seconds=10.0, batch_size=8,
                                max_retries=1) as pool:
        await pool.score(fx.return_pid, *ARGS)  # start the worker
        results, errors = {}, []

        async def call(i: int) -> None:
            results[i] = await pool.score(fx.return_value, *ARGS, value=i)

        async def failing() -> None:
            with pytest.raises(RewardError, match="bad input 42"):
                await pool.score(fx.raise_value_error, *ARGS, log=str(tmp_path / "log"))
            errors.append(1)

        async with trio.open_nursery() as nursery:
            for i in range(20):
                nursery.start_soon(call, i)
            nursery.start_soon(failing)
        stats = pool.statistics()
    assert {i: o.reward for i, o in results.items()} == {i: float(i) for i in range(20)}
    assert errors == [1] and len(lines(tmp_path / "log")) == 2  # raised, retried alone
    assert 1 <= stats.batches < 21  # calls shared worker jobs
    assert (stats.successes, stats.errors, stats.batch_failures) == (21, 1, 0)


@pytest.mark.parametrize("workers", [1, 2])  # 1: the batcher runs batches on its own task
async def test_batching_a_hang_or_crash_costs_the_others_nothing(workers):
    async with open_reward_pool(max_workers=workers, timeout_seconds=1.5, max_retries=0,
                                batch_size=8) as pool:
        outcomes = {}

        async def call(name, fn, **data) -> None:
            outcomes[name] = await pool.score(fn, *ARGS, **data)

        async def crash() -> None:
            with pytest.raises(RewardError, match="died"):
                await pool.score(fx.crash_always, *ARGS)
            outcomes["crash"] = "raised"

        async with trio.open_nursery() as nursery:
            nursery.start_soon(call, "hang", fx.sleep_forever)
            nursery.start_soon(crash)
            for i in range(12):
                nursery.start_soon(functools.partial(call, i, fx.return_value, value=i))
        stats = pool.statistics()
    assert outcomes.pop("hang").is_fallback
    assert outcomes.pop("crash") == "raised"  # alone or in a batch that died and was re-run alone: it died
    assert {k: (o.reward, o.is_fallback) for k, o in outcomes.items()} == {
        i: (float(i), False) for i in range(12)
    }
    assert stats.worker_deaths >= 1  # (adaptive batching: the crash may have found a worker free and run alone)


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [({"batch_size": 0}, "batch_size"), ({"max_batch_delay_s": -1.0}, "max_batch_delay_s")],
)
async def test_invalid_batch_arguments(kwargs, name):
    with pytest.raises(ValueError, match=name):
        async with open_reward_pool(**kwargs):
            pass


async def test_exceptions_from_the_block_come_out_unwrapped_with_batching():
    with pytest.raises(KeyError):
        async with open_reward_pool(batch_size=4):
            raise KeyError("mine")

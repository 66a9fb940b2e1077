"""Tests of the ``rewards`` package.

Tier: contract: real spawn worker processes (trio-parallel).  Worker timeouts are
real (short) time, never ``autojump_clock`` (the virtual clock jumps while a real
process works); the in-process ``async def`` reward tests do use virtual time.
Synchronisation with a running worker goes through a named pipe, never a sleep.
Worker-side functions live in ``tests/fixtures/reward_fixtures.py``.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import trio

import reward_fixtures as fx
import rewards
from engine.errors import RewardError
from rewards import RewardOutcome, extract_answer, gsm8k_reward, open_reward_pool
from rewards._options import default_max_workers
from rewards.gsm8k import parse_number
import trio.lowlevel

ARGS = ("What is 6 * 3?", "6 * 3 = 18\n#### 18", [1, 2, 3], [4, 5])
GSM8K_TEST = Path("/work/shared/data/gsm8k/test.jsonl")


def make_fifo(tmp_path: Path) -> str:
    path = tmp_path / "pid.fifo"
    os.mkfifo(path)
    return str(path)


async def read_pid(fifo: str) -> int:
    """Block (in a thread) until the worker has written its pid into ``fifo``."""
    with trio.fail_after(30):
        text = await trio.to_thread.run_sync(Path(fifo).read_text, abandon_on_cancel=True)
    return int(text)


def assert_process_gone(pid: int) -> None:
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


# --------------------------------------------------------------------------- pool


async def test_timeout_kills_its_worker_while_another_call_completes(tmp_path):
    fifo = make_fifo(tmp_path)
    async with open_reward_pool(max_workers=2, timeout_seconds=2.5, max_retries=0) as pool:
        hung: dict[str, RewardOutcome] = {}

        async def hang() -> None:
            hung["outcome"] = await pool.score(fx.announce_pid_then_sleep, *ARGS, fifo=fifo)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(hang)
            hung_pid = await read_pid(fifo)
            ok = await pool.score(fx.return_pid, *ARGS)
            during = pool.statistics()
        assert not ok.is_fallback and ok.attempts == 1
        assert int(ok.reward) != hung_pid
        assert during.busy == 1 and during.timeouts == 0  # the hung call was still running

        assert hung["outcome"].is_fallback and hung["outcome"].reward == 0.0
        assert_process_gone(hung_pid)
        after = await pool.score(fx.return_pid, *ARGS)
        assert not after.is_fallback and int(after.reward) != hung_pid
        stats = pool.statistics()
    assert (stats.calls, stats.successes, stats.timeouts, stats.fallbacks) == (3, 2, 1, 1)
    assert stats.busy == 0


async def test_timeouts_are_retried_then_fall_back_with_a_flag(tmp_path, caplog):
    log = tmp_path / "attempts.log"
    caplog.set_level(logging.WARNING, logger="rollout.rewards._policy")
    async with open_reward_pool(
        timeout_seconds=0.5, max_retries=1, fallback_reward=-1.0
    ) as pool:
        outcome = await pool.score(fx.sleep_forever, *ARGS, log=str(log))
        stats = pool.statistics()
    assert outcome.is_fallback
    assert outcome.reward == -1.0 and type(outcome.reward) is float
    assert outcome.attempts == 2
    assert outcome.latency_s >= 1.0
    # Each attempt that got to run did so in a fresh process (a heavily loaded box
    # may spend a whole 0.5 s attempt starting the worker, so count <= 2).
    pids = log.read_text().split() if log.exists() else []
    assert len(set(pids)) == len(pids) <= 2
    assert (stats.timeouts, stats.retries, stats.fallbacks, stats.successes) == (2, 1, 1, 0)
    assert stats.latency_p50_s is None  # fallbacks are not successful calls
    assert any("fallback" in r.getMessage() for r in caplog.records)


async def test_cancelling_the_caller_kills_the_worker(tmp_path):
    fifo = make_fifo(tmp_path)
    async with open_reward_pool(max_workers=1, timeout_seconds=60.0, max_retries=0) as pool:
        with trio.CancelScope() as scope:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(
                    functools.partial(pool.score, fx.announce_pid_then_sleep, *ARGS, fifo=fifo)
                )
                pid = await read_pid(fifo)
                scope.cancel()
        assert scope.cancelled_caught
        assert_process_gone(pid)
        stats = pool.statistics()
        assert (stats.cancelled, stats.busy, stats.timeouts, stats.fallbacks) == (1, 0, 0, 0)
        # The slot was released: the pool still works.
        assert not (await pool.score(fx.return_pid, *ARGS)).is_fallback


async def test_a_call_in_flight_is_one_coroutine_of_the_pool(tmp_path):
    """While a (batched, the default) reward runs, the caller's await chain holds one
    coroutine of the pool: ``score`` returns ``score_call``'s, which waits on trio itself."""
    fifo = make_fifo(tmp_path)
    chain: list[str] = []
    async with open_reward_pool(max_workers=1, timeout_seconds=60.0, max_retries=0) as pool:
        assert pool.options.batch_size > 1
        call = pool.score(fx.announce_pid_then_sleep, *ARGS, fifo=fifo)
        assert call.cr_code.co_qualname == "RewardPool.score_call"
        tasks = []

        async def caller():
            tasks.append(trio.lowlevel.current_task())
            await call

        async with trio.open_nursery() as nursery:
            nursery.start_soon(caller)
            pid = await read_pid(fifo)
            awaited = tasks[0].coro.cr_await
            while awaited is not None and hasattr(awaited, "cr_code"):
                chain.append(awaited.cr_code.co_qualname)
                awaited = awaited.cr_await
            nursery.cancel_scope.cancel()
        assert_process_gone(pid)  # cancelling the call killed its worker
    assert chain == ["RewardPool.score_call", "wait_task_rescheduled"]


async def test_a_dead_worker_is_replaced_and_the_call_retried(tmp_path):
    marker = tmp_path / "crashed"
    async with open_reward_pool(timeout_seconds=10.0, max_retries=1) as pool:
        outcome = await pool.score(fx.crash_once, *ARGS, marker=str(marker))
        stats = pool.statistics()
    assert marker.exists()
    assert outcome == RewardOutcome(1.0, False, 2, outcome.latency_s)
    assert (stats.worker_deaths, stats.retries, stats.successes, stats.errors) == (1, 1, 1, 0)


async def test_a_worker_that_always_dies_raises_reward_error():
    async with open_reward_pool(timeout_seconds=10.0, max_retries=1) as pool:
        with pytest.raises(RewardError, match="died") as info:
            await pool.score(fx.crash_always, *ARGS)
        stats = pool.statistics()
    assert "crash_always" in str(info.value)
    assert (stats.worker_deaths, stats.errors, stats.fallbacks) == (2, 1, 0)


async def test_user_exception_is_retried_then_raised_as_reward_error(tmp_path):
    log = tmp_path / "attempts.log"
    async with open_reward_pool(timeout_seconds=10.0, max_retries=2) as pool:
        with pytest.raises(RewardError) as info:
            await pool.score(fx.raise_value_error, *ARGS, log=str(log))
        stats = pool.statistics()
    message = str(info.value)
    assert "ValueError" in message and "bad input 42" in message
    assert "raise_value_error" in message
    assert isinstance(info.value.__cause__, ValueError)
    assert len(log.read_text().split()) == 3  # max_retries + 1 attempts
    assert (stats.errors, stats.retries, stats.fallbacks, stats.successes) == (1, 2, 0, 0)


async def test_invalid_return_values_raise_reward_error_naming_the_type(tmp_path):
    cases = [
        (None, "NoneType"),
        (math.nan, "float (nan)"),
        (math.inf, "float (inf)"),
        ("x", "str ('x')"),
        (True, "bool"),
        ([1.0], "list"),
        (np.array([1.0, 2.0]), "numpy.ndarray"),
    ]
    log = tmp_path / "attempts.log"
    async with open_reward_pool(max_workers=1, timeout_seconds=10.0, max_retries=2) as pool:
        for value, type_name in cases:
            with pytest.raises(RewardError) as info:
                await pool.score(fx.return_value, *ARGS, value=value, log=str(log))
            assert type_name in str(info.value), (value, str(info.value))
        stats = pool.statistics()
    assert len(log.read_text().split()) == len(cases)  # never retried
    assert (stats.errors, stats.retries) == (len(cases), 0)


async def test_numeric_return_values_become_python_floats():
    async with open_reward_pool(max_workers=1, timeout_seconds=10.0) as pool:
        for value, expected in [
            (3, 3.0),
            (np.float32(0.5), 0.5),
            (np.int64(-2), -2.0),
            (np.array([0.25]), 0.25),
            (np.array(7), 7.0),
        ]:
            outcome = await pool.score(fx.return_value, *ARGS, value=value)
            assert outcome.reward == expected and type(outcome.reward) is float
            assert not outcome.is_fallback and outcome.attempts == 1
        stats = pool.statistics()
    assert stats.successes == 5
    assert 0.0 <= stats.latency_p50_s <= stats.latency_p99_s


async def test_unpicklable_function_or_argument_raises_a_clear_reward_error():
    lock = threading.Lock()

    def uses_lock(*args, **kwargs):
        return float(lock.locked())

    async with open_reward_pool(timeout_seconds=10.0) as pool:
        with pytest.raises(RewardError) as info:
            await pool.score(uses_lock, *ARGS)
        message = str(info.value)
        assert message.startswith("reward function ")
        assert "uses_lock" in message
        assert "cannot be pickled for a worker process" in message and "lock" in message

        with pytest.raises(RewardError, match="an argument of reward function .*return_value"):
            await pool.score(fx.return_value, *ARGS, value=threading.Lock())
        assert pool.statistics().errors == 2


async def test_job_that_cannot_be_unpickled_in_the_worker_is_not_retried():
    async with open_reward_pool(timeout_seconds=10.0, max_retries=3) as pool:
        with pytest.raises(RewardError, match="could not be unpickled in the worker") as info:
            await pool.score(fx.return_value, *ARGS, value=fx.LoadsOnlyInParent())
        stats = pool.statistics()
    assert "cannot be loaded in a worker" in str(info.value)
    assert (stats.errors, stats.retries) == (1, 0)


async def test_max_workers_bounds_worker_processes():
    async with open_reward_pool(max_workers=1, timeout_seconds=10.0) as pool:
        outcomes = []

        async def call() -> None:
            outcomes.append(await pool.score(fx.return_pid, *ARGS))

        async with trio.open_nursery() as nursery:
            for _ in range(3):
                nursery.start_soon(call)
    assert len({o.reward for o in outcomes}) == 1  # one worker served all three


async def test_timeout_does_not_count_time_waiting_for_a_free_worker():
    async with open_reward_pool(max_workers=1, timeout_seconds=1.0, max_retries=0) as pool:
        await pool.score(fx.return_pid, *ARGS)  # start the worker outside the timed calls
        outcomes = []

        async def call() -> None:
            outcomes.append(await pool.score(fx.sleep_then_return, *ARGS, seconds=0.6))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(call)
            nursery.start_soon(call)
    # Run one after the other: the second finishes ~1.2 s after it was submitted.
    assert [o.is_fallback for o in outcomes] == [False, False]
    assert max(o.latency_s for o in outcomes) > 1.0


async def test_gsm8k_reward_runs_in_a_forkserver_worker():
    async with open_reward_pool(worker_type="forkserver", timeout_seconds=10.0) as pool:
        right = await pool.score(gsm8k_reward, *ARGS, answer="6 * 3 = 18\n#### 18")
        wrong = await pool.score(gsm8k_reward, "q", "#### 17", [], [], answer="#### 18")
    assert (right.reward, wrong.reward) == (1.0, 0.0)


async def test_use_after_close_raises_closed_resource_error():
    async with open_reward_pool(timeout_seconds=10.0) as pool:
        pass
    with pytest.raises(trio.ClosedResourceError):
        await pool.score(fx.return_pid, *ARGS)
    assert pool.statistics().calls == 0


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"timeout_seconds": -1.0}, "timeout_seconds"),
        ({"timeout_seconds": math.nan}, "timeout_seconds"),
        ({"timeout_seconds": 0}, "timeout_seconds"),
        ({"max_retries": -1}, "max_retries"),
        ({"max_workers": 0}, "max_workers"),
        ({"fallback_reward": math.inf}, "fallback_reward"),
        ({"worker_type": "fork"}, "worker_type"),
    ],
)
async def test_invalid_arguments_raise_value_error_naming_them(kwargs, name):
    with pytest.raises(ValueError, match=name):
        async with open_reward_pool(**kwargs):
            pass


def test_default_max_workers_follows_areal(monkeypatch):
    class FakeCuda:
        @staticmethod
        def device_count() -> int:
            return 4

    class FakeTorch:
        cuda = FakeCuda

    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    monkeypatch.setitem(sys.modules, "torch", FakeTorch)
    assert default_max_workers() == 64 // 4 // 2
    monkeypatch.delitem(sys.modules, "torch")
    assert default_max_workers() == 32  # no GPU information: device_count = 1
    monkeypatch.setattr(os, "cpu_count", lambda: 1)
    assert default_max_workers() == 1


# ------------------------------------------------------------ async reward functions


async def hang_async(prompt, completions, prompt_ids, completion_ids, **data):
    await trio.sleep_forever()


async def judge_async(prompt, completions, prompt_ids, completion_ids, *, value, **data):
    await trio.sleep(1)
    return value


async def test_async_reward_timeout_falls_back(autojump_clock):
    async with open_reward_pool() as pool:  # AReaL defaults: 15 s, 3 retries
        outcome = await pool.score(hang_async, *ARGS)
        stats = pool.statistics()
    assert outcome.is_fallback and outcome.reward == 0.0 and outcome.attempts == 4
    assert outcome.latency_s == pytest.approx(60.0)
    assert (stats.timeouts, stats.retries, stats.fallbacks) == (4, 3, 1)


async def test_async_reward_values_and_errors(autojump_clock):
    async with open_reward_pool(max_retries=1) as pool:
        outcome = await pool.score(judge_async, *ARGS, value=2)
        assert (outcome.reward, outcome.is_fallback, outcome.attempts) == (2.0, False, 1)
        assert outcome.latency_s == pytest.approx(1.0)
        with pytest.raises(RewardError, match="NoneType"):
            await pool.score(judge_async, *ARGS, value=None)
        with pytest.raises(RewardError, match="ZeroDivisionError"):
            await pool.score(_divide_by_zero_async, *ARGS)
        stats = pool.statistics()
    assert (stats.successes, stats.errors, stats.retries) == (1, 2, 1)  # None: not retried


async def _divide_by_zero_async(prompt, completions, prompt_ids, completion_ids, **data):
    await trio.lowlevel.checkpoint()
    return 1 / 0


# --------------------------------------------------------------------- GSM8K


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("so 16 - 3 - 4 = 9 eggs, 9 * 2 = 18\n#### 18", "18"),
        ("#### 1,000 dollars", "1,000"),
        ("first #### 3 then #### 4", "4"),
        ("The answer is \\boxed{42}.", "42"),
        ("\\boxed{1} then \\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
        ("I think 3 apples and then 5.", "5"),
        ("It costs $1,234.50 in total", "$1,234.50"),
        ("no numbers here", None),
        ("", None),
    ],
)
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("18", 18.0),
        ("18.0", 18.0),
        ("18.", 18.0),
        ("$18", 18.0),
        ("\\$18", 18.0),
        ("1,000", 1000.0),
        ("-3", -3.0),
        (".5", 0.5),
        ("50%", 50.0),
        ("1/2", None),
        ("1,0", None),
        ("nan", None),
        ("inf", None),
        ("eighteen", None),
    ],
)
def test_parse_number(text, expected):
    assert parse_number(text) == expected


@pytest.mark.parametrize(
    ("completion", "answer", "reward"),
    [
        ("9 * 2 = 18\n#### 18", "#### 18", 1.0),
        ("The answer is \\boxed{18}.", "#### 18", 1.0),
        ("She makes 9 * 2 = 18 dollars.", "#### 18", 1.0),
        ("#### 1,000", "#### 1000", 1.0),
        ("She makes $18.", "#### 18", 1.0),
        ("#### 18.0", "#### 18", 1.0),
        ("#### 17", "#### 18", 0.0),
        ("I do not know.", "#### 18", 0.0),
        ("#### 18", "18", 1.0),  # gold without ####: the whole string
        ("\\boxed{\\frac{1}{2}}", "0.5", 1.0),  # symbolic: math_verify
        ("\\boxed{\\frac{1}{3}}", "0.5", 0.0),
    ],
)
def test_gsm8k_reward(completion, answer, reward):
    assert gsm8k_reward("q", completion, [], [], answer=answer) == reward


def test_gsm8k_reward_on_a_real_test_row():
    if not GSM8K_TEST.exists():
        pytest.skip(f"{GSM8K_TEST} is not on this machine")
    with GSM8K_TEST.open() as f:
        row = json.loads(f.readline())
    assert row["answer"].rstrip().endswith("#### 18")  # Janet's ducks
    assert gsm8k_reward(row["question"], row["answer"], [], [], answer=row["answer"]) == 1.0
    wrong = row["answer"].replace("#### 18", "#### 19")
    assert gsm8k_reward(row["question"], wrong, [], [], answer=row["answer"]) == 0.0


# ------------------------------------------------------------------- public API


def test_public_names_are_sorted_and_exported():
    assert rewards.__all__ == sorted(rewards.__all__)
    for name in rewards.__all__:
        assert getattr(rewards, name) is not None
    assert set(rewards.__all__) <= set(dir(rewards))


def test_importing_rewards_does_not_import_heavy_modules():
    code = (
        "import sys, rewards, rewards.math, rewards._worker, rewards._actor\n"
        "import rewards.gsm8k, rewards.format, rewards.code\n"
        "heavy = {'torch', 'transformers', 'trio', 'trio_parallel', 'math_verify'}\n"
        "assert not heavy & set(sys.modules), heavy & set(sys.modules)\n"
        "from rewards import open_reward_pool\n"
        "assert not {'torch', 'transformers'} & set(sys.modules)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


async def test_a_prompt_column_does_not_collide_with_the_reward_arguments():
    """Regression (new-user trial): a dataset with a ``prompt`` column failed every reward
    call with "multiple values for argument 'prompt'"."""
    async with open_reward_pool(max_workers=1) as pool:
        row = {"prompt": "the column", "answer": "#### 18", "completions": "x"}
        await pool.check_reward_fn(gsm8k_reward, row)
        outcome = await pool.score(gsm8k_reward, *ARGS, **row)
    assert outcome.reward == 1.0

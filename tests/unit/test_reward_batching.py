"""Adaptive reward micro-batching (``rewards._batch``), the default of the pool and the engine.

The batcher is driven against a fake pool whose worker jobs take ``cost_s`` per
call on trio's clock, so ``autojump_clock`` makes every timing exact: a lone
call is not held back, batches form under load, split over free workers, and
stay small for slow rewards or after a failed batch.  The real pool is checked
with real worker processes (real time, no timing asserts).
"""

from __future__ import annotations

import math

import pytest
import trio

from engine import EngineConfig
from rewards import open_reward_pool
from rewards._batch import BATCH_WORK_S, DEFAULT_BATCH_SIZE, Batcher, BatchFailed
from rewards._board import Progress
from rewards._slots import BatchInterrupted, JobTimeout
from rewards._stats import Counters
from rewards._worker import OK

import reward_fixtures as fx


class _FakePool:
    """What the batcher uses of a pool's WorkerSlots: ``limiter``, ``run_batch``, ``counters``."""

    def __init__(self, workers: int, cost_s: float, fail_when: float | None = None) -> None:
        self.limiter = trio.CapacityLimiter(workers)
        self.counters = Counters()
        self.cost_s = cost_s
        self.fail_when = fail_when  # a job holding a call whose value is this times out
        self.jobs: list[tuple[float, list[int]]] = []  # (start time, values)
        self.killed: list[float] = []  # when a running job was cancelled (its worker killed)

    async def run_batch(self, jobs, timeout, nursery):
        values = [int(job) for job in jobs]
        self.jobs.append((trio.current_time(), values))
        if self.fail_when in values:  # the calls before it finished (recorded); it hangs
            hung = values.index(self.fail_when)
            await trio.sleep(timeout)
            done = tuple((OK, float(v)) for v in values[:hung])
            raise BatchInterrupted(JobTimeout(), Progress(hung, done, False))  # the worker killed
        work = self.cost_s * len(values)
        try:
            await trio.sleep(work)
        except trio.Cancelled:
            self.killed.append(trio.current_time())
            raise
        return [(OK, float(v)) for v in values], work


async def _calls(batcher: Batcher, values, results: dict) -> None:
    async def one(v: int) -> None:
        try:
            results[v] = await batcher.run(str(v).encode(), 10.0)
        except BatchFailed:
            results[v] = "failed"  # re-run alone by the pool
        except JobTimeout:
            results[v] = "its own timeout"  # the attempt's outcome, as without batching

    async with trio.open_nursery() as nursery:
        for v in values:
            nursery.start_soon(one, v)


async def _with_batcher(pool: _FakePool, body, batch_size: int = DEFAULT_BATCH_SIZE, delay: float = 0.0):
    async with trio.open_nursery() as nursery:
        batcher = Batcher(pool, nursery, batch_size, delay)
        nursery.start_soon(batcher.loop)
        await body(batcher)
        nursery.cancel_scope.cancel()
    return batcher


async def test_a_lone_reward_is_not_delayed(autojump_clock):
    pool = _FakePool(workers=1, cost_s=0.0002)
    done_at = []

    async def body(batcher):
        for start in (0.0, 5.0, 7.5):  # low load: one call at a time
            await trio.sleep_until(start)
            assert await batcher.run(b"1", 10.0) == (OK, 1.0)
            done_at.append(trio.current_time())

    batcher = await _with_batcher(pool, body)
    assert [t for t, _ in pool.jobs] == [0.0, 5.0, 7.5]  # each sent the moment it came: no wait for batch-mates
    assert [len(v) for _, v in pool.jobs] == [1, 1, 1]
    assert done_at == pytest.approx([0.0002, 5.0002, 7.5002])
    assert batcher.cap() == DEFAULT_BATCH_SIZE  # cheap calls: the cap is not what kept them alone


async def test_under_load_batches_form_from_what_waits(autojump_clock):
    pool = _FakePool(workers=1, cost_s=0.001)  # 1 ms per call: cap = 20 ms / 1 ms = 20
    results: dict = {}

    async def body(batcher):
        await _calls(batcher, range(101), results)

    await _with_batcher(pool, body)
    sizes = [len(v) for _, v in pool.jobs]
    assert sizes[0] == 1  # nothing measured yet: the first call goes alone
    assert sizes[1:] == [20] * 5  # then the backlog, 20 calls (~20 ms of work) per job
    assert results == {v: (OK, float(v)) for v in range(101)}  # each call its own result
    assert pool.counters.batches == 6 and pool.counters.batched_calls == 101
    assert trio.current_time() == pytest.approx(0.101)  # the worker never idled


async def test_a_backlog_is_split_evenly_over_free_workers(autojump_clock):
    pool = _FakePool(workers=4, cost_s=0.0001)
    results: dict = {}

    async def body(batcher):
        await _calls(batcher, [0], results)  # a first measurement
        pool.jobs.clear()
        await _calls(batcher, range(1, 41), results)  # 40 arrive at once, 4 workers free

    await _with_batcher(pool, body)
    assert sorted(len(v) for _, v in pool.jobs) == [10, 10, 10, 10]
    assert all(t == pytest.approx(0.0001) for t, _ in pool.jobs)  # all four ran at once
    assert len(results) == 41


async def test_slow_rewards_run_alone_even_under_load(autojump_clock):
    pool = _FakePool(workers=1, cost_s=0.5)  # 0.5 s per call: batching would hold others 0.5 s each
    results: dict = {}

    async def body(batcher):
        await _calls(batcher, range(6), results)

    batcher = await _with_batcher(pool, body)
    assert [len(v) for _, v in pool.jobs] == [1] * 6
    assert batcher.cap() == 1 and batcher.call_s == pytest.approx(0.5)
    assert len(results) == 6


async def test_a_failed_batch_makes_calls_run_alone_until_fast_ones_bring_the_estimate_down(autojump_clock):
    pool = _FakePool(workers=1, cost_s=0.0001, fail_when=7)
    results: dict = {}

    async def body(batcher):
        await _calls(batcher, [0], results)  # measured: cheap
        assert batcher.cap() == DEFAULT_BATCH_SIZE
        await _calls(batcher, range(1, 11), results)  # one batch holding the hanging call 7
        assert batcher.cap() == 1 and batcher.call_s == 10.0  # its timeout
        await _calls(batcher, [11], results)
        while batcher.cap() < DEFAULT_BATCH_SIZE:  # fast calls alone, one at a time
            await _calls(batcher, [12], results)

    await _with_batcher(pool, body)
    batch = pool.jobs[1][1]
    hung = batch.index(7)
    assert sorted(batch) == list(range(1, 11))
    assert all(results[v] == (OK, float(v)) for v in batch[:hung])  # finished before it: kept
    assert results[7] == "its own timeout"  # running when the batch was killed: its attempt failed
    assert all(results[v] == "failed" for v in batch[hung + 1:])  # not started: re-run alone, uncharged
    assert pool.counters.batch_failures == 1
    assert results[11] == (OK, 11.0)
    alone = [values for _, values in pool.jobs[2:]]
    assert alone and all(len(v) == 1 for v in alone)
    assert 20 < len(alone) < 100  # recovered in tens of calls, not never


async def test_a_call_that_ran_alone_fails_by_itself_not_as_a_batch(autojump_clock):
    pool = _FakePool(workers=1, cost_s=0.0001, fail_when=3)
    results: dict = {}

    async def body(batcher):
        await _calls(batcher, [3], results)  # alone (the first call): its timeout is its own

    batcher = await _with_batcher(pool, body)
    assert results == {3: "its own timeout"} and len(pool.jobs) == 1
    assert pool.counters.batch_failures == 0 and batcher.cap() == 1


async def test_cancelling_the_last_caller_kills_its_job_and_no_other(autojump_clock):
    pool = _FakePool(workers=1, cost_s=100.0)  # a reward that would run 100 s per call
    results: dict = {}

    async def body(batcher):
        with trio.move_on_after(1.0):  # alone in its job: cancelling it kills the job, then returns
            await batcher.run(b"1", 500.0)
        assert pool.killed == [1.0] and trio.current_time() == 1.0
        batcher.call_s = 1e-6  # cheap from now on: the next two share a job
        async with trio.open_nursery() as nursery:
            async def impatient():
                with trio.move_on_after(1.0):
                    await batcher.run(b"2", 500.0)

            async def patient():
                results[3] = await batcher.run(b"3", 500.0)

            nursery.start_soon(impatient)
            nursery.start_soon(patient)

    await _with_batcher(pool, body)
    assert [sorted(values) for _, values in pool.jobs] == [[1], [2, 3]]
    assert pool.killed == [1.0]  # the shared job ran on for the caller still waiting
    assert results == {3: (OK, 3.0)} and trio.current_time() == pytest.approx(201.0)


async def test_calls_of_another_timeout_wait_for_the_next_batch(autojump_clock):
    pool = _FakePool(workers=1, cost_s=0.0001)
    results: dict = {}

    async def body(batcher):
        await _calls(batcher, [0], results)  # measured: cheap
        async with trio.open_nursery() as nursery:
            for v, timeout in ((1, 10.0), (2, 10.0), (3, 5.0), (4, 10.0), (5, 5.0)):
                nursery.start_soon(_call_with_timeout, batcher, v, timeout, results)

    await _with_batcher(pool, body)
    assert sorted(results) == [0, 1, 2, 3, 4, 5]
    for _, values in pool.jobs[1:]:  # a batch is killed at its calls' one timeout, never at a shorter one
        assert len({5.0 if v in (3, 5) else 10.0 for v in values}) == 1, pool.jobs


async def _call_with_timeout(batcher: Batcher, v: int, timeout: float, results: dict) -> None:
    results[v] = await batcher.run(str(v).encode(), timeout)


def test_the_cap_follows_the_measured_call_time():
    batcher = Batcher.__new__(Batcher)
    batcher._batch_size, batcher._work_s, batcher.call_s = 64, BATCH_WORK_S, None
    assert batcher.cap() == 1
    for call_s, cap in ((1e-6, 64), (BATCH_WORK_S / 64, 64), (0.001, 20), (0.005, 4), (0.03, 1), (math.inf, 1)):
        batcher.call_s = call_s
        assert batcher.cap() == cap, call_s


def test_the_engine_and_the_pool_batch_by_default():
    assert EngineConfig().reward_batch_size == DEFAULT_BATCH_SIZE > 1
    assert EngineConfig().reward_max_batch_delay_s == 0.0  # never a fixed wait


@pytest.mark.slow
async def test_the_default_pool_batches_a_burst_and_keeps_every_result():
    async with open_reward_pool(max_workers=1, timeout_seconds=30.0) as pool:
        assert pool.options.batch_size == DEFAULT_BATCH_SIZE
        await pool.score(fx.return_value, "p", "c", [], [], value=-1)  # starts the worker, measured
        results = {}

        async def call(i: int) -> None:
            results[i] = (await pool.score(fx.return_value, "p", "c", [], [], value=i)).reward

        async with trio.open_nursery() as nursery:
            for i in range(40):
                nursery.start_soon(call, i)
        stats = pool.statistics()
    assert results == {i: float(i) for i in range(40)}
    assert stats.batched_calls == 41 and stats.batches < 41  # calls shared worker jobs
    assert stats.batch_failures == 0


@pytest.mark.slow
async def test_an_engine_with_default_settings_shares_worker_jobs_under_load():
    from engine import SimBackend, SimConfig, open_rollout_engine
    from engine.datasets import builtin_arith, to_item
    from engine.testing import build_tiny_tokenizer
    from engine.types import GenerationHyperparameters
    from workflows.rlvr import RLVRWorkflow

    tok = build_tiny_tokenizer()
    sim = SimBackend(SimConfig(vocab_size=len(tok), eos_token_id=tok.eos_token_id, first_token_id=0,
                               out_len_median=6, seed=1))  # zero latency: every reward is due at once
    items = [to_item(row) for row in builtin_arith(64)]
    workflow = RLVRWorkflow(fx.length_reward, GenerationHyperparameters(max_new_tokens=8), tok)
    async with open_rollout_engine(sim, EngineConfig(reward_max_workers=1)) as engine:
        batch = await engine.rollout_batch(items, workflow)
        stats = engine.statistics().rewards
    assert batch.batch_size[0] == 64 and not batch["reward_is_fallback"].any()
    assert stats.batched_calls == 64 and stats.batches < 32  # several calls per worker round trip

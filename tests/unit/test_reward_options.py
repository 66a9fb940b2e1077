"""The reward pool's two primitives: one frozen ``RewardPoolOptions`` and ``WorkerSlots``.

``RewardPoolOptions`` is the single source of the reward settings' defaults and
validation: ``open_reward_pool``, the Ray pool, ``EngineConfig.reward_*`` and
``AsyncRewardWrapper`` all take theirs from it.  ``WorkerSlots`` is driven with
a fake worker context whose jobs take time on trio's clock, so ``autojump_clock``
makes the timeout and queueing rules exact.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import types

import pytest
import trio
import trio.testing
import trio_parallel

from engine import EngineConfig, MockBackend, open_rollout_engine
from rewards import AsyncRewardWrapper, RewardPoolOptions, current_reward_pool, open_reward_pool
from rewards._options import DEFAULT_BATCH_SIZE
from rewards import open_ray_reward_pool
from rewards._slots import JobTimeout, WorkerSlots
from rewards._stats import Counters

FIELDS = [field.name for field in dataclasses.fields(RewardPoolOptions)]


# ------------------------------------------------------------------ options


def test_defaults_are_areals_and_batching_is_on():
    options = RewardPoolOptions()
    assert (options.timeout_seconds, options.max_retries, options.fallback_reward) == (15.0, 3, 0.0)
    assert options.max_workers is None and options.worker_type == "spawn"
    assert options.batch_size == DEFAULT_BATCH_SIZE == 64 and options.max_batch_delay_s == 0.0


def test_engine_config_and_wrapper_take_their_defaults_from_the_options():
    defaults, config = RewardPoolOptions(), EngineConfig()
    assert config.reward_options == defaults
    for name in FIELDS:
        if name != "fallback_reward":  # not an engine setting (AReaL's engine has none either)
            assert getattr(config, f"reward_{name}") == getattr(defaults, name), name
    wrapper = inspect.signature(AsyncRewardWrapper).parameters
    for name in ("timeout_seconds", "max_workers", "max_retries"):
        assert wrapper[name].default == getattr(defaults, name), name
    # the openers have no defaults of their own for the options: keywords override RewardPoolOptions()
    for opener in (open_reward_pool, open_ray_reward_pool):
        assert not set(FIELDS) & set(inspect.signature(opener).parameters), opener.__name__


@pytest.mark.parametrize(
    ("changes", "name"),
    [
        ({"max_workers": 0}, "max_workers"),
        ({"max_workers": 2.0}, "max_workers"),
        ({"timeout_seconds": 0}, "timeout_seconds"),
        ({"timeout_seconds": math.nan}, "timeout_seconds"),
        ({"timeout_seconds": True}, "timeout_seconds"),
        ({"max_retries": -1}, "max_retries"),
        ({"fallback_reward": math.nan}, "fallback_reward"),
        ({"worker_type": "fork"}, "worker_type"),
        ({"batch_size": 0}, "batch_size"),
        ({"max_batch_delay_s": math.inf}, "max_batch_delay_s"),
    ],
)
def test_a_bad_option_raises_value_error_naming_it_everywhere(changes, name):
    with pytest.raises(ValueError, match=f"^{name} "):
        RewardPoolOptions(**changes)
    with pytest.raises(ValueError, match=f"^{name} "):
        RewardPoolOptions().with_changes(**changes)
    if name != "fallback_reward":
        with pytest.raises(ValueError, match=f"^reward_{name} "):  # the engine's field name
            EngineConfig(**{f"reward_{key}": value for key, value in changes.items()})


def test_options_are_frozen_and_hold_floats():
    options = RewardPoolOptions(timeout_seconds=2, fallback_reward=-1, max_batch_delay_s=0)
    assert type(options.timeout_seconds) is type(options.fallback_reward) is type(options.max_batch_delay_s) is float
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.timeout_seconds = 3.0  # type: ignore[misc]
    assert RewardPoolOptions(timeout_seconds=math.inf).timeout_seconds == math.inf  # no limit


def test_an_unknown_keyword_is_a_type_error_naming_it():
    with pytest.raises(TypeError, match=r"open_reward_pool\(\).*\['timeout'\]"):
        RewardPoolOptions().with_changes("open_reward_pool", timeout=5.0)


async def test_keywords_override_the_options_object():
    base = RewardPoolOptions(max_workers=1, timeout_seconds=9.0, batch_size=1)
    async with open_reward_pool(base, timeout_seconds=2.0, max_retries=0) as pool:
        assert pool.options == dataclasses.replace(base, timeout_seconds=2.0, max_retries=0)
        assert pool.max_workers == 1 and pool.worker_type == "spawn"
    async with open_reward_pool(batch_size=1) as pool:  # max_workers None: resolved at open
        assert pool.options.max_workers == pool.max_workers >= 1
    with pytest.raises(TypeError, match="timeout"):
        async with open_reward_pool(timeout=5.0):
            pass


async def test_the_engine_opens_its_pool_with_its_reward_options():
    async def echo(req, budget):
        raise AssertionError("not called")

    config = EngineConfig(reward_max_workers=1, reward_timeout_seconds=7.0, reward_max_retries=1, reward_batch_size=1)
    async with open_rollout_engine(MockBackend(echo), config) as engine:
        assert engine.reward_pool.options == config.reward_options
        assert current_reward_pool() is engine.reward_pool
    assert current_reward_pool() is None


# -------------------------------------------------------------------- slots


class _FakeContext:
    """A trio-parallel worker context whose job ``(seconds, value)`` takes ``seconds``."""

    def __init__(self) -> None:
        self.started: list[float] = []
        self.killed = 0
        self.die = False

    async def run_sync(self, function, seconds, value, *, kill_on_cancel, limiter):
        assert kill_on_cancel  # a timed-out or cancelled job must kill its worker
        self.started.append(trio.current_time())
        if self.die:
            raise trio_parallel.BrokenWorkerError("worker died")
        try:
            await trio.sleep(seconds)
        except trio.Cancelled:
            self.killed += 1
            raise
        return function(value)

    def statistics(self):  # workers already started: run_job starts none first
        return types.SimpleNamespace(running_workers=0, idle_workers=1)


def _slots(workers: int) -> tuple[WorkerSlots, _FakeContext]:
    context = _FakeContext()
    return WorkerSlots(context, workers, Counters()), context  # type: ignore[arg-type]


async def test_waiting_for_a_slot_is_not_timed(autojump_clock):
    slots, context = _slots(workers=1)
    results = []

    async def job(value):
        results.append(await slots.run(str, 1.0, value, timeout=1.5))

    async with trio.open_nursery() as nursery:
        for value in range(3):
            nursery.start_soon(job, value)
    # one at a time, each 1 s: the third waited 2 s for the slot, more than its 1.5 s timeout
    assert context.started == [0.0, 1.0, 2.0] and sorted(results) == ["0", "1", "2"]
    assert (slots.counters.workers_killed, slots.counters.worker_deaths) == (0, 0)


async def test_a_job_past_its_timeout_is_killed_and_frees_its_slot(autojump_clock):
    slots, context = _slots(workers=1)
    with pytest.raises(JobTimeout):
        await slots.run(str, 10.0, "hung", timeout=1.5)
    assert trio.current_time() == 1.5 and context.killed == 1 and slots.counters.workers_killed == 1
    assert await slots.run(str, 0.5, "next", timeout=1.5) == "next"  # the slot came back
    assert slots.limiter.borrowed_tokens == 0


async def test_a_cancelled_caller_kills_its_job_and_a_dead_worker_is_counted(autojump_clock):
    slots, context = _slots(workers=2)
    with trio.move_on_after(1.0):
        await slots.run(str, 10.0, "x", timeout=5.0)
    assert context.killed == 1 and slots.counters.workers_killed == 1
    context.die = True
    with pytest.raises(trio_parallel.BrokenWorkerError):
        await slots.run(str, 1.0, "x", timeout=5.0)
    assert slots.counters.worker_deaths == 1 and slots.limiter.borrowed_tokens == 0

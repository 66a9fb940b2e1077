"""Starting a reward worker process is not part of a call's timeout.

Tier: contract (real spawn workers).  Regression: a "spawn" worker re-imports the
parent's ``__main__``; a training script that imports torch and transformers takes
seconds (23 s measured on the busy 2-core box), so with the start inside the
per-attempt timeout every attempt of a trivial reward timed out, each kill
started a fresh (slow) worker, and every call returned the fallback reward.
"""

from __future__ import annotations

import pytest
import trio

import reward_fixtures as fx
from rewards import _worker, open_reward_pool

ARGS = ("p", "c", [1], [2])


@pytest.fixture
def slow_worker_start(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_worker, "init_worker", fx.slow_init_worker)  # read by open_reward_pool


def test_worker_start_is_not_timed(slow_worker_start: None) -> None:
    async def main() -> None:
        async with open_reward_pool(max_workers=1, timeout_seconds=1.0, max_retries=0, batch_size=1) as pool:
            first = await pool.score(fx.return_value, *ARGS, value=0.5)
            second = await pool.score(fx.return_value, *ARGS, value=0.25)
            stats = pool.statistics()
        assert (first.reward, first.is_fallback) == (0.5, False)
        assert (second.reward, second.is_fallback) == (0.25, False)
        assert (stats.timeouts, stats.workers_killed, stats.fallbacks) == (0, 0, 0)

    trio.run(main)


def test_worker_start_is_not_timed_batched(slow_worker_start: None) -> None:
    async def main() -> None:
        async with open_reward_pool(max_workers=1, timeout_seconds=1.0, max_retries=0) as pool:
            outcomes: list = []

            async def one(value: float) -> None:
                outcomes.append(await pool.score(fx.return_value, *ARGS, value=value))

            async with trio.open_nursery() as nursery:
                for value in (0.1, 0.2, 0.3):
                    nursery.start_soon(one, value)
            stats = pool.statistics()
        assert sorted(o.reward for o in outcomes) == [0.1, 0.2, 0.3]
        assert not any(o.is_fallback for o in outcomes)
        assert (stats.timeouts, stats.workers_killed) == (0, 0)

    trio.run(main)


def test_a_worker_that_never_starts_is_a_death(monkeypatch: pytest.MonkeyPatch) -> None:
    from engine.errors import RewardError
    from rewards import _slots

    monkeypatch.setattr(_slots, "WORKER_START_TIMEOUT_S", 0.5)
    monkeypatch.setattr(_worker, "init_worker", fx.slow_init_worker)

    async def main() -> None:
        async with open_reward_pool(max_workers=1, timeout_seconds=30.0, max_retries=0, batch_size=1) as pool:
            with pytest.raises(RewardError, match="did not start within 0.5 s"):
                await pool.score(fx.return_value, *ARGS, value=0.5)
            assert pool.statistics().workers_killed == 1

    trio.run(main)


def test_a_worker_being_started_is_starting_not_busy(slow_worker_start: None) -> None:
    """Regression (new-user trial): the live view said "reward workers 2/2 busy" while
    the workers were still starting (trio-parallel counts the start job as running)."""
    import trio.testing

    async def main() -> None:
        async with open_reward_pool(max_workers=1, timeout_seconds=30.0, max_retries=0, batch_size=1) as pool:
            async def one() -> None:
                await pool.score(fx.return_value, *ARGS, value=0.5)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(one)
                await trio.testing.wait_all_tasks_blocked()  # the worker sleeps 3 s in its start
                during = pool.statistics()
            after = pool.statistics()
        assert (during.workers_starting, during.workers_busy, during.busy) == (1, 0, 1)
        assert (after.workers_starting, after.workers_busy, after.workers_idle) == (0, 0, 1)
        assert pool.statistics().workers_starting == 0  # closed

    trio.run(main)

"""Issue 24, class 3: a reward that hangs inside a micro-batch runs ``max_retries + 1`` times
(AReaL's ``range(max_retries + 1)``), not one run more; its batch-mates that finished before it
keep their results (not re-run) and those not started yet run once, uncharged.

Tier: contract (real spawn workers).  Each reward appends a line to its own log file per run,
so the runs are counted across the killed and fresh worker processes.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import trio

import reward_fixtures as fx
from rewards import open_reward_pool

pytestmark = pytest.mark.slow

ARGS = ("p", "c", [1], [2])
HUNG = 3


def _runs(path: Path) -> int:
    return len(path.read_text().splitlines()) if path.exists() else 0


async def test_a_hung_call_in_a_batch_runs_max_retries_plus_one_times(tmp_path, monkeypatch):
    from rewards._batch import Batcher

    # the batch cap adapts to the measured cost per call: on a loaded machine the warm-up
    # call measures slow and the calls would run alone; this test is about a batch's attempts
    monkeypatch.setattr(Batcher, "cap", lambda self: self._batch_size)
    max_retries = 1
    async with open_reward_pool(max_workers=1, timeout_seconds=3.0, max_retries=max_retries) as pool:
        await pool.score(fx.return_value, *ARGS, value=1.0)  # starts the worker; measured cheap: batches form
        outcomes: dict = {}

        async def call(i: int) -> None:
            log = str(tmp_path / f"call-{i}")
            if i == HUNG:
                outcomes[i] = await pool.score(fx.sleep_forever, *ARGS, log=log)
            else:
                outcomes[i] = await pool.score(fx.return_value, *ARGS, value=float(i), log=log)

        async with trio.open_nursery() as nursery:  # all queued before the batcher runs: one batch
            for i in range(8):
                nursery.start_soon(call, i)
        stats = pool.statistics()
    assert stats.batch_failures == 1, stats  # the hung call shared a worker job with the others
    runs = {i: _runs(tmp_path / f"call-{i}") for i in range(8)}
    assert runs[HUNG] == max_retries + 1, runs
    assert all(runs[i] == 1 for i in runs if i != HUNG), runs  # finished ones kept, the rest run once
    hung = outcomes.pop(HUNG)
    assert hung.is_fallback and hung.attempts == max_retries + 1
    assert {i: (o.reward, o.attempts, o.is_fallback) for i, o in outcomes.items()} == {
        i: (float(i), 1, False) for i in outcomes
    }
    assert stats.timeouts == max_retries + 1 and stats.retries == max_retries

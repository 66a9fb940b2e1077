"""The live view's stragglers under ``--shards`` (was: none, since the episodes run
in other processes): each shard times its episodes (``track_episodes``) and sends
its longest running with its statistics; the coordinator merges them.  Inline
shards in virtual time."""

from __future__ import annotations

import pytest
import trio

from engine import EngineConfig
from engine.cli._monitor import RunMonitor
from engine.shards import open_sharded_engine
from shard_fixtures import Echo, sim


async def test_longest_running_merges_the_shards_trackers_and_leaves_out_ended_episodes(autojump_clock):
    async with open_sharded_engine(sim(0.5), EngineConfig(), shards=2, shard_backend="inline",
                                   track_episodes=2, stats_interval_s=0.5) as engine:
        wf = Echo()
        a = engine.submit({"sleep": 30.0}, wf)
        await trio.sleep(1.0)  # (virtual time: starts the episodes one second apart)
        b = engine.submit({"sleep": 30.0}, wf)
        await trio.sleep(1.0)
        engine.submit({"sleep": 30.0}, wf)
        quick = engine.submit({}, wf)
        await trio.sleep(3.0)
        monitor = RunMonitor(engine, total=4)
        longest = engine.longest_running(2)
        assert [t.task_id for t in longest] == [a, b]  # across both shards, longest first; top 2 of 3
        assert longest[0].seconds == pytest.approx(5.0, abs=0.6) and longest[1].seconds == pytest.approx(4.0, abs=0.6)
        assert all(t.tokens == 0 and t.requests == 0 for t in longest)  # still in their sleep
        assert [t.task_id for t in monitor.snapshot().stragglers] == [a, b, a + 2]
        assert quick not in {t.task_id for t in engine.longest_running(5)}  # ended: left out
        results = await engine.wait_results(4)
        assert len(results) == 4 and engine.longest_running(5) == ()
        ended = {r.task_id: r for r in results}
        assert all(int(ended[i].trajectory["shard_pid"][0]) > 0 for i in ended)


async def test_without_tracking_the_engine_says_it_does_not_know(autojump_clock):
    async with open_sharded_engine(sim(), EngineConfig(), shards=2, shard_backend="inline") as engine:
        engine.submit({}, Echo())
        await engine.wait_results(1)
        await engine.refresh_statistics()
        assert engine.longest_running(5) is None
    with pytest.raises(ValueError, match="track_episodes"):
        async with open_sharded_engine(sim(), EngineConfig(), shards=1, shard_backend="inline", track_episodes=-1):
            pass

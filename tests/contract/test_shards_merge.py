"""The statistics of a sharded engine summed over its shards (issue 16, new-user trial).

Regression: a shard killed mid-run kept counting with its last snapshot's *gauges*
(``requests_running 49`` in the summed backend statistics, reward workers busy in a
pool that no longer exists).  A dead shard's totals still count (they happened);
its gauges count as 0.  Inline shards in virtual time, plus the merge itself.
"""

from __future__ import annotations

from dataclasses import replace

import trio.testing

from engine import EngineConfig
from engine.backends.hf import HFStatistics
from engine.backends.sim import SimStatistics
from engine.shards import open_sharded_engine
from engine.shards._statistics import GAUGES, at_rest, merge_statistics
from rewards import RewardPoolStatistics
from shard_fixtures import Echo, invariant, sim


def _sim(**kw):
    return SimStatistics(kind="sim", version=kw.pop("version", 0), logprob_semantics="processed", **kw)


def _pool(**kw):
    base = dict(calls=0, successes=0, timeouts=0, retries=0, fallbacks=0, errors=0, worker_deaths=0,
                workers_killed=0, worker_restarts=0, cancelled=0, busy=0, workers_busy=0, workers_idle=0,
                max_workers=2, batches=0, batch_failures=0, batched_calls=0, latency_p50_s=None,
                latency_p99_s=None)
    return RewardPoolStatistics(**{**base, **kw})


def test_a_dead_shard_s_gauges_count_as_zero_its_totals_still_count():
    live = _sim(requests_served=10, requests_running=3, tokens_generated=100, sequences_running=3,
                sequences_queued=1, peak_running_seqs=5, version=4)
    dead = _sim(requests_served=7, requests_running=49, tokens_generated=70, sequences_running=49,
                sequences_queued=8, sequences_decoding=40, peak_running_seqs=49, version=3)
    merged = merge_statistics([dead, live], alive=[False, True])
    assert (merged.requests_served, merged.tokens_generated) == (17, 170)  # totals: every shard
    assert (merged.requests_running, merged.sequences_running, merged.sequences_queued,
            merged.sequences_decoding) == (3, 3, 1, 0)  # gauges: the live shard only
    assert merged.peak_running_seqs == 54  # peaks: summed (an upper bound), dead ones included
    assert merged.version == 4  # from the live shard
    both_alive = merge_statistics([dead, live])
    assert both_alive.requests_running == 52 and both_alive.version == 3


def test_a_mean_is_weighted_by_its_count_not_summed():
    a = HFStatistics(kind="hf", version=0, logprob_semantics="processed", mode="static", batches=1,
                     batch_occupancy=8.0)
    b = HFStatistics(kind="hf", version=0, logprob_semantics="processed", mode="static", batches=3,
                     batch_occupancy=4.0)
    assert merge_statistics([a, b]).batch_occupancy == 5.0  # (8 + 3 * 4) / 4, not 12


def test_at_rest_zeroes_every_gauge_of_a_reward_pool_and_keeps_its_totals():
    pool = _pool(calls=9, successes=7, busy=3, workers_busy=2, workers_idle=1, workers_starting=1)
    rested = at_rest(pool)
    assert (rested.busy, rested.workers_busy, rested.workers_idle, rested.workers_starting) == (0, 0, 0, 0)
    assert (rested.calls, rested.successes, rested.max_workers) == (9, 7, 2)
    assert at_rest(None) is None
    assert {"busy", "workers_busy", "requests_running"} <= GAUGES


async def test_a_killed_shard_s_last_gauges_leave_the_engine_statistics(autojump_clock):
    async with open_sharded_engine(sim(1.0), EngineConfig(max_concurrent_rollouts=64), shards=2,
                                   shard_backend="inline", stats_interval_s=600.0) as engine:
        wf = Echo()
        ids = [engine.submit({"i": i}, wf) for i in range(64)]
        await trio.testing.wait_all_tasks_blocked()  # every episode in its 1 s prefill, on both shards
        await engine.refresh_statistics()
        doomed, survivor = engine._shards
        assert doomed.stats.backend.requests_running > 0 and survivor.stats.backend.requests_running > 0
        last = doomed.stats
        doomed.stats = replace(last, rewards=_pool(calls=5, busy=2, workers_busy=2, workers_idle=0))
        doomed.link.kill()
        results = await engine.wait_results(64)  # its episodes ran again on the survivor
        assert sorted(r.task_id for r in results) == ids and not doomed.alive
        await engine.refresh_statistics()  # the survivor's, now idle (the dead one sends nothing)
        assert survivor.stats.backend.requests_running == 0
        backend = engine.statistics().backend
        assert backend.requests_running == 0  # (was the dead shard's last requests_running)
        assert backend.requests_served == last.backend.requests_served + survivor.stats.backend.requests_served
        rewards = engine.statistics().rewards  # one RewardPoolStatistics, as a single engine reports
        kept = survivor.stats.rewards
        assert (rewards.busy, rewards.workers_busy) == (0, 0)  # the dead pool's gauges: 0
        assert rewards.calls == 5 + (kept.calls if kept else 0)  # its totals still count
        assert rewards.max_workers == 2 + (kept.max_workers if kept else 0)  # (a peak: summed, dead ones too)
        record = engine.shard_statistics()[0]  # the dead shard's own record: its last snapshot, as sent
        assert record.engine.backend.requests_running == last.backend.requests_running > 0
        assert record.summary()["statistics_final"] is False
        # how each shard's returned episodes ended: the coordinator's counts, exact for the dead one too
        # (they came from its last snapshot, so the shards' accepted did not add up to the engine's)
        records = engine.shard_statistics()
        assert all(r.accepted + r.rejected + r.failed == r.ended for r in records)
        assert sum(r.accepted for r in records) == engine.statistics().accepted == 64
        from engine.cli._live import plain_line
        from engine.cli._monitor import RunMonitor

        snap = RunMonitor(engine, total=64).snapshot()
        assert (snap.shards, snap.shards_alive) == (2, 1) and "| shards 1/2 alive |" in plain_line(snap)
        invariant(engine.statistics())


def test_reward_pools_merge_into_one_with_the_highest_latency_percentiles():
    """A sharded engine's statistics().rewards was a tuple (one pool per shard) where a
    single engine's is a RewardPoolStatistics (new-user trial): now merged."""
    a = _pool(calls=10, successes=10, max_workers=2, workers_idle=2, latency_p50_s=0.01, latency_p99_s=0.5)
    b = _pool(calls=4, successes=3, errors=1, max_workers=2, workers_busy=1, latency_p50_s=0.02,
              latency_p99_s=None)
    merged = merge_statistics([a, b])
    assert type(merged) is type(a)
    assert (merged.calls, merged.successes, merged.errors, merged.max_workers) == (14, 13, 1, 4)
    assert (merged.latency_p50_s, merged.latency_p99_s) == (0.02, 0.5)
    assert merge_statistics([a, b], alive=[True, False]).workers_busy == 0  # a dead pool's gauges: 0


def test_remote_servers_are_merged_by_url_across_shards():
    """Each shard's remote client keeps its own per-server records: the merged
    statistics had only the first shard's (new-user trial, issue 16)."""
    from engine.backends.remote._routing import ServerStatistics
    from engine.backends.remote._stats import RemoteStatistics

    def server(url, **kw):
        base = dict(healthy=True, outstanding_tokens=0, in_flight=0, requests=0, failures=0, ejections=0,
                    weight_version=None, last_error=None)
        return ServerStatistics(url=url, **{**base, **kw})

    def remote(*servers, **kw):
        return RemoteStatistics(kind="vllm", version=2, logprob_semantics="processed", servers=servers, **kw)

    a = remote(server("http://a", requests=10, in_flight=3, outstanding_tokens=300, weight_version="2"),
               server("http://b", requests=5, failures=1, healthy=False, last_error="timeout"), attempts=15)
    b = remote(server("http://a", requests=7, in_flight=2, outstanding_tokens=100),
               server("http://b", requests=4, in_flight=1), attempts=11)
    dead = remote(server("http://b", requests=9, in_flight=4, ejections=1, access_denied=True),
                  server("http://a", requests=1, in_flight=5), attempts=10)
    merged = merge_statistics([a, b, dead], alive=[True, True, False])
    assert merged.attempts == 36
    first, second = merged.servers
    assert (first.url, first.requests, first.in_flight, first.outstanding_tokens) == ("http://a", 18, 5, 400)
    assert first.healthy and first.weight_version == "2" and not first.access_denied
    assert (second.url, second.requests, second.failures, second.ejections, second.in_flight) == (
        "http://b", 18, 1, 1, 1)  # the dead shard's totals count, its in-flight does not
    assert not second.healthy and second.last_error == "timeout" and second.access_denied
    assert at_rest(dead).servers[0].in_flight == 0 and at_rest(dead).servers[0].requests == 9

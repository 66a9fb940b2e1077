"""Engine shards, issue 16 follow-ups (real shard processes):

* the statistics a shard reports are exact once it is idle and once the engine is
  closed (they travelled with a result frame and were never refreshed), per shard in
  ``summary.json`` and summed on the progress line;
* a weight update on servers every shard's client shares loads them once, not once per
  shard (fake vLLM / SGLang servers on 127.0.0.1, counting their reloads);
* a hung shard (SIGSTOP: alive, silent) is killed after ``shard_timeout_s`` and its
  episodes run again elsewhere.
"""

from __future__ import annotations

import json
import os
import signal

import pytest
import trio

from engine import EngineConfig
from engine.serve import serve_http
from engine.shards import open_sharded_engine
from engine.shards._statistics import GAUGES
from fake_servers import FakeSGLang, FakeVLLM
from shard_fixtures import Echo, invariant, sim

pytestmark = pytest.mark.slow


async def test_shard_statistics_are_exact_when_idle_and_after_close():
    # stats_interval_s far beyond the test: only the idle and closing frames can carry them
    async with open_sharded_engine(sim(0.0), EngineConfig(max_concurrent_rollouts=64), shards=2,
                                   stats_interval_s=600.0) as engine:
        wf = Echo()
        ids = [engine.submit({"i": i}, wf) for i in range(120)]
        results = await engine.wait_results(120)
        assert sorted(r.task_id for r in results) == ids
        shards = engine.shard_statistics()
        assert all(s.engine is not None for s in shards), "an idle shard sends its statistics"
        assert [s.engine.accepted for s in shards] == [s.ended for s in shards]
        assert sum(s.engine.accepted for s in shards) == 120
        assert all(s.engine.running == 0 for s in shards)
        open_tokens = engine.statistics().generated_tokens
    shards = engine.shard_statistics()
    assert [s.exit for s in shards] == ["closed (exited with status 0)"] * 2 and not any(s.alive for s in shards)
    assert sum(s.engine.backend.requests_served for s in shards) == 120
    assert engine.statistics().generated_tokens == open_tokens == sum(s.engine.generated_tokens for s in shards)
    records = [s.summary() for s in shards]
    assert [(r["shard"], r["reruns"], r["accepted"]) for r in records] == [(0, 0, shards[0].ended),
                                                                           (1, 0, shards[1].ended)]


def test_rollout_run_shards_summary_has_exact_reward_statistics_and_a_record_per_shard(tmp_path, capsys):
    from conftest import run_cli

    out = tmp_path / "out"
    code, _, err = run_cli(["run", "--backend", "sim", "--dataset", "builtin:arith:40", "--n-samples", "2",
                            "--max-new-tokens", "8", "--shards", "2", "--progress-interval", "30",
                            "--out", str(out)], capsys)
    assert code == 0, err
    summary = json.loads((out / "summary.json").read_text())
    pool = summary["reward_statistics"]  # the shards' pools merged (the shape a single process reports)
    assert pool["calls"] == pool["successes"] == 80 and pool["busy"] == 0  # 2 samples per item
    shards = summary["shards"]
    assert [s["shard"] for s in shards] == [0, 1]
    assert sum(s["ended"] for s in shards) == summary["submitted"] == 40
    assert sum(s["accepted"] for s in shards) == summary["accepted"]
    assert {s["exit"] for s in shards} == {"closed (exited with status 0)"}
    assert all(s["statistics_final"] for s in shards)
    # each shard's record is its last snapshot as sent; the engine's (closed: no shard alive) has the gauges at 0
    own = [s["reward_statistics"] for s in shards]
    assert sum(p["calls"] for p in own) == pool["calls"] and all(s["reruns"] == 0 for s in shards)
    assert {k: sum(p[k] for p in own) for k in ("successes", "max_workers")} == {
        k: pool[k] for k in ("successes", "max_workers")}
    assert all(pool[g] == 0 for g in GAUGES if g in pool)  # (closed: no shard alive)
    last = [line for line in err.splitlines() if line.startswith("rollout progress:")][-1]
    assert "reward workers 0/2 busy" in last, last  # the shards' pools, summed
    assert " ahead " not in last, last  # no --consumer-batch-size: the version never moves
    assert "| shards 2/2 alive |" in last, last


# -- weight updates on shared servers ------------------------------------------------------------------
def _reloads(fake):
    return [body for what, body in fake.control if what in ("rpc", "update")]


@pytest.mark.parametrize("kind", ["vllm", "sglang"], ids=["fake-vLLM", "fake-SGLang"])
async def test_update_weights_on_servers_the_shards_share_loads_them_once(kind):
    from engine.backends.remote import make_remote_backend

    fake = FakeVLLM() if kind == "vllm" else FakeSGLang()
    n = 8
    fake.script = ["hang"] * n  # the first n generations run until the pause aborts them
    fake.partial_on_abort = 1
    arrived = trio.Event()
    seen = 0

    async def handle(request):
        nonlocal seen
        if request.path in ("/generate", "/v1/completions"):
            seen += 1
            if seen == n:
                arrived.set()
        return await fake.handle(request)

    async with trio.open_nursery() as servers:
        port = await servers.start(serve_http, handle, "127.0.0.1", 0)
        backend = make_remote_backend(kind, [f"http://127.0.0.1:{port}"])
        with trio.fail_after(120):
            async with open_sharded_engine(backend, EngineConfig(max_concurrent_rollouts=64), shards=2) as engine:
                ids = [engine.submit({"i": i}, Echo()) for i in range(n)]
                await arrived.wait()  # every episode is generating on the server, on both shards
                assert {s.running for s in engine.shard_statistics()} == {n // 2}
                await engine.update_weights("/ckpt/new", version=1)
                assert len(_reloads(fake)) == 1 and fake.weights == "/ckpt/new"  # (was 1 per shard)
                assert engine.weights_shared
                assert engine.version == 1 and not engine.paused
                results = await engine.wait_results(n)
                assert sorted(r.task_id for r in results) == ids  # each ended once
                assert {r.status for r in results} == {"accepted"}
                for r in results:  # the partial token under v0, the rest after the update under v1
                    versions = r.trajectory["versions"][r.trajectory["loss_mask"].bool()].tolist()
                    assert versions[0] == 0 and versions[-1] == 1, versions
                await engine.refresh_statistics()
                assert [s.engine.version for s in engine.shard_statistics()] == [1, 1]
                await engine.update_weights("/ckpt/newer", version=2)
                assert len(_reloads(fake)) == 2 and fake.weights == "/ckpt/newer"
                batch = await engine.rollout_batch([{"i": i} for i in range(4)], Echo())
                assert set(batch["versions"][batch["loss_mask"].bool()].tolist()) == {2}
                invariant(engine.statistics())
        servers.cancel_scope.cancel()


# -- a hung shard ------------------------------------------------------------------------------------
async def test_a_sigstopped_shard_is_killed_after_shard_timeout_s_and_its_episodes_rerun():
    async with open_sharded_engine(sim(0.0), EngineConfig(max_concurrent_rollouts=400), shards=2,
                                   stats_interval_s=0.2, shard_timeout_s=3.0) as engine:
        wf = Echo()
        ids = [engine.submit({"i": i, "sleep": 0 if i < 20 else 2.0}, wf) for i in range(100)]
        first = await engine.wait_results(20)  # the quick ones; the others run for 2 s more
        victim = engine.shard_statistics()[0]
        assert victim.running > 10
        os.kill(victim.pid, signal.SIGSTOP)
        try:
            with trio.fail_after(60):
                rest = await engine.wait_results(80)
        finally:
            try:
                os.kill(victim.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        results = first + rest
        assert sorted(r.task_id for r in results) == ids
        assert {r.status for r in results} == {"accepted"}
        dead, alive = engine.shard_statistics()
        assert (dead.alive, alive.alive) == (False, True)
        assert dead.exit.startswith("killed by SIGKILL") and "sent nothing for 3 s" in dead.exit, dead.exit
        assert dead.reruns == dead.admitted - dead.ended > 0 and dead.ended + alive.ended == 100
        invariant(engine.statistics())


def test_shard_timeout_s_must_exceed_stats_interval_s():
    async def main():
        async with open_sharded_engine(sim(), shards=1, shard_backend="inline", stats_interval_s=1.0,
                                       shard_timeout_s=0.5):
            pass

    with pytest.raises(ValueError, match="shard_timeout_s must be None or a number > stats_interval_s"):
        trio.run(main)


async def test_a_short_shard_timeout_does_not_kill_healthy_shards_that_close_slowly():
    """Regression (new-user trial): with --shard-timeout 0.6 closing killed both healthy
    shards (the close deadline was max(2, shard_timeout_s) for the last frame *and* the
    exit; a shard's engine teardown, e.g. its reward workers', can take longer).  Now a
    shard that sent its last frame gets the whole grace (10 s) to exit."""
    from shard_fixtures import slow_closing_sim

    async with open_sharded_engine(slow_closing_sim, EngineConfig(), shards=2, stats_interval_s=0.2,
                                   shard_timeout_s=0.6) as engine:
        wf = Echo()
        for i in range(10):
            engine.submit({"i": i}, wf)
        await engine.wait_results(10)
    records = [s.summary() for s in engine.shard_statistics()]
    assert [r["exit"] for r in records] == ["closed (exited with status 0)"] * 2  # (was: killed by SIGKILL)
    assert all(r["statistics_final"] for r in records)


async def test_closing_with_a_hung_shard_waits_at_most_shard_timeout_s():
    """Regression (new-user trial): leaving the engine with a SIGSTOPped shard took ~20 s
    (10 s reading its last frames, then 10 s more for the process), ignoring shard_timeout_s=3."""
    victim_pid = None
    try:
        async with open_sharded_engine(sim(0.0), EngineConfig(max_concurrent_rollouts=40), shards=2,
                                       stats_interval_s=0.2, shard_timeout_s=3.0) as engine:
            wf = Echo()
            for i in range(20):
                engine.submit({"i": i, "sleep": 0}, wf)
            await engine.wait_results(20)
            victim_pid = engine.shard_statistics()[0].pid
            os.kill(victim_pid, signal.SIGSTOP)
            start = trio.current_time()
        elapsed = trio.current_time() - start
    finally:
        if victim_pid is not None:
            try:
                os.kill(victim_pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    assert elapsed < 3.0 + 2.0, elapsed  # one shard_timeout_s (was ~20 s)
    dead, alive = engine.shard_statistics()
    assert dead.exit.startswith("closed (killed by SIGKILL") and alive.exit == "closed (exited with status 0)"

"""Sharded-engine sides for the benchmarks (issue 16): ``shardsN`` = our engine as
:func:`engine.shards.open_sharded_engine` with N shard processes, on the same work as
:mod:`benchmarks.harness`'s ``ours`` side (RLVR + GSM8K reward on the simulated server, the
same draws, consumed in batches with a version bump after each).

Each side runs in its own process (like every ``benchmarks.harness`` side); its shards are
that process's children.  The shards' recorded sim requests (warm-up left out) are
checked against the plan (``work_matches_plan``); the ideal makespan is the plan's, as
for every side.  CPU: the coordinator plus its live children (the shards; the shards'
reward workers are their children and are not counted).  Reward latencies are the
highest shard pool's percentiles (``statistics().rewards``, merged).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent

__all__ = ["run_shard_side", "shard_count", "shard_side"]


def shard_side(shards: int) -> str:
    return f"shards{shards}"


def shard_count(side: str) -> int | None:
    """N for a ``shardsN`` side name, else None."""
    if side.startswith("shards") and side[6:].isdigit() and int(side[6:]) >= 1:
        return int(side[6:])
    return None


async def _drive_sharded(cfg: Any, tokenizer: Any, shards: int) -> dict[str, Any]:
    import trio

    from engine import EngineConfig, GenerationHyperparameters, SimBackend
    from benchmarks.harness.meter import Meter, Tally, process_tree_cpu_s, rounded as _r, staleness_histogram
    from benchmarks.harness.report import summary as _summary
    from benchmarks.harness.workload import bench_item, corpus_token_pool, pool_digest
    from engine.backends.sim import prompt_key
    from engine.shards import open_sharded_engine
    from rewards import gsm8k_reward
    from workflows.rlvr import RLVRWorkflow, default_get_input_ids

    sim = cfg.sim_for(tokenizer)
    gconfig = GenerationHyperparameters(n_samples=1, max_new_tokens=cfg.max_new_tokens)
    workflow = RLVRWorkflow(gsm8k_reward, gconfig, tokenizer, enable_thinking=False)
    backend = SimBackend(sim, record=cfg.record, token_pool=corpus_token_pool(tokenizer, cfg.seed))
    config = EngineConfig(max_concurrent_rollouts=cfg.concurrency, consumer_batch_size=cfg.batch_size,
                          max_head_offpolicyness=cfg.max_head_offpolicyness, gc_tuning=cfg.gc_tuning,
                          reward_max_workers=cfg.reward_workers, reward_batch_size=cfg.effective_reward_batch_size)
    tally = Tally()
    n, window = cfg.episodes, cfg.effective_window
    submitted = consumed = max_inflight = 0
    first_batch_s = None
    async with open_sharded_engine(backend, config, shards=shards) as engine:
        if cfg.warmup:  # starts every shard's reward workers, warms caches (left out of the records below)
            for i in range(cfg.warmup):
                engine.submit(bench_item(i, warmup=True, seed=cfg.seed), workflow)
            await engine.wait_results(cfg.warmup)
        pids = [pid for pid in engine.shard_pids if pid is not None]
        meter = Meter()
        tree0 = process_tree_cpu_s(pids)
        while consumed < n:
            while submitted < n and submitted - consumed < window:
                engine.submit(bench_item(submitted, seed=cfg.seed), workflow)
                submitted += 1
            max_inflight = max(max_inflight, engine.statistics().running)
            results = await engine.wait_results(min(cfg.batch_size, n - consumed))
            if first_batch_s is None:
                first_batch_s = time.perf_counter() - meter.t0
            consumed += len(results)
            version = engine.version
            tally.add(results, version)
            engine.set_version(version + 1)
            meter.sample(consumed)
        wall = time.perf_counter() - meter.t0
        tree1 = process_tree_cpu_s(pids)
        measured = meter.result(wall_s=wall, episodes=n, generated_tokens=0, max_inflight=max_inflight,
                                keep_samples=False)
        stats = await engine.refresh_statistics()
        records = await engine.backend_records() if cfg.record else None
        shard_stats = engine.shard_statistics()
        await trio.lowlevel.checkpoint()
    measured["generated_tokens"] = stats.generated_tokens
    measured["cpu_ms_per_episode_by_process"] = cpu_by_process(measured["cpu_main_s"], tree0, tree1, n)
    measured["tokens_per_s"] = round(stats.generated_tokens / wall, 1) if wall > 0 else None
    requests = None
    if records is not None:
        warm = {prompt_key(default_get_input_ids(tokenizer, bench_item(i, warmup=True, seed=cfg.seed), False))
                for i in range(cfg.warmup)}
        requests = [rec[:5] for shard in records for rec in shard if rec[0] not in warm]
    pool = stats.rewards  # (the shards' pools merged: sums; latency percentiles: the highest shard's)
    return _summary(shard_side(shards), cfg, tally.counts_with_reasons(), measured, requests=requests,
                    time_to_first_batch_s=_r(first_batch_s), staleness_histogram=staleness_histogram(tally.stale),
                    reward_latency_p50_s=_r(pool.latency_p50_s) if pool else None,
                    reward_latency_p99_s=_r(pool.latency_p99_s) if pool else None,
                    reward_workers=pool.max_workers if pool else 0,
                    reward_fallbacks=pool.fallbacks if pool else 0,
                    reward_mean=tally.reward_mean,
                    token_pool_digest=pool_digest(backend.token_pool),
                    shards=[{"pid": s.pid, "admitted": s.admitted, "ended": s.ended, "alive": s.alive}
                            for s in shard_stats])


def cpu_by_process(coordinator_s: float, before: dict[str, dict[int, float]], after: dict[str, dict[int, float]],
                   episodes: int) -> dict[str, Any]:
    """CPU ms per episode of the coordinator, each shard and each shard's reward
    worker over the measured window (processes alive at both ends of it)."""
    def per(kind: str) -> list[float]:
        return [round(1000 * (after[kind][pid] - t0) / max(1, episodes), 4)
                for pid, t0 in sorted(before[kind].items()) if pid in after[kind]]

    return {"coordinator": round(1000 * coordinator_s / max(1, episodes), 4), "shards": per("self"),
            "reward_workers": per("children")}


def _child_main() -> None:
    """A side's process: ``argv = [side, config json]``; prints ``RESULT <json>``."""
    import logging

    import trio

    from benchmarks.harness import BenchConfig, load_tokenizer

    side, raw = sys.argv[1], json.loads(sys.argv[2])
    cfg = BenchConfig.from_dict(raw)
    logging.basicConfig(level=logging.ERROR)
    tokenizer, spec = load_tokenizer(cfg.tokenizer)
    shards = shard_count(side)
    assert shards is not None, side
    out = trio.run(_drive_sharded, cfg, tokenizer, shards)
    out["side"], out["tokenizer"] = side, spec
    print("RESULT " + json.dumps(out), flush=True)


def run_shard_side(side: str, cfg: Any, *, plan: list[Any] | None, timeout_s: float = 7200) -> dict[str, Any]:
    """Run a ``shardsN`` side in its own process; its result record, with the ideal
    makespan and work check of ``plan`` (:func:`benchmarks.harness.plan_requests`).

    Raises:
        ValueError: ``side`` is not ``shardsN``.
        RuntimeError: the side's process failed (its stderr tail is in the message).
    """
    from benchmarks.harness.report import add_ideal as _add_ideal

    if shard_count(side) is None:
        raise ValueError(f"a shard side is shardsN (N >= 1), got {side!r}")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               TOKENIZERS_PARALLELISM="false")
    code = "import sys; sys.path.insert(0, %r); from benchmarks.bench_shard_sides import _child_main; _child_main()" % (
        str(ROOT))
    proc = subprocess.run([sys.executable, "-c", code, side, json.dumps(cfg.to_dict())], env=env, cwd=str(ROOT),
                          capture_output=True, text=True, timeout=timeout_s)
    line = next((ln for ln in reversed(proc.stdout.splitlines()) if ln.startswith("RESULT ")), None)
    if proc.returncode != 0 or line is None:
        raise RuntimeError(f"bench side {side!r} failed (exit {proc.returncode}): {proc.stderr[-3000:]}")
    return _add_ideal(json.loads(line[len("RESULT "):]), replace(cfg), plan)

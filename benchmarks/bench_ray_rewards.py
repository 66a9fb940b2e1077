#!/usr/bin/env python3
"""Calls/s of the Ray reward pool vs the local reward pool, side by side in one run.

A trivial reward (returns 1.0) is scored ``--calls`` times at concurrency
``--concurrency`` by each pool with the same worker count (``--workers``):
the local pool (trio-parallel worker processes) and the Ray pool (Ray actors on
a local Ray started once for the run, not timed), each without and with
micro-batching (``batch_size=16``).  Each pool is warmed up first (workers and
actors started, not timed).  Prints one table and writes
``benchmarks/results/bench_ray_rewards.json``.  Needs the ``ray`` extra.

Run from the repository root::

    .venv/bin/python benchmarks/bench_ray_rewards.py
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "bench_ray_rewards.json"
ARGS = ("prompt " * 20, "completion " * 200, list(range(40)), list(range(256)))
SCHEMA = "bench_ray_rewards/1"


def trivial(prompt, completions, prompt_ids, completion_ids, **data):
    return 1.0


def _module():
    """This file imported as the module ``bench_ray_rewards`` (workers import it by reference)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import bench_ray_rewards

    return bench_ray_rewards


async def _drive(pool: Any, fn: Any, calls: int, concurrency: int) -> float:
    """Seconds to score ``calls`` calls with ``concurrency`` tasks."""
    import trio

    remaining = calls

    async def worker() -> None:
        nonlocal remaining
        while remaining > 0:
            remaining -= 1
            await pool.score(fn, *ARGS)

    start = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for _ in range(concurrency):
            nursery.start_soon(worker)
    return time.perf_counter() - start


async def _one(name: str, opener: Any, fn: Any, args: argparse.Namespace, **options: Any) -> dict[str, Any]:
    async with opener(max_workers=args.workers, timeout_seconds=60.0, **options) as pool:
        await _drive(pool, fn, 4 * args.workers, 2 * args.workers)  # warm-up: every worker started
        seconds = await _drive(pool, fn, args.calls, args.concurrency)
        stats = pool.statistics()
    return {"name": name, "calls": args.calls, "seconds": seconds, "calls_per_s": args.calls / seconds,
            "latency_p50_s": stats.latency_p50_s, "latency_p99_s": stats.latency_p99_s, **options}


async def _main(args: argparse.Namespace) -> list[dict[str, Any]]:
    import ray
    import trio

    from rewards import open_reward_pool
    from engine.ray_cluster import local_job_config
    from rewards import open_ray_reward_pool

    fn = _module().trivial
    await trio.to_thread.run_sync(lambda: ray.init(
        num_cpus=args.workers, include_dashboard=False, log_to_driver=False, job_config=local_job_config(ray)))
    try:
        rows = []
        for batch_size in (1, 16):
            rows.append(await _one("local pool", open_reward_pool, fn, args, batch_size=batch_size))
            rows.append(await _one("ray pool", open_ray_reward_pool, fn, args, batch_size=batch_size))
        return rows
    finally:
        ray.shutdown()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    import ray
    import trio

    rows = trio.run(_main, args)
    print(f"trivial reward, {args.calls} calls at concurrency {args.concurrency}, {args.workers} workers")
    print(f"{'pool':<12} {'batch':>5} {'calls/s':>9} {'p50 ms':>8} {'p99 ms':>8}")
    for row in rows:
        print(f"{row['name']:<12} {row['batch_size']:>5} {row['calls_per_s']:>9.0f} "
              f"{row['latency_p50_s'] * 1e3:>8.1f} {row['latency_p99_s'] * 1e3:>8.1f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "schema": SCHEMA, "ray": ray.__version__, "python": platform.python_version(),
        "machine": platform.machine(), "calls": args.calls, "concurrency": args.concurrency,
        "workers": args.workers, "rows": rows}, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

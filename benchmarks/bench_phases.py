#!/usr/bin/env python3
"""Where an episode's slot time goes: per-phase latencies of our side of ``rollout bench``.

Efficiency (ideal makespan / wall time) is lost while an episode holds one of the
``concurrency`` slots outside generation.  This runs our driver in-process with
timers around each phase and reports, per episode (milliseconds, warm-up
excluded):

* ``generate``: the simulated server's time for the request (compare with the
  planned mean: the difference is the wake-up lag of a busy event loop);
* ``agenerate``: the engine's generation call (adds validation and dispatch);
* ``reward``: decode + reward pool round trip (queueing, IPC, wake-ups);
* ``episode``: the workflow from start to trajectory.

    .venv/bin/python benchmarks/bench_phases.py                       # 3000 episodes, 256 in flight, ~1 min
    .venv/bin/python benchmarks/bench_phases.py --episodes 1000 --tokenizer tiny

Prints one table and writes ``benchmarks/results/bench_phases.json``:
``{"schema": "bench_phases/1", "created", "machine", "config": BenchConfig as a dict,
"results": [{"phase": str, "n": int, "mean_ms", "p50_ms", "p90_ms", "p99_ms": float}],
"run": {"wall_s", "efficiency", "ideal_wall_s", "cpu_main_s", "cpu_children_s",
"planned_generate_mean_ms": float}}``.
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from pathlib import Path

from benchmarks.harness import BenchConfig, add_ideal, load_tokenizer, plan_requests, write_json

ROOT = Path(__file__).resolve().parent.parent

PHASES = {  # phase -> (module, class, method)
    "generate": ("engine.backends.sim", "SimBackend", "generate"),
    "agenerate": ("engine.executor", "RolloutEngine", "agenerate"),
    "reward": ("workflows.rlvr", "RLVRWorkflow", "_reward"),
    "episode": ("workflows.rlvr", "RLVRWorkflow", "arun_episode"),
}


def instrument(timings: dict[str, list[float]]) -> list[tuple[type, str, object]]:
    """Wrap each phase's coroutine method with a wall-clock timer; returns what
    :func:`restore` needs to undo it."""
    import importlib

    undo = []
    for phase, (module, cls_name, method) in PHASES.items():
        cls = getattr(importlib.import_module(module), cls_name)
        original = getattr(cls, method)

        @functools.wraps(original)
        async def timed(*args, __original=original, __phase=phase, **kwargs):
            start = time.perf_counter()
            try:
                return await __original(*args, **kwargs)
            finally:
                timings[__phase].append(time.perf_counter() - start)

        undo.append((cls, method, original))
        setattr(cls, method, timed)
    return undo


def restore(undo: list[tuple[type, str, object]]) -> None:
    for cls, method, original in undo:
        setattr(cls, method, original)


def quantile(sorted_values: list[float], q: float) -> float:
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    p.add_argument("--episodes", type=int, default=3000)
    p.add_argument("--concurrency", type=int, default=256)
    p.add_argument("--prefill-s", type=float, default=0.05)
    p.add_argument("--per-token-s", type=float, default=0.002)
    p.add_argument("--tokenizer", default="auto")
    p.add_argument("--reward-batch-size", type=int, default=None,
                   help="reward micro-batch cap (default: EngineConfig's, adaptive; 1: off)")
    p.add_argument("--json-out", default=str(ROOT / "benchmarks" / "results" / "bench_phases.json"))
    args = p.parse_args(argv)

    import torch
    import trio

    from benchmarks.harness.drivers import drive_ours

    torch.set_num_threads(1)
    cfg = BenchConfig(episodes=args.episodes, concurrency=args.concurrency, batch_size=args.concurrency,
                      warmup=min(64, args.episodes),
                      prefill_s=args.prefill_s, per_token_s=args.per_token_s, tokenizer=args.tokenizer,
                      reward_batch_size=args.reward_batch_size)
    tokenizer, _ = load_tokenizer(cfg.tokenizer)
    timings: dict[str, list[float]] = {phase: [] for phase in PHASES}
    undo = instrument(timings)
    try:
        out = trio.run(drive_ours, cfg, tokenizer)
    finally:
        restore(undo)
    plan = plan_requests(cfg, tokenizer)
    out = add_ideal(out, cfg, plan)
    sim = cfg.sim
    planned = sum(sim.prefill_s + r.out_len * sim.per_token_s for r in plan) / len(plan)

    rows = []
    for phase, values in timings.items():
        values = sorted(values[cfg.warmup:])  # the warm-up engine's episodes come first
        if not values:
            continue
        rows.append({"phase": phase, "n": len(values), "mean_ms": round(1e3 * sum(values) / len(values), 3),
                     "p50_ms": round(1e3 * quantile(values, 0.5), 3), "p90_ms": round(1e3 * quantile(values, 0.9), 3),
                     "p99_ms": round(1e3 * quantile(values, 0.99), 3)})
    print(f"bench_phases: {cfg.episodes} episodes, {cfg.concurrency} in flight, "
          f"{sim.prefill_s} s + {sim.per_token_s} s/token; planned generate mean {1e3 * planned:.2f} ms")
    print(f"{'phase':>10}  {'n':>6}  {'mean ms':>9}  {'p50 ms':>9}  {'p90 ms':>9}  {'p99 ms':>9}")
    for r in rows:
        print(f"{r['phase']:>10}  {r['n']:>6}  {r['mean_ms']:>9.2f}  {r['p50_ms']:>9.2f}  {r['p90_ms']:>9.2f}  "
              f"{r['p99_ms']:>9.2f}")
    run = {"wall_s": out["wall_s"], "efficiency": out["efficiency"], "ideal_wall_s": out["ideal_wall_s"],
           "cpu_main_s": out["cpu_main_s"], "cpu_children_s": out["cpu_children_s"],
           "planned_generate_mean_ms": round(1e3 * planned, 3)}
    print(f"efficiency {run['efficiency']}, wall {run['wall_s']} s, CPU main {run['cpu_main_s']} s")
    path = write_json(args.json_out, "bench_phases", cfg.to_dict(), rows, run=run)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":  # reward workers are spawned processes
    sys.exit(main())

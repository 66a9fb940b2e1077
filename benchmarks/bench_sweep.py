#!/usr/bin/env python3
"""Concurrency sweep on the simulated server: throughput and efficiency, ours vs AReaL vs naive.

For each concurrency (episodes in flight; default 64 to 16384), every side runs
``max(--episodes, --rounds x concurrency)`` RLVR episodes on the same work
(``benchmarks.harness``) with 50 ms prefill + 2 ms/token x ~256 tokens.  Past a few
hundred in flight the zero-overhead ideal outruns any single event loop on two
cores, so throughput flattens at each side's CPU ceiling and efficiency falls:
the plot shows where.

    .venv/bin/python benchmarks/bench_sweep.py                  # ~15 min on a 2-core box
    .venv/bin/python benchmarks/bench_sweep.py --concurrency 64,256,1024 --sides ours,naive
    .venv/bin/python benchmarks/bench_sweep.py --concurrency 1024,4096 --sides ours --shards 1,2   # issue 16

``--shards 1,2`` adds sharded-engine sides (``shards1``, ``shards2``: :mod:`engine.shards`
with that many shard processes, :mod:`benchmarks.bench_shard_sides`) at every point,
interleaved with the other sides, and prints the speed-up of N shards over 1 and over
the single-process engine.

Prints one table, writes ``benchmarks/results/bench_sweep.json`` and, when
matplotlib is installed, ``benchmarks/results/bench_sweep.png`` (episodes/s and
efficiency against concurrency, log scale).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.harness import (  # noqa: E402
    SIDES, BenchConfig, compare, format_table, load_tokenizer, median_result, parse_sides, plan_requests, write_json)
from benchmarks.bench_shard_sides import run_shard_side, shard_side  # noqa: E402

COLORS = {"ours": "tab:blue", "areal": "tab:orange", "naive": "tab:gray", "shards1": "tab:green",
          "shards2": "tab:purple", "shards3": "tab:red", "shards4": "tab:brown"}
NAMES = {"ours": "trio-rollout", "areal": "AReaL 1.0.4 WorkflowExecutor", "naive": "naive (batch, wait all, score)",
         **{f"shards{n}": f"trio-rollout, {n} shard process{'es' if n > 1 else ''}" for n in range(1, 5)}}


def run_shard_sides(cfg: BenchConfig, shard_counts: list[int], repeats: int, log: Any) -> list[dict[str, Any]]:
    """The ``shardsN`` sides at one point (``repeats`` runs each, interleaved; the
    median-wall run, with median headline numbers, as :func:`benchmarks.harness.compare`)."""
    plan = plan_requests(cfg, load_tokenizer(cfg.tokenizer)[0])
    runs: dict[int, list[dict[str, Any]]] = {n: [] for n in shard_counts}
    for _ in range(repeats):
        for n in shard_counts:
            runs[n].append(run_shard_side(shard_side(n), cfg, plan=plan))
            r = runs[n][-1]
            log(f"  {shard_side(n):7s} C={cfg.concurrency:<6d} {r['episodes_per_s']} ep/s "
                f"(steady {r.get('steady_episodes_per_s')}), eff {r['efficiency']}, "
                f"CPU {r['cpu_ms_per_episode']} ms/ep, work matches plan: {r.get('work_matches_plan')}")
            by = r.get("cpu_ms_per_episode_by_process")
            if by:
                log(f"          CPU ms/ep by process: coordinator {by['coordinator']}, shards {by['shards']}, "
                    f"reward workers {by['reward_workers']}")
    out = []
    for n in shard_counts:
        out.append(median_result(runs[n]))
    return out


def speedups(results: list[dict[str, Any]], shard_counts: list[int]) -> list[dict[str, Any]]:
    """Per point: episodes/s of N shards over 1 shard and over the single-process engine."""
    out = []
    for c in sorted({r["concurrency"] for r in results}):
        at = {r["side"]: r for r in results if r["concurrency"] == c and not r.get("skipped")}
        one, ours = at.get("shards1"), at.get("ours")
        for n in shard_counts:
            side = at.get(shard_side(n))
            if side is None:
                continue
            row = {"concurrency": c, "shards": n, "episodes_per_s": side["episodes_per_s"],
                   "steady_episodes_per_s": side.get("steady_episodes_per_s")}
            if one:
                row["vs_1_shard"] = round(side["episodes_per_s"] / one["episodes_per_s"], 3)
                if side.get("steady_episodes_per_s") and one.get("steady_episodes_per_s"):
                    row["steady_vs_1_shard"] = round(side["steady_episodes_per_s"] / one["steady_episodes_per_s"], 3)
            if ours:
                row["vs_single_process"] = round(side["episodes_per_s"] / ours["episodes_per_s"], 3)
            out.append(row)
    return out


def plot(results: list[dict[str, Any]], path: Path, title: str) -> Path | None:
    """Two panels: episodes/s and efficiency against concurrency; None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for side in COLORS:
        rows = sorted((r for r in results if r["side"] == side and not r.get("skipped")),
                      key=lambda r: r["concurrency"])
        if not rows:
            continue
        xs = [r["concurrency"] for r in rows]
        ax1.plot(xs, [r["episodes_per_s"] for r in rows], "o-", color=COLORS[side], label=NAMES[side])
        ax2.plot(xs, [r["efficiency"] for r in rows], "o-", color=COLORS[side], label=NAMES[side])
    ideal = sorted({(r["concurrency"], r["episodes"] / r["ideal_wall_s"]) for r in results
                    if r.get("ideal_wall_s")})
    if ideal:
        ax1.plot([c for c, _ in ideal], [v for _, v in ideal], "k:", label="zero-overhead ideal")
    ax1.set(xscale="log", yscale="log", xlabel="episodes in flight", ylabel="episodes / s", title="throughput")
    ax2.set(xscale="log", xlabel="episodes in flight", ylabel="ideal makespan / wall time", title="efficiency",
            ylim=(0, 1.05))
    for ax in (ax1, ax2):
        ax.grid(True, which="both", alpha=0.3)
    ax1.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main() -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    p.add_argument("--concurrency", default="64,256,1024,4096,16384", help="comma-separated points (episodes in flight)")
    p.add_argument("--episodes", type=int, default=2000, help="at least this many episodes per point")
    p.add_argument("--rounds", type=int, default=2, help="... and at least rounds x concurrency")
    p.add_argument("--prefill-s", type=float, default=0.05)
    p.add_argument("--per-token-s", type=float, default=0.002)
    p.add_argument("--out-len-median", type=int, default=256)
    p.add_argument("--tokenizer", default="auto", help="tiny | smollm2 | auto | a tokenizer folder")
    p.add_argument("--reward-batch-size", type=int, default=None,
                   help="reward micro-batch cap (default: EngineConfig's, adaptive; 1: off)")
    p.add_argument("--repeats", type=int, default=1, help="runs per side and point; medians reported")
    p.add_argument("--sides", default=",".join(SIDES), help=f"comma-separated subset of {','.join(SIDES)}")
    p.add_argument("--shards", default="", help="comma-separated shard counts: add shardsN sides "
                   "(engine.shards, N shard processes), e.g. 1,2 (default: none)")
    p.add_argument("--areal-python", default=None)
    p.add_argument("--json-out", default=str(ROOT / "benchmarks" / "results" / "bench_sweep.json"))
    args = p.parse_args()

    try:  # bad options: an argparse error naming the field, before anything runs
        base = BenchConfig(prefill_s=args.prefill_s, per_token_s=args.per_token_s, out_len_median=args.out_len_median,
                           tokenizer=args.tokenizer, reward_batch_size=args.reward_batch_size)
        sides = parse_sides(args.sides)
        points = [int(x) for x in args.concurrency.split(",")]
        cfgs = [replace(base, concurrency=c, batch_size=min(256, c), episodes=max(args.episodes, args.rounds * c))
                for c in points]
        if args.repeats < 1:
            raise ValueError(f"repeats must be >= 1, got {args.repeats}")
        shard_counts = [int(x) for x in args.shards.split(",") if x.strip()]
        if any(n < 1 for n in shard_counts):
            raise ValueError(f"--shards: counts must be >= 1, got {args.shards}")
        load_tokenizer(base.tokenizer)
    except ValueError as exc:
        p.error(str(exc))
    results, configs = [], []
    for c, cfg in zip(points, cfgs):
        configs.append(asdict(cfg))
        print(f"C={c}: {cfg.episodes} episodes", file=sys.stderr, flush=True)
        log = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
        results += compare(cfg, sides, areal_python=args.areal_python, repeats=args.repeats, log=log)
        if shard_counts:
            results += run_shard_sides(cfg, shard_counts, args.repeats, log)
    title = (f"bench_sweep: {args.prefill_s * 1000:.0f} ms + {args.per_token_s * 1000:.0f} ms/token x "
             f"~{args.out_len_median} tokens, RLVR + GSM8K reward, 2-core box")
    print(format_table(results, title=title))
    extra: dict[str, Any] = {}
    if shard_counts:
        extra["shard_speedups"] = speedups(results, shard_counts)
        print("\nshards: episodes/s, speed-up over 1 shard and over the single-process engine (ours)")
        for row in extra["shard_speedups"]:
            print(f"  C={row['concurrency']:<6d} {row['shards']} shard(s): {row['episodes_per_s']:8.1f} ep/s"
                  f"  x{row.get('vs_1_shard', float('nan')):.2f} vs 1 shard"
                  f"  (steady {row.get('steady_episodes_per_s')}: x{row.get('steady_vs_1_shard', float('nan')):.2f})"
                  f"  x{row.get('vs_single_process', float('nan')):.2f} vs single process")
    json_path = Path(args.json_out)
    png = plot(results, json_path.with_suffix(".png"), title)
    path = write_json(json_path, "bench_sweep", configs, results, plot=png.name if png else None,  # next to the JSON
                      **extra)
    print(f"wrote {path}" + (f" and {png}" if png else " (no plot: pip install matplotlib)"))
    return 0


if __name__ == "__main__":
    sys.exit(main())

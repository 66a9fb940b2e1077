#!/usr/bin/env python3
"""Side by side on the simulated server: trio-rollout, AReaL 1.0.4's executor, a naive loop.

Two scenarios, the same work on every side (``engine.bench``): RLVR episodes with
real chat-template tokenisation, the GSM8K reward in a worker pool, trajectory
tensors; the sim's draws depend only on the prompt, so every side generates the
same tokens:

* ``zero latency``: the server answers at once: what each side costs in CPU;
* ``50 ms + 2 ms/token``: 50 ms prefill plus 2 ms per token, lognormal output
  lengths around 256 tokens: how close each side gets to a zero-overhead
  executor (efficiency = ideal makespan / wall time).

Run from the repository root (sides run one after another, each in its own
process, ``--repeats`` times interleaved; medians are reported)::

    .venv/bin/python benchmarks/bench_engine.py                 # ~10 min on a 2-core box
    .venv/bin/python benchmarks/bench_engine.py --sides ours,naive --repeats 1

Prints one table and writes ``benchmarks/results/bench_engine.json`` (schema in
``benchmarks/README.md``).  The AReaL side needs ``.venv-areal-peer``
(``bash ../shared/peer/setup_areal_peer.sh .venv-areal-peer``); without it that side
is reported as skipped.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import asdict, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from engine.bench import SIDES, BenchConfig, compare, format_table, load_tokenizer, parse_sides, write_json  # noqa: E402

SCENARIOS = {
    "zero latency": {},
    "50 ms + 2 ms/token": {"prefill_s": 0.05, "per_token_s": 0.002},
}


def targets(results: list[dict]) -> dict:
    """The issue's targets, evaluated on this run (None where a side is missing)."""
    by = {(r["scenario"], r["side"]): r for r in results if not r.get("skipped")}
    ours0, areal0 = by.get(("zero latency", "ours")), by.get(("zero latency", "areal"))
    ours1 = by.get(("50 ms + 2 ms/token", "ours"))
    ratio = None
    if ours0 and areal0:
        ratio = round(ours0["cpu_ms_per_episode"] / areal0["cpu_ms_per_episode"], 3)
    return {
        "cpu_per_episode_vs_areal": ratio,
        "cpu_per_episode_vs_areal_ok": None if ratio is None else ratio <= 0.25,
        "efficiency_at_latency": None if ours1 is None else ours1["efficiency"],
        "efficiency_at_latency_ok": None if ours1 is None else ours1["efficiency"] >= 0.97,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--episodes", type=int, default=2000)
    p.add_argument("--concurrency", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=256, help="consumer batch (a version bump after each)")
    p.add_argument("--out-len-median", type=int, default=256)
    p.add_argument("--out-len-sigma", type=float, default=0.3)
    p.add_argument("--tokenizer", default="auto", help="tiny | smollm2 | auto | a tokenizer folder")
    p.add_argument("--reward-batch-size", type=int, default=16,
                   help="our reward pool's micro-batch (EngineConfig.reward_batch_size); AReaL has none")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--sides", default=",".join(SIDES))
    p.add_argument("--areal-python", default=None)
    p.add_argument("--json-out", default=str(ROOT / "benchmarks" / "results" / "bench_engine.json"))
    args = p.parse_args()

    try:  # bad options: an argparse error naming the field, before anything runs
        base = BenchConfig(episodes=args.episodes, concurrency=args.concurrency, batch_size=args.batch_size,
                           out_len_median=args.out_len_median, out_len_sigma=args.out_len_sigma,
                           tokenizer=args.tokenizer, reward_batch_size=args.reward_batch_size)
        sides = parse_sides(args.sides)
        if args.repeats < 1:
            raise ValueError(f"repeats must be >= 1, got {args.repeats}")
        load_tokenizer(base.tokenizer)
    except ValueError as exc:
        p.error(str(exc))
    results, configs = [], {}
    for name, overrides in SCENARIOS.items():
        cfg = replace(base, **overrides)
        configs[name] = asdict(cfg)
        print(f"{name}:", file=sys.stderr)
        for r in compare(cfg, sides, areal_python=args.areal_python, repeats=args.repeats,
                         log=lambda m: print(m, file=sys.stderr, flush=True)):
            results.append({"scenario": name, "label": name, **r})
    check = targets(results)
    title = (f"bench_engine: {base.episodes} RLVR episodes, {base.concurrency} in flight, "
             f"~{base.out_len_median} tokens, tokenizer {results[0].get('tokenizer', base.tokenizer)}, "
             f"median of {args.repeats}")
    print(format_table(results, title=title, label="scenario"))
    print(f"targets: CPU/episode ours/AReaL = {check['cpu_per_episode_vs_areal']} (<= 0.25: "
          f"{check['cpu_per_episode_vs_areal_ok']}); efficiency at 50 ms + 2 ms/token = "
          f"{check['efficiency_at_latency']} (>= 0.97: {check['efficiency_at_latency_ok']})")
    path = write_json(args.json_out, "bench_engine", configs, results, repeats=args.repeats, targets=check)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

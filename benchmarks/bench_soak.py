#!/usr/bin/env python3
"""Soak: 100k RLVR episodes through trio-rollout on the simulated server, memory sampled along the way.

Default: 16384 episodes in flight, 50 ms prefill + 2 ms/token x ~256 tokens,
RSS sampled every second.  Passes when no episode fails and the RSS stays within
10% over the last 90% of the run (by episodes done); the sim keeps no per-request
records here (``BenchConfig(record=False)``), so no ideal makespan is computed.

    .venv/bin/python benchmarks/bench_soak.py                        # ~4 min on a 2-core box
    .venv/bin/python benchmarks/bench_soak.py --episodes 20000 --concurrency 1024

Prints one table (RSS at each tenth of the run) and writes
``benchmarks/results/bench_soak.json`` (schema in ``benchmarks/README.md``; the
samples are under ``results[0].memory_samples``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from benchmarks.harness import BenchConfig, load_tokenizer, run_side, write_json

ROOT = Path(__file__).resolve().parent.parent


def main() -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    p.add_argument("--episodes", type=int, default=100_000)
    p.add_argument("--concurrency", type=int, default=16384)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--prefill-s", type=float, default=0.05)
    p.add_argument("--per-token-s", type=float, default=0.002)
    p.add_argument("--out-len-median", type=int, default=256)
    p.add_argument("--tokenizer", default="auto", help="tiny | smollm2 | auto | a tokenizer folder")
    p.add_argument("--reward-batch-size", type=int, default=None,
                   help="reward micro-batch cap (default: EngineConfig's, adaptive; 1: off)")
    p.add_argument("--sample-every-s", type=float, default=1.0)
    p.add_argument("--json-out", default=str(ROOT / "benchmarks" / "results" / "bench_soak.json"))
    args = p.parse_args()

    try:  # bad options: an argparse error naming the field, before anything runs
        cfg = BenchConfig(episodes=args.episodes, concurrency=args.concurrency, batch_size=args.batch_size,
                          prefill_s=args.prefill_s, per_token_s=args.per_token_s, out_len_median=args.out_len_median,
                          tokenizer=args.tokenizer, reward_batch_size=args.reward_batch_size, record=False,
                          sample_every_s=args.sample_every_s)
        load_tokenizer(cfg.tokenizer)
    except ValueError as exc:
        p.error(str(exc))
    r = run_side("ours", cfg, with_ideal=False, timeout_s=6 * 3600)
    samples = r["memory_samples"]  # (s since start, RSS MiB, episodes done)
    mem = r["memory"]
    ok = r["failed"] == 0 and bool(mem["flat"])
    print(f"bench_soak: {cfg.episodes} episodes, {cfg.concurrency} in flight, "
          f"{cfg.sim.prefill_s * 1000:.0f} ms + {cfg.sim.per_token_s * 1000:.0f} ms/token x ~{cfg.sim.out_len_median} "
          "tokens")
    print(f"{'done':>8}  {'t s':>7}  {'RSS MiB':>8}")
    for tenth in range(11):
        want = tenth * cfg.episodes / 10
        s = min(samples, key=lambda x: abs(x[2] - want))
        print(f"{s[2]:>8}  {s[0]:>7.1f}  {s[1]:>8.1f}")
    print(f"{r['episodes_per_s']} episodes/s, accepted {r['accepted']}, failed {r['failed']}, peak in flight "
          f"{r['max_inflight']}, CPU {r['cpu_ms_per_episode']} ms/episode, peak RSS {r['peak_rss_mib']} MiB "
          f"(+{r['rss_children_mib']} MiB reward workers); RSS over the last 90%: {mem['tail_min_mib']}-"
          f"{mem['tail_max_mib']} MiB (spread {mem['tail_spread']}): {'PASS' if ok else 'FAIL'}")
    path = write_json(args.json_out, "bench_soak", cfg.to_dict(), [r], passed=ok)
    print(f"wrote {path}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

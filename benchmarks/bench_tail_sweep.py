#!/usr/bin/env python3
"""The tail scenario's parameter sweep (issue 27): each policy's settings, one at a time
around the defaults, at several staleness bounds, against ``fcfs`` at the same bound.

    .venv/bin/python benchmarks/bench_tail_sweep.py                       # the grid below; ~15 min on 2 cores
    .venv/bin/python benchmarks/bench_tail_sweep.py --etas 1 --seeds 0 --policies overprovision

Every point is a :func:`benchmarks.harness.tail_cli.run_tail` row (the scenario of
``rollout bench --scenario tail``, :mod:`benchmarks.harness.tail_config`: same prompts and
draws for every point of a seed, virtual time), averaged over ``--seeds``.  The grid
(:data:`GRID`): ``fcfs`` with and without the dispatch bound, ``overprovision``'s ``overprovision_ratio`` and
``overprovision_chunk_tokens``, ``length_aware``'s ``length_aware_probe_tokens`` and
``scheduling_max_segments``, ``tail_batching``'s ``overprovision_ratio``, each at every
``--etas`` bound (``max_head_offpolicyness``).  Per bound the JSON says which point is
fastest with ``length_bias_ks <= 0.1``, its ratio to ``fcfs`` and ``sync``, and the two
ceilings of :mod:`benchmarks.harness.tail_bounds` (server, staleness-latency).

JSON (``--out``, default ``benchmarks/results/bench_tail_sweep.json``; schema
``bench_tail_sweep/1``)::

    {"schema", "created", "machine", "config": TailConfig as a dict + {"seeds", "etas"},
     "results": [{"eta", "settings": {field: value}, ...a bench_tail row}, ...],
     "by_eta": {eta: {"fcfs_steps_per_hour", "sync_steps_per_hour", "server_bound_steps_per_hour",
                      "staleness_latency_bound_steps_per_hour", "bound_within_ks_vs_fcfs",
                      "best_within_ks": {"policy", "settings", "steps_per_hour", "vs_fcfs", "vs_sync",
                                         "length_bias_ks", "thrown_away_token_fraction"} | null}}}
"""

from __future__ import annotations

import argparse
import logging
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.harness.report import write_json  # noqa: E402
from benchmarks.harness.tail_cli import KS_MAX, bounds, parse_seeds, run_tail  # noqa: E402
from benchmarks.harness.tail_config import TailConfig, parse_policies  # noqa: E402
from benchmarks.harness.tail_bounds import server_bound_steps_per_hour  # noqa: E402

#: ``policy -> [settings, ...]``: one factor at a time around the engine's defaults
#: (``overprovision_ratio=0.5``, ``overprovision_chunk_tokens=256``,
#: ``length_aware_probe_tokens=256``, ``scheduling_max_segments=None``); 128 is the
#: server's slot count (``TAIL_SIM.max_running_seqs``).
GRID: dict[str, list[dict[str, Any]]] = {
    "fcfs": [{}],
    "fcfs_bounded": [{}],
    "overprovision": [{}, {"overprovision_ratio": 0.25}, {"overprovision_ratio": 1.0},
                      {"overprovision_chunk_tokens": 128}, {"overprovision_chunk_tokens": 1024},
                      {"overprovision_chunk_tokens": None}],
    "length_aware": [{}, {"length_aware_probe_tokens": 32}, {"length_aware_probe_tokens": 64},
                     {"length_aware_probe_tokens": 1024}, {"scheduling_max_segments": 128},
                     {"scheduling_max_segments": 128, "length_aware_probe_tokens": 64}],
    "tail_batching": [{}, {"overprovision_ratio": 0.25}, {"overprovision_ratio": 1.0}],
}


def _parser() -> argparse.ArgumentParser:
    d = TailConfig()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--policies", default=",".join(GRID), help=f"subset of {','.join(GRID)} (sync always runs once)")
    p.add_argument("--etas", default="1,2,4", help="staleness bounds (max_head_offpolicyness), default 1,2,4")
    p.add_argument("--seeds", default="0,1", help="seeds averaged per point (default 0,1)")
    p.add_argument("--steps", type=int, default=d.steps, help=f"measured trainer steps (default {d.steps})")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "bench_tail_sweep.json"))
    return p


def best_by_eta(cfg: TailConfig, seeds: tuple[int, ...], etas: tuple[int, ...], rows: list[dict[str, Any]],
                sync: dict[str, Any]) -> dict[str, Any]:
    """Per bound: fcfs, the fastest point with KS <= :data:`KS_MAX` other than fcfs, and the ceilings."""
    out: dict[str, Any] = {}
    for eta in etas:
        here = [r for r in rows if r["eta"] == eta and not r.get("skipped")]
        fcfs = next(r for r in here if r["policy"] == "fcfs")
        within = [r for r in here if r["policy"] != "fcfs" and r["length_bias_ks"] is not None
                  and r["length_bias_ks"] <= KS_MAX]
        best = max(within, key=lambda r: r["steps_per_hour"], default=None)
        latency = bounds(replace(cfg, max_head_offpolicyness=eta), seeds)["steps_per_hour"]
        server = server_bound_steps_per_hour(cfg, fcfs["mean_len_generated"])
        out[str(eta)] = {
            "fcfs_steps_per_hour": fcfs["steps_per_hour"], "fcfs_length_bias_ks": fcfs["length_bias_ks"],
            "fcfs_thrown_away_token_fraction": fcfs["thrown_away_token_fraction"],
            "sync_steps_per_hour": sync["steps_per_hour"], "server_bound_steps_per_hour": round(server, 3),
            "staleness_latency_bound_steps_per_hour": latency,
            "bound_within_ks_vs_fcfs": round(min(server, latency) / fcfs["steps_per_hour"], 3),
            "best_within_ks": None if best is None else {
                "policy": best["policy"], "settings": best["settings"], "steps_per_hour": best["steps_per_hour"],
                "vs_fcfs": round(best["steps_per_hour"] / fcfs["steps_per_hour"], 3),
                "vs_sync": round(best["steps_per_hour"] / sync["steps_per_hour"], 3),
                "length_bias_ks": best["length_bias_ks"],
                "thrown_away_token_fraction": best["thrown_away_token_fraction"]}}
    return out


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.getLogger("rollout").setLevel(logging.ERROR)  # (the engine's "prepare_batch has waited" lines)
    policies = parse_policies(args.policies)
    unknown = [p for p in policies if p not in GRID]
    if unknown:
        raise SystemExit(f"bench_tail_sweep: no grid for {unknown}; choose from {', '.join(GRID)}")
    seeds = parse_seeds(args.seeds)
    etas = tuple(int(x) for x in args.etas.split(","))
    cfg = replace(TailConfig(), steps=args.steps, sim=replace(TailConfig().sim, seed=seeds[0]))
    sync = run_tail(cfg, ("sync",), seeds=seeds)[0]
    rows: list[dict[str, Any]] = [{"eta": None, "settings": {}, **sync}]
    print(f"sync: {sync['steps_per_hour']:.1f} steps/h", flush=True)
    for eta in etas:
        at = replace(cfg, max_head_offpolicyness=eta)
        for policy in policies:
            for settings in GRID[policy]:
                if policy == "overprovision" and eta == 0:
                    continue  # (refused: it needs eta >= 1)
                row = run_tail(at, (policy,), seeds=seeds, settings={policy: settings})[0]
                rows.append({"eta": eta, "settings": settings, **row})
                if not row.get("skipped"):
                    print(f"eta {eta} {policy} {settings or '(defaults)'}: {row['steps_per_hour']:.1f} steps/h, "
                          f"KS {row['length_bias_ks']:.3f}, thrown away {row['thrown_away_token_fraction']:.3f}, "
                          f"staleness {row['staleness_mean']:.2f}", flush=True)
    by_eta = best_by_eta(cfg, seeds, etas, rows, sync) if "fcfs" in policies else {}
    for bound, b in by_eta.items():
        best = b["best_within_ks"]
        print(f"eta {bound}: fcfs {b['fcfs_steps_per_hour']:.1f}; best within KS {KS_MAX}: "
              + ("none" if best is None else f"{best['policy']} {best['settings'] or '(defaults)'} "
                 f"{best['steps_per_hour']:.1f} = x{best['vs_fcfs']:.2f} fcfs")
              + f"; ceiling x{b['bound_within_ks_vs_fcfs']:.2f} fcfs (server {b['server_bound_steps_per_hour']:.1f}, "
              f"staleness-latency {b['staleness_latency_bound_steps_per_hour']:.1f})")
    path = write_json(args.out, "bench_tail_sweep", {**cfg.to_dict(), "seeds": list(seeds), "etas": list(etas)},
                      rows, by_eta=by_eta)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""``rollout bench --scenario tail``: every policy of :data:`~.tail_config.POLICIES` on
the same prompts and draws, in virtual time; one table, one JSON (issue 27).

::

    rollout bench --scenario tail                                   # all policies (make bench-tail)
    rollout bench --scenario tail --policies sync,fcfs --steps 10 --out rollout-out/tail.json

JSON (``--out``; schema ``bench_tail/1``)::

    {"schema": "bench_tail/1", "created": str, "machine": {...}, "config": TailConfig as a dict,
     "results": [{"policy", "time_base": "virtual", "steps_per_hour", "trainer_idle_fraction",
                  "slot_occupancy", "tail_share", "thrown_away_token_fraction", "staleness_mean",
                  "staleness_max", "staleness_histogram", "length_bias_ks", "prompts_trained_fraction",
                  ...counts} | {"policy", "skipped": why}, ...],
     "summary": {"steps_per_hour_vs_sync": {policy: ratio}, "steps_per_hour_vs_fcfs": {policy: ratio},
                 "server_bound_steps_per_hour": float | null, "staleness_latency_bound": {...} | null,
                 "bound_within_ks_steps_per_hour": float | null, "bound_within_ks_vs_fcfs": float | null,
                 "best_within_ks": {"ks_max", "policy", "vs_fcfs", "vs_sync", "thrown_away_token_fraction"} | null}}

The metrics are defined in :mod:`.tail_metrics`; the scenario and its fit in :mod:`.tail_config`.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from dataclasses import replace
from typing import Any, NoReturn

from .report import write_json
from .tail_bounds import server_bound_steps_per_hour, staleness_latency_bound
from .tail_config import POLICIES, TailConfig, parse_policies
from .tail_metrics import format_tail_table, summarize
from .tail_run import PolicyUnavailable, run_policy

__all__ = ["KS_MAX", "SPREAD", "aggregate", "bounds", "main", "parse_seeds", "run_tail", "server_bound_steps_per_hour",
           "summary"]

#: The length-bias bound of the comparison the issue asks for: the best policy whose
#: ``length_bias_ks`` is at most this, against asynchronous FCFS.
KS_MAX = 0.1


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, as rollout's other commands
        self.exit(2, f"{self.prog}: error: {message}\n")


def parse_seeds(text: str) -> tuple[int, ...]:
    """``"0,1,2"`` -> ``(0, 1, 2)`` (duplicates dropped, order kept).

    Raises:
        ValueError: not a comma-separated list of integers, or empty.
    """
    try:
        seeds = tuple(dict.fromkeys(int(x) for x in text.split(",") if x.strip()))
    except ValueError:
        raise ValueError(f"--seeds must be comma-separated integers, got {text!r}") from None
    if not seeds:
        raise ValueError("--seeds names no seed")
    return seeds


def _parser() -> argparse.ArgumentParser:
    d = TailConfig()
    p = _Parser(prog="rollout bench --scenario tail", allow_abbrev=False,
                description="the long tail: scheduling policies vs FCFS vs synchronous, on the simulated server in "
                            "virtual time (same prompts and draws for every policy)")
    p.add_argument("--scenario", choices=("tail",), default="tail", help="this scenario")
    p.add_argument("--policies", default=",".join(POLICIES),
                   help=f"comma-separated subset of {','.join(POLICIES)} (default: all; a policy this engine "
                        "lacks is reported as skipped)")
    p.add_argument("--steps", type=int, default=d.steps, help=f"measured trainer steps (default {d.steps})")
    p.add_argument("--cooldown-steps", type=int, default=d.cooldown_steps,
                   help=f"batches of extra prompts, so the measured steps run in steady state (default "
                        f"{d.cooldown_steps})")
    p.add_argument("--groups-per-step", type=int, default=d.groups_per_step,
                   help=f"B: groups per training batch (default {d.groups_per_step})")
    p.add_argument("--group-size", type=int, default=d.group_size, help=f"G: samples per prompt (default {d.group_size})")
    p.add_argument("--train-step-s", type=float, default=d.train_step_s,
                   help=f"virtual seconds per training step (default {d.train_step_s})")
    p.add_argument("--max-head-offpolicyness", type=int, default=d.max_head_offpolicyness,
                   help=f"eta, the staleness bound of every asynchronous policy (default {d.max_head_offpolicyness})")
    p.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens,
                   help=f"response length cap in tokens (default {d.max_new_tokens})")
    p.add_argument("--seeds", default="0,1,2,3,4",
                   help="comma-separated seeds: each sets the prompts, the draws and the schedule; every policy runs "
                        "once per seed and its row averages them (default 0,1,2,3,4)")
    p.add_argument("--out", default="rollout-out/bench_tail.json", help="JSON output (default rollout-out/bench_tail.json)")
    return p


def summary(results: list[dict[str, Any]], ks_max: float = KS_MAX, cfg: TailConfig | None = None,
            seeds: tuple[int, ...] | None = None) -> dict[str, Any]:
    """Ratios of trainer steps per hour to ``sync`` and ``fcfs``, the best policy other
    than those two whose ``length_bias_ks`` is at most ``ks_max`` (None if none ran), and
    with ``cfg`` the two ceilings of :mod:`.tail_bounds`: the server bound (of the first
    row's mean generated length), the staleness-latency bound at ``ks_max`` (averaged over
    ``seeds``, default ``cfg.sim.seed``), and the lower
    of the two (``bound_within_ks_steps_per_hour``, and its ratio to ``fcfs``)."""
    ran = {r["policy"]: r for r in results if not r.get("skipped")}

    def ratios(base: str) -> dict[str, float]:
        if base not in ran:
            return {}
        return {p: round(r["steps_per_hour"] / ran[base]["steps_per_hour"], 3) for p, r in ran.items()}

    vs_sync, vs_fcfs = ratios("sync"), ratios("fcfs")
    candidates = [r for p, r in ran.items() if p not in ("sync", "fcfs")
                  and r["length_bias_ks"] is not None and r["length_bias_ks"] <= ks_max]
    best = max(candidates, key=lambda r: r["steps_per_hour"], default=None)
    ceiling = latency = None
    if cfg is not None and ran:
        ceiling = round(server_bound_steps_per_hour(cfg, next(iter(ran.values()))["mean_len_generated"]), 3)
        latency = bounds(cfg, seeds or (cfg.sim.seed,), ks_max)
    bound = None if ceiling is None or latency is None else min(ceiling, latency["steps_per_hour"])
    return {"steps_per_hour_vs_sync": vs_sync, "steps_per_hour_vs_fcfs": vs_fcfs,
            "server_bound_steps_per_hour": ceiling, "staleness_latency_bound": latency,
            "bound_within_ks_steps_per_hour": bound,
            "bound_within_ks_vs_fcfs": None if bound is None or "fcfs" not in ran
            else round(bound / ran["fcfs"]["steps_per_hour"], 3),
            "best_within_ks": None if best is None else {
                "ks_max": ks_max, "policy": best["policy"], "vs_fcfs": vs_fcfs.get(best["policy"]),
                "vs_sync": vs_sync.get(best["policy"]),
                "thrown_away_token_fraction": best["thrown_away_token_fraction"]}}


#: metrics whose range over the seeds a row reports (``"spread": {metric: [min, max]}``)
SPREAD = ("steps_per_hour", "length_bias_ks", "thrown_away_token_fraction", "staleness_mean", "trainer_idle_fraction")


def aggregate(records: list[dict[str, Any]]) -> dict[str, Any]:
    """One row from the records of one policy's runs over several seeds: numbers averaged
    (``staleness_max``: the maximum), counters (the staleness histogram, rejections by
    reason) summed, ``seeds`` listed, and ``spread`` the ``[min, max]`` of :data:`SPREAD`."""
    first = records[0]
    if len(records) == 1:
        return {**first, "seeds": [first["seed"]]}
    out: dict[str, Any] = {}
    for key, value in first.items():
        values = [r[key] for r in records]
        if key == "staleness_max":
            out[key] = max(v for v in values if v is not None) if any(v is not None for v in values) else None
        elif isinstance(value, bool) or not isinstance(value, (int, float, dict)) or key == "seed":
            out[key] = value
        elif isinstance(value, dict):
            summed: dict[str, Any] = {}
            for v in values:
                for k, n in v.items():
                    summed[str(k)] = summed.get(str(k), 0) + n if isinstance(n, (int, float)) else n
            out[key] = summed
        else:
            known = [v for v in values if v is not None]
            out[key] = round(sum(known) / len(known), 4) if known else None
    out["seeds"] = [r["seed"] for r in records]
    out["spread"] = {k: [min(r[k] for r in records), max(r[k] for r in records)] for k in SPREAD
                     if all(r.get(k) is not None for r in records)}
    return out


def run_tail(cfg: TailConfig, policies: tuple[str, ...], log: Any = None, *, seeds: tuple[int, ...] | None = None,
             settings: dict[str, dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """Run each policy on ``cfg`` once per seed of ``seeds`` (default: ``cfg.sim.seed``; a
    seed sets the prompts, the draws and the schedule), with ``settings[policy]`` over its
    :data:`POLICIES` row; its row (:func:`aggregate`), or ``{"policy", "skipped"}``."""
    results = []
    for name in policies:
        records: list[dict[str, Any]] = []
        skipped = None
        for seed in seeds or (cfg.sim.seed,):
            run_cfg = replace(cfg, sim=replace(cfg.sim, seed=seed))
            started = time.process_time()
            try:
                record = summarize(run_cfg, run_policy(run_cfg, name, (settings or {}).get(name)))
            except PolicyUnavailable as exc:
                skipped = str(exc)
                break
            record["seed"] = seed
            record["cpu_s"] = round(time.process_time() - started, 2)
            records.append(record)
        row = {"policy": name, "skipped": skipped} if skipped is not None else aggregate(records)
        if log is not None:
            log(f"{name}: {'skipped (' + row['skipped'] + ')' if row.get('skipped') else 'done'}")
        results.append(row)
    return results


def bounds(cfg: TailConfig, seeds: tuple[int, ...], ks_max: float = KS_MAX) -> dict[str, Any]:
    """The staleness-latency bound of :mod:`.tail_bounds`, per seed and averaged."""
    per_seed = [staleness_latency_bound(replace(cfg, sim=replace(cfg.sim, seed=s)), ks_max=ks_max) for s in seeds]
    if len(per_seed) == 1:
        return per_seed[0]
    mean = sum(b["steps_per_hour"] for b in per_seed) / len(per_seed)
    out = {**per_seed[0], "steps_per_hour": round(mean, 3), "step_s": round(3600.0 / mean, 2),
           "per_seed": [b["steps_per_hour"] for b in per_seed]}
    for key, digits in (("max_len_tokens", 0), ("groups_dropped_fraction", 4)):  # the seeds' means
        out[key] = round(sum(b[key] for b in per_seed) / len(per_seed), digits)
    return out


def main(argv: list[str] | None = None) -> int:
    """``rollout bench --scenario tail ...``: the exit status (2: bad options)."""
    parser = _parser()
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        policies = parse_policies(args.policies)
        seeds = parse_seeds(args.seeds)
        cfg = TailConfig(steps=args.steps, cooldown_steps=args.cooldown_steps, groups_per_step=args.groups_per_step,
                         group_size=args.group_size, train_step_s=args.train_step_s,
                         max_head_offpolicyness=args.max_head_offpolicyness, max_new_tokens=args.max_new_tokens,
                         sim=replace(TailConfig().sim, seed=seeds[0]))
        engine_log = logging.getLogger("rollout")  # in virtual time its "prepare_batch has waited 60 s" lines
        level = engine_log.level                    # are the step policies' ordinary waits: noise here
        engine_log.setLevel(logging.ERROR)
        try:
            results = run_tail(cfg, policies, log=lambda m: print(m, file=sys.stderr), seeds=seeds)
        finally:
            engine_log.setLevel(level)
    except ValueError as exc:
        print(f"rollout bench: error: {exc}", file=sys.stderr)
        return 2
    s = summary(results, cfg=cfg, seeds=seeds)
    print(format_tail_table(results, title=(
        f"rollout bench --scenario tail: {cfg.steps} steps of {cfg.groups_per_step} groups x {cfg.group_size}, "
        f"train {cfg.train_step_s} s/step, eta {cfg.max_head_offpolicyness}, virtual time, mean of "
        f"{len(seeds)} seed(s)")))
    for base in ("sync", "fcfs"):
        ratios = s[f"steps_per_hour_vs_{base}"]
        if ratios:
            print(f"steps/h vs {base}: " + ", ".join(f"{p} x{v:.2f}" for p, v in ratios.items()))
    if s["server_bound_steps_per_hour"] is not None:
        print(f"server-bound ceiling (all slots decoding, nothing thrown away): {s['server_bound_steps_per_hour']:.1f} "
              "steps/h")
        lat = s["staleness_latency_bound"]
        print(f"staleness-latency ceiling at KS <= {lat['ks_max']} (eta {lat['eta']}: steady steps of >= "
              f"{lat['step_s']} s, samples over {lat['max_len_tokens']:.0f} tokens cannot be trained): "
              f"{lat['steps_per_hour']:.1f} steps/h")
    path = write_json(args.out, "bench_tail", {**cfg.to_dict(), "seeds": list(seeds)}, results, summary=s)
    print(f"wrote {path}")
    return 0

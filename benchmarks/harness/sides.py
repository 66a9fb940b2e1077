"""Running the sides: each in its own process (:func:`run_side`), several side by side
and repeated (:func:`compare`).

A side's process runs ``python -c <entry> <side> <config json> <tokenizer dir>`` and
prints one ``RESULT <json>`` line: :func:`side_child_main` (ours, ours_gc, naive:
this venv) or :func:`benchmarks.harness.peer_areal.child_main` (areal: the AReaL
peer venv's interpreter).
"""

from __future__ import annotations

import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

from .config import EXTRA_SIDES, SIDES, BenchConfig, parse_sides
from .report import add_ideal, summary
from .workload import load_tokenizer, plan_requests

__all__ = ["HEADLINE", "REPO_ROOT", "compare", "default_areal_python", "median_result", "run_side", "side_child_main"]

#: The checkout (``benchmarks/`` and ``engine/`` lie under it): the side processes'
#: ``PYTHONPATH``, so that the AReaL venv, which does not install this project, imports it.
REPO_ROOT = Path(__file__).resolve().parents[2]

#: Per-run numbers that :func:`compare` reports as medians over repeats.
HEADLINE = ("wall_s", "episodes_per_s", "steady_episodes_per_s", "tokens_per_s", "efficiency", "cpu_ms_per_episode", "cpu_ms_per_episode_main")

_ENTRY = {
    "areal": "from benchmarks.harness.peer_areal import child_main; child_main()",
    "ours": "from benchmarks.harness.sides import side_child_main; side_child_main()",
}


def side_child_main() -> None:
    """Entry point of an ``ours`` / ``ours_gc`` / ``naive`` side's process:
    ``argv = [side, config json, tokenizer dir]``; prints ``RESULT <json>``."""
    import trio

    from .drivers import drive_naive, drive_ours

    side, cfg = sys.argv[1], BenchConfig.from_dict(json.loads(sys.argv[2]))
    logging.basicConfig(level=logging.ERROR)  # this process only: the side's own entry point
    tokenizer, spec = load_tokenizer(cfg.tokenizer)
    if side == "ours_gc":
        cfg = replace(cfg, gc_tuning=True)
    driver = drive_naive if side == "naive" else drive_ours
    out = trio.run(driver, cfg, tokenizer)
    out["side"], out["tokenizer"] = side, spec
    print("RESULT " + json.dumps(out), flush=True)


def default_areal_python() -> Path:
    """The AReaL peer venv's interpreter: ``.venv-areal-peer`` in the checkout (``make areal-peer``)."""
    return REPO_ROOT / ".venv-areal-peer" / "bin" / "python"


def run_side(side: str, cfg: BenchConfig, *, plan: list[Any] | None = None, with_ideal: bool = True,
             areal_python: str | os.PathLike[str] | None = None, timeout_s: float = 7200) -> dict[str, Any]:
    """Run one side in its own process and return its result record.

    ``plan`` (:func:`~benchmarks.harness.workload.plan_requests`, computed here when
    omitted and ``with_ideal``) gives the ideal makespan and the work check.

    Raises:
        ValueError: unknown side, or the AReaL side cannot run this config.
        RuntimeError: the side's process failed (its stderr tail is in the message).
    """
    if side not in SIDES + EXTRA_SIDES:
        raise ValueError(f"side must be one of {SIDES + EXTRA_SIDES}, got {side!r}")
    python, tok_dir, spec = sys.executable, "", ""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]),
               TOKENIZERS_PARALLELISM="false")
    with tempfile.TemporaryDirectory(prefix="rollout-bench-") as tmp:
        if side == "areal":
            why = cfg.areal_unsupported()
            if why:
                raise ValueError(f"the AReaL side does not model {why}")
            python = str(areal_python or default_areal_python())
            if not Path(python).exists():
                raise ValueError(f"AReaL peer interpreter {python} not found: build it with "
                                 "`bash ../shared/peer/setup_areal_peer.sh .venv-areal-peer`")
            tokenizer, spec = load_tokenizer(cfg.tokenizer)
            tok_dir = spec if spec not in ("tiny", "smollm2") else os.path.join(tmp, "tokenizer")
            if spec in ("tiny", "smollm2"):
                tokenizer.save_pretrained(tok_dir)
        code = _ENTRY["areal" if side == "areal" else "ours"]
        proc = subprocess.run([python, "-c", code, side, json.dumps(cfg.to_dict()), tok_dir], env=env,
                              cwd=str(REPO_ROOT), capture_output=True, text=True, timeout=timeout_s)
    line = next((ln for ln in reversed(proc.stdout.splitlines()) if ln.startswith("RESULT ")), None)
    if proc.returncode != 0 or line is None:
        raise RuntimeError(f"bench side {side!r} failed (exit {proc.returncode}): {proc.stderr[-3000:]}")
    out = json.loads(line[len("RESULT "):])
    if side == "areal":
        log = out.pop("log")
        out = summary("areal", cfg, out.pop("counts"), out.pop("measured"), **out, tokenizer=spec,
                      requests=log if cfg.record else None)
    if plan is None and with_ideal:
        plan = plan_requests(cfg, load_tokenizer(cfg.tokenizer)[0])
    return add_ideal(out, cfg, plan)


def compare(cfg: BenchConfig, sides: tuple[str, ...] = SIDES, *, areal_python: str | None = None,
            repeats: int = 1, log: Any = None) -> list[dict[str, Any]]:
    """Run ``sides`` on ``cfg`` (``repeats`` times each, interleaved) and return one
    record per side: the run with the median wall time, whose headline numbers
    (:data:`HEADLINE`) are replaced by their medians over the runs; every run's
    headline numbers are kept under ``runs``.  A side that cannot run is recorded
    with ``skipped``.

    Raises:
        ValueError: ``repeats`` < 1 or an unknown side (see :func:`~benchmarks.harness.config.parse_sides`).
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    sides = parse_sides(",".join(sides))
    runs: dict[str, list[dict[str, Any]]] = {s: [] for s in sides}
    skipped: dict[str, str] = {}
    plan = plan_requests(cfg, load_tokenizer(cfg.tokenizer)[0])
    for _ in range(repeats):
        for side in sides:
            if side in skipped:
                continue
            try:
                runs[side].append(run_side(side, cfg, plan=plan, areal_python=areal_python))
            except ValueError as exc:
                skipped[side] = str(exc)
                continue
            if log:
                r = runs[side][-1]
                log(f"  {side:5s} C={cfg.concurrency:<6d} {r['episodes_per_s']} ep/s, eff {r['efficiency']}, "
                    f"CPU {r['cpu_ms_per_episode']} ms/ep")
    out = []
    for side in sides:
        if side in skipped:
            out.append({"side": side, "concurrency": cfg.concurrency, "skipped": skipped[side]})
            continue
        out.append(median_result(runs[side]))
    return out


def median_result(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One side's repeats as one result: the median-wall run's record, its
    :data:`HEADLINE` numbers replaced by their medians over the runs (None where no
    run has one), and ``"runs"`` holding every run's headline numbers."""
    ordered = sorted(runs, key=lambda r: r["wall_s"])
    best = dict(ordered[len(ordered) // 2])
    for key in HEADLINE:
        values = [r[key] for r in runs if r.get(key) is not None]
        best[key] = round(statistics.median(values), 4) if values else None
    best["runs"] = [{k: r.get(k) for k in HEADLINE} for r in runs]
    return best

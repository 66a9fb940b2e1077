"""A side's result record (:func:`summary`, :func:`add_ideal`) and how results are
shown: the text table and the JSON file (schema in ``benchmarks/README.md``).

Standard library at import (the AReaL peer's records pass through :func:`summary`).
"""

from __future__ import annotations

import collections
import json
import os
import platform
import time
from pathlib import Path
from typing import Any

from .config import BenchConfig
from .workload import ideal_makespan

__all__ = ["add_ideal", "format_table", "machine_info", "summary", "write_json"]


def summary(side: str, cfg: BenchConfig, counts: dict[str, Any], meter_result: dict[str, Any],
            **extra: Any) -> dict[str, Any]:
    """One side's result record: counts (``accepted``/``rejected``/``failed``...),
    the meter's numbers and ``extra``; ``errors`` = ``failed``."""
    out = {"side": side, "concurrency": cfg.concurrency, "episodes": cfg.episodes, **counts, **meter_result, **extra}
    out["errors"] = counts.get("failed", 0)
    return out


def add_ideal(out: dict[str, Any], cfg: BenchConfig, plan: list[Any] | None) -> dict[str, Any]:
    """Check the side's recorded work (``out["requests"]``, removed) against the
    plan (``work_matches_plan``); add the ideal makespan and efficiency (None
    without a plan, or when the ideal is zero)."""
    requests = out.pop("requests", None)
    ideal = None
    if plan is not None:
        ideal = ideal_makespan(plan, cfg.concurrency, cfg.sim)
        if requests is not None:
            want = collections.Counter((r.key, r.prompt_len, r.out_len, r.multiplier, r.outcome) for r in plan)
            out["work_matches_plan"] = collections.Counter(map(tuple, requests)) == want
    wall = out["wall_s"]
    out["ideal_wall_s"] = None if ideal is None else round(ideal, 4)
    out["efficiency"] = round(ideal / wall, 4) if ideal and wall > 0 else None
    return out


def machine_info() -> dict[str, Any]:
    """CPUs, Python, platform and the 1-minute load average of this machine."""
    return {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform(),
            "load_avg_1m": round(os.getloadavg()[0], 2)}


_COLUMNS = (
    ("side", "side", "{}"), ("C", "concurrency", "{}"), ("ep/s", "episodes_per_s", "{:.0f}"),
    ("tok/s", "tokens_per_s", "{:.0f}"), ("eff", "efficiency", "{:.3f}"), ("CPU ms/ep", "cpu_ms_per_episode", "{:.3f}"),
    ("peak RSS MiB", "peak_rss_mib", "{:.0f}"), ("KiB/in-flight", "rss_per_inflight_kib", "{:.1f}"),
    ("1st batch s", "time_to_first_batch_s", "{:.3f}"), ("reward p50/p99 s", None, None), ("failed", "failed", "{}"),
)


def format_table(results: list[dict[str, Any]], *, title: str | None = None, label: str | None = None) -> str:
    """A fixed-width text table of result records (one row each)."""
    head = ([label] if label else []) + [c[0] for c in _COLUMNS]
    rows = []
    for r in results:
        row = [r.get("label", "")] if label else []
        for name, key, fmt in _COLUMNS:
            if key is None or fmt is None:
                p50, p99 = r.get("reward_latency_p50_s"), r.get("reward_latency_p99_s")
                row.append("-" if p50 is None else f"{p50:.3f}/{p99:.3f}")
                continue
            value = r.get(key)
            if name == "side" and r.get("skipped"):
                value = f"{value} (skipped)"
            row.append("-" if value is None else fmt.format(value))
        rows.append(row)
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows)]
    lines = [title] if title else []
    lines.append("  ".join(h.rjust(w) for h, w in zip(head, widths)))
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(str(x).rjust(w) for x, w in zip(row, widths)) for row in rows]
    return "\n".join(lines)


def write_json(path: str | os.PathLike[str], benchmark: str, config: Any, results: list[dict[str, Any]],
               **extra: Any) -> Path:
    """Write the benchmark's JSON file (schema ``<benchmark>/1``, in ``benchmarks/README.md``)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {"schema": f"{benchmark}/1", "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "machine": machine_info(),
           "config": config, "results": results, **extra}
    path.write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
    return path

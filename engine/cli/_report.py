"""``rollout report DIR``: PNG plots of a finished run (matplotlib, Agg canvas).

Reads what ``rollout run`` wrote into ``DIR``:

* ``rollouts.jsonl`` (one line per trajectory: ``reward``, ``completion_tokens``,
  ``stop_reason``) -> ``reward_distribution.png`` (histogram of rewards) and
  ``completion_lengths.png`` (histogram of completion tokens, truncated ones apart);
* ``metrics.jsonl`` (a sample per second: ``elapsed_s``, ``tokens_per_s``,
  ``running``, ``queued``, ended counts) -> ``throughput.png`` (tokens/s and
  episodes in flight / waiting over time);
* ``episodes.jsonl`` (one line per ended episode: ``staleness`` of each consumed
  trajectory row, in versions) -> ``staleness.png`` (histogram).

Writes into ``--out`` (default ``DIR/report``); prints one line per file.  Figures
are drawn on ``matplotlib.figure.Figure`` with the Agg canvas, so no pyplot state
and no display are involved.

Errors: :class:`ReportError` (one line) when ``DIR`` holds no run output, a line
is not JSON, or matplotlib is missing (``pip install 'trio-rollout[report]'``).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path
from typing import Any

from ..errors import RolloutError

__all__ = ["ReportError", "add_report_parser", "write_report"]

PLOTS = ("reward_distribution.png", "completion_lengths.png", "throughput.png", "staleness.png")


class ReportError(RolloutError, ValueError):
    """The run folder cannot be reported on."""


def _jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    rows = []
    for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise ReportError(f"{path}:{lineno}: not valid JSON ({exc.msg})") from None
    return rows


def _figure(title: str) -> tuple[Any, Any]:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.4, 4.0), dpi=100, layout="constrained")
    ax = fig.add_subplot()
    ax.set_title(title)
    ax.grid(alpha=0.3)
    return fig, ax


def _save(fig: Any, path: Path) -> Path:
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(fig).print_png(str(path))
    return path


def _empty(ax: Any, text: str) -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, color="gray")


def _rewards(rows: list[dict[str, Any]], out: Path) -> Path:
    rewards = [float(r["reward"]) for r in rows if r.get("reward") is not None]
    fig, ax = _figure(f"reward distribution ({len(rewards)} trajectories)")
    if rewards:
        counts = Counter(round(r, 6) for r in rewards)
        if len(counts) <= 12:  # few distinct values (0/1 rewards): one bar each
            values = sorted(counts)
            ax.bar([str(v) for v in values], [counts[v] for v in values], color="tab:blue")
        else:
            ax.hist(rewards, bins=30, color="tab:blue")
        mean = sum(rewards) / len(rewards)
        ax.set_xlabel(f"reward (mean {mean:.3f})")
    else:
        _empty(ax, "no trajectories")
    ax.set_ylabel("trajectories")
    return _save(fig, out / "reward_distribution.png")


def _lengths(rows: list[dict[str, Any]], out: Path) -> Path:
    fig, ax = _figure("completion lengths")
    done = [r["completion_tokens"] for r in rows if r.get("stop_reason") != "length"]
    cut = [r["completion_tokens"] for r in rows if r.get("stop_reason") == "length"]
    if done or cut:
        ax.hist([done, cut], bins=30, stacked=True, color=["tab:blue", "tab:orange"],
                label=[f"stopped ({len(done)})", f"truncated at the budget ({len(cut)})"])
        ax.legend()
    else:
        _empty(ax, "no trajectories")
    ax.set_xlabel("completion tokens")
    ax.set_ylabel("trajectories")
    return _save(fig, out / "completion_lengths.png")


def _throughput(samples: list[dict[str, Any]], out: Path) -> Path:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.4, 5.0), dpi=100, layout="constrained")
    top, bottom = fig.subplots(2, 1, sharex=True)
    t = [s["elapsed_s"] for s in samples]
    top.set_title("throughput and episodes in flight")
    if samples:
        top.plot(t, [s["tokens_per_s"] for s in samples], color="tab:green")
        bottom.plot(t, [s["running"] for s in samples], label="in flight", color="tab:blue")
        bottom.plot(t, [s["queued"] for s in samples], label="waiting", color="tab:gray", linestyle="--")
        bottom.plot(t, [s["accepted"] + s["rejected"] + s["failed"] for s in samples], label="ended",
                    color="tab:purple", linestyle=":")
        bottom.legend()
    else:
        _empty(top, "no metrics.jsonl samples")
    top.set_ylabel("generated tokens / s")
    bottom.set_ylabel("episodes")
    bottom.set_xlabel("seconds since the engine opened")
    for ax in (top, bottom):
        ax.grid(alpha=0.3)
    return _save(fig, out / "throughput.png")


def _staleness(episodes: list[dict[str, Any]], out: Path) -> Path:
    values = [v for e in episodes for v in e.get("staleness") or []]
    fig, ax = _figure(f"staleness of consumed trajectories ({len(values)})")
    if values:
        counts = Counter(values)
        xs = list(range(min(counts), max(counts) + 1))
        ax.bar(xs, [counts.get(x, 0) for x in xs], color="tab:red")
        ax.set_xticks(xs)
    else:
        _empty(ax, "no consumed trajectories")
    ax.set_xlabel("policy version at consumption - version of the oldest generated token")
    ax.set_ylabel("trajectories")
    return _save(fig, out / "staleness.png")


def write_report(run_dir: Path, out: Path | None = None) -> list[Path]:
    """Write the plots of :data:`PLOTS` for the run in ``run_dir``; returns their paths.

    Raises:
        ReportError: ``run_dir`` has none of the files above, a line is not JSON,
            or matplotlib is not installed.
    """
    run_dir = Path(run_dir)
    if not any((run_dir / f).is_file() for f in ("rollouts.jsonl", "metrics.jsonl", "episodes.jsonl")):
        raise ReportError(f"{run_dir}: no rollouts.jsonl, metrics.jsonl or episodes.jsonl (not a rollout run's --out)")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ReportError("rollout report needs matplotlib: pip install 'trio-rollout[report]'") from None
    out = Path(out) if out is not None else run_dir / "report"
    out.mkdir(parents=True, exist_ok=True)
    rows = _jsonl(run_dir / "rollouts.jsonl")
    return [_rewards(rows, out), _lengths(rows, out), _throughput(_jsonl(run_dir / "metrics.jsonl"), out),
            _staleness(_jsonl(run_dir / "episodes.jsonl"), out)]


def _main(args: argparse.Namespace) -> int:
    try:
        paths = write_report(args.run_dir, args.out)
    except (ReportError, OSError) as exc:
        print(f"rollout report: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    for path in paths:
        print(f"wrote {path}")
    return 0


def add_report_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``rollout report DIR [--out PLOTS_DIR]``."""
    p = subparsers.add_parser("report", help="PNG plots of a finished run (rewards, lengths, throughput, staleness)",
                              description="Plot a finished `rollout run`: reward distribution, completion lengths, "
                                          "throughput and in-flight episodes over time, staleness of consumed "
                                          "trajectories.")
    p.add_argument("run_dir", type=Path, metavar="DIR", help="the --out folder of a rollout run")
    p.add_argument("--out", type=Path, default=None, help="where to write the PNGs (default DIR/report)")
    p.set_defaults(handler=_main)
    return p

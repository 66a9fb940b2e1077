"""The tail scenario's reported numbers (:func:`summarize`), the table and the KS distance.

Definitions (times are virtual seconds; the window is the first ``steps`` training steps;
the *window's prompts* are the first ``steps * groups_per_step``: every token, row and
prompt count below is over them, wherever in the run they were generated or trained, so
that the prompts of the cool-down, which only keep the pipeline full until the window's
prompts are decided, and what is still in flight when the run stops, count for nothing;
``window_prompts_undecided`` counts window prompts still in flight at the end, 0 when the
cool-down was long enough):

* ``steps_per_hour``: ``steps * 3600 / window_s``;
* ``trainer_idle_fraction``: time the trainer waited for batches in the window / ``window_s``;
* ``slot_occupancy``: server slot-seconds held in the window / (``max_running_seqs`` x
  ``window_s``) (None with unbounded slots);
* ``tail_share``: per batch of the window, (its last row's generation end - the end by
  which 90% of its rows had finished) / (its last end - its first row's start), averaged
  over the batches: Seer's "time the last 10% of requests take" for a synchronous step;
* ``thrown_away_token_fraction``: 1 - tokens in consumed batches / tokens the server
  decoded (returned, cut or cancelled);
* ``staleness_*``: per consumed row, the trainer's version when it took the batch minus
  the version of the row's oldest generated token (mean, max, histogram ``{k: rows}``);
* ``length_bias_ks``: the two-sample Kolmogorov-Smirnov distance (:func:`ks_distance`)
  between the response lengths of every consumed row and the drawn lengths of every
  sample whose generation started, once each (what the trained data would look like if
  nothing were dropped or cut; ``requests_started`` counts them);
* ``prompts_trained_fraction``: prompts with at least one consumed row / prompts.
* ``requests_started``: samples started (once each, however often re-run);
  ``decoded_tokens_run``: what the server decoded in the whole run, the cool-down included.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from .tail_config import TailConfig
from .tail_run import Observed

__all__ = ["format_tail_table", "ks_distance", "summarize", "tail_share"]


def ks_distance(a: Sequence[float], b: Sequence[float]) -> float:
    """The two-sample Kolmogorov-Smirnov statistic ``sup_x |F_a(x) - F_b(x)|`` of the
    empirical distribution functions of ``a`` and ``b`` (what ``scipy.stats.ks_2samp``
    reports as its statistic; scipy is not a dependency here).  In [0, 1]; 0 when the
    two samples have the same distribution of values.

    Raises:
        ValueError: ``a`` or ``b`` is empty.
    """
    if not len(a) or not len(b):
        raise ValueError("ks_distance needs two non-empty samples")
    xa, xb = np.sort(np.asarray(a, dtype=float)), np.sort(np.asarray(b, dtype=float))
    points = np.concatenate([xa, xb])  # the sup is reached at a sample point (right limits)
    fa = np.searchsorted(xa, points, side="right") / xa.size
    fb = np.searchsorted(xb, points, side="right") / xb.size
    return float(np.max(np.abs(fa - fb)))


def tail_share(spans: Sequence[tuple[float, float]]) -> float | None:
    """``(start, end)`` of one batch's rows -> (last end - 90th-percentile end) / (last end
    - first start): the share of the batch's generation window that its last 10% of
    rows take (None for an empty or zero-length window)."""
    if not spans:
        return None
    ends = sorted(end for _, end in spans)
    first = min(start for start, _ in spans)
    window = ends[-1] - first
    if window <= 0:
        return None
    return (ends[-1] - ends[math.ceil(0.9 * len(ends)) - 1]) / window


def _r(x: float | None, digits: int = 4) -> float | None:
    return None if x is None or (isinstance(x, float) and math.isnan(x)) else round(x, digits)


def summarize(cfg: TailConfig, obs: Observed) -> dict[str, Any]:
    """The result record of one policy's run (keys: the module docstring's, plus counts)."""
    window = [b for b in obs.batches if b.step < cfg.steps]
    prompts = cfg.steps * cfg.groups_per_step  # the window's prompts: 0 .. prompts - 1
    rows = [row for b in obs.batches for row in b.rows if row[0] < prompts]
    trained = sum(r[2] for r in rows)
    decoded = sum(n for p, n in obs.decoded_by_prompt.items() if p < prompts)
    stale = [b.step - r[3] for b in obs.batches for r in b.rows if r[0] < prompts]
    hist = collections.Counter(stale)
    shares = [s for s in (tail_share([obs.times[(p, j)] for p, j, _, _ in b.rows]) for b in window) if s is not None]
    slots = cfg.sim.max_running_seqs
    lengths = [r[2] for r in rows]
    population = [n for p, n in obs.population if p < prompts]
    started = {p for p, _ in obs.population}
    undecided = {p for p in range(prompts) if p in obs.undecided or p not in started}
    return {
        "policy": obs.policy,
        "time_base": "virtual",
        "steps": cfg.steps,
        "window_s": _r(obs.window_s, 3),
        "steps_per_hour": _r(cfg.steps * 3600.0 / obs.window_s, 3),
        "trainer_idle_fraction": _r(sum(b.wait_s for b in window) / obs.window_s),
        "slot_occupancy": _r(obs.busy_slot_s / (slots * obs.window_s)) if slots else None,
        "tail_share": _r(sum(shares) / len(shares)) if shares else None,
        "thrown_away_token_fraction": _r(1.0 - trained / decoded) if decoded else None,
        "staleness_mean": _r(sum(stale) / len(stale)) if stale else None,
        "staleness_max": max(stale) if stale else None,
        "staleness_histogram": {str(k): hist[k] for k in sorted(hist)},
        "length_bias_ks": _r(ks_distance(lengths, population)) if lengths and population else None,
        "prompts_trained_fraction": _r(len({r[0] for r in rows}) / prompts),
        "window_prompts": prompts,
        "window_prompts_undecided": len(undecided),
        "trained_tokens": trained,
        "decoded_tokens": decoded,
        "decoded_tokens_run": obs.decoded_tokens,
        "rows_trained": len(rows),
        "requests_started": len(population),
        "mean_len_trained": _r(sum(lengths) / len(lengths), 1) if lengths else None,
        "mean_len_generated": _r(sum(population) / len(population), 1) if population else None,
        "truncated_fraction": _r(sum(n >= cfg.max_new_tokens for n in population) / len(population))
        if population else None,
        "batches": len(obs.batches),
        "preemptions": obs.preemptions,
        "groups_rejected_in_window": obs.window_rejected,
        **obs.engine,
    }


_COLUMNS = (("policy", "policy", "{}"), ("steps/h", "steps_per_hour", "{:.1f}"),
            ("idle", "trainer_idle_fraction", "{:.3f}"), ("occupancy", "slot_occupancy", "{:.3f}"),
            ("tail share", "tail_share", "{:.3f}"), ("thrown away", "thrown_away_token_fraction", "{:.3f}"),
            ("stale mean", "staleness_mean", "{:.2f}"), ("stale max", "staleness_max", "{}"),
            ("KS len", "length_bias_ks", "{:.3f}"), ("prompts trained", "prompts_trained_fraction", "{:.3f}"))


def format_tail_table(results: list[dict[str, Any]], *, title: str | None = None) -> str:
    """A fixed-width text table, one row per policy (skipped ones say why)."""
    columns = list(_COLUMNS)
    if any(r.get("spread", {}).get("steps_per_hour") for r in results):  # several seeds: the range of steps/h
        columns.insert(2, ("(min-max)", "spread", "{}"))
    head = [c[0] for c in columns]

    def cell(r: dict[str, Any], key: str, fmt: str) -> str:
        if key == "spread":
            lo_hi = r.get("spread", {}).get("steps_per_hour")
            return "-" if not lo_hi else f"{lo_hi[0]:.1f}-{lo_hi[1]:.1f}"
        return "-" if r.get(key) is None else fmt.format(r[key])

    rows = [[cell(r, key, fmt) for _, key, fmt in columns] for r in results if not r.get("skipped")]
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows)]
    widths[0] = max([widths[0]] + [len(r["policy"]) for r in results])
    lines = [title] if title else []
    lines.append("  ".join(h.rjust(w) for h, w in zip(head, widths)))
    lines.append("  ".join("-" * w for w in widths))
    ran = iter(rows)
    for r in results:
        if r.get("skipped"):
            lines.append(f"{r['policy'].rjust(widths[0])}  skipped: {r['skipped']}")
        else:
            lines.append("  ".join(str(x).rjust(w) for x, w in zip(next(ran), widths)))
    return "\n".join(lines)

"""The vLLM-vs-sim comparison of the tail scenario (``benchmarks/bench_tail_vllm.py``):
rankings, their agreement, and the side-by-side table.  Standard library only.

A *ranking* orders policies by ``steps_per_hour``, fastest first.  Two rankings agree
when they are the same order (``same_order``); Kendall's tau (:func:`kendall_tau`, in
[-1, 1], 1 for the same order) says how far apart they are.  A pair that the two order
differently is *within noise* when the vLLM rows' ranges over the seeds
(``spread.steps_per_hour``) overlap: one seed's order between them is not a measurement.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

__all__ = ["compare", "format_side_by_side", "kendall_tau", "ranking"]


def ranking(rows: Sequence[dict[str, Any]], policies: Sequence[str] | None = None) -> list[str]:
    """The policies of ``rows`` (those in ``policies`` when given; skipped rows left out)
    by ``steps_per_hour``, fastest first (ties: in the rows' order)."""
    ran = [r for r in rows if not r.get("skipped") and (policies is None or r["policy"] in policies)]
    return [r["policy"] for r in sorted(ran, key=lambda r: -r["steps_per_hour"])]


def kendall_tau(a: Sequence[str], b: Sequence[str]) -> float | None:
    """Kendall's tau-a between two orders of the same items (the items of both; None
    with fewer than two): (concordant - discordant pairs) / pairs."""
    common = [x for x in a if x in b]
    if len(common) < 2:
        return None
    pos_b = {x: i for i, x in enumerate(b)}
    pairs = list(itertools.combinations(common, 2))  # ordered as in a
    concordant = sum(pos_b[x] < pos_b[y] for x, y in pairs)
    return round((2 * concordant - len(pairs)) / len(pairs), 4)


def _overlap(r: dict[str, Any], s: dict[str, Any]) -> bool:
    a, b = r.get("spread", {}).get("steps_per_hour"), s.get("spread", {}).get("steps_per_hour")
    return bool(a and b) and a[0] <= b[1] and b[0] <= a[1]


def _ratios(rows: dict[str, dict[str, Any]], base: str) -> dict[str, float]:
    if base not in rows:
        return {}
    return {p: round(r["steps_per_hour"] / rows[base]["steps_per_hour"], 3) for p, r in rows.items()}


def compare(vllm: Sequence[dict[str, Any]], sim: Sequence[dict[str, Any]], policies: Sequence[str],
            reference: Sequence[str] | None = None) -> dict[str, Any]:
    """The comparison of the two backends' rows over ``policies``::

        {"ranking": {"vllm": [...], "sim": [...], "reference_sim": [...] | None},
         "kendall_tau": float | None, "same_order": bool,
         "kendall_tau_vs_reference": {"vllm": ..., "sim": ...} | None,
         "disagreements": [{"pair": [p, q], "vllm_order": [faster, slower], "within_noise": bool}],
         "agree_beyond_noise": bool,   # every disagreement is within noise
         "steps_per_hour_vs_sync": {"vllm": {...}, "sim": {...}}, "steps_per_hour_vs_fcfs": {...}}

    ``reference``: the ranking of the full-scale sim (``benchmarks/reference/bench_tail.json``)."""
    rank_v, rank_s = ranking(vllm, policies), ranking(sim, policies)
    by_v = {r["policy"]: r for r in vllm if not r.get("skipped") and r["policy"] in policies}
    by_s = {r["policy"]: r for r in sim if not r.get("skipped") and r["policy"] in policies}
    pos_s = {p: i for i, p in enumerate(rank_s)}
    disagreements = []
    for p, q in itertools.combinations(rank_v, 2):  # p faster than q on vLLM
        if p in pos_s and q in pos_s and pos_s[p] > pos_s[q]:
            disagreements.append({"pair": sorted([p, q]), "vllm_order": [p, q], "within_noise": _overlap(by_v[p], by_v[q])})
    return {"ranking": {"vllm": rank_v, "sim": rank_s, "reference_sim": list(reference) if reference else None},
            "kendall_tau": kendall_tau(rank_v, rank_s), "same_order": rank_v == rank_s,
            "kendall_tau_vs_reference": None if not reference else {
                "vllm": kendall_tau(list(reference), rank_v), "sim": kendall_tau(list(reference), rank_s)},
            "disagreements": disagreements, "agree_beyond_noise": all(d["within_noise"] for d in disagreements),
            "steps_per_hour_vs_sync": {"vllm": _ratios(by_v, "sync"), "sim": _ratios(by_s, "sync")},
            "steps_per_hour_vs_fcfs": {"vllm": _ratios(by_v, "fcfs"), "sim": _ratios(by_s, "fcfs")}}


_METRICS = (("steps/h", "steps_per_hour", "{:.0f}"), ("tail share", "tail_share", "{:.3f}"),
            ("thrown away", "thrown_away_token_fraction", "{:.3f}"), ("KS len", "length_bias_ks", "{:.3f}"),
            ("stale mean", "staleness_mean", "{:.2f}"), ("occupancy", "slot_occupancy", "{:.2f}"))


def _label(row: dict[str, Any]) -> str:
    server = row.get("server_policy", "priority")
    return row["policy"] if server == "priority" else f"{row['policy']}@{server}"


def format_side_by_side(vllm: Sequence[dict[str, Any]], sim: Sequence[dict[str, Any]], *, title: str | None = None) -> str:
    """One line per row label (``policy``, or ``policy@fcfs`` on a FCFS server): each metric as
    ``vllm / sim``, and steps/h of vLLM with its range over the seeds."""
    sims = {_label(r): r for r in sim}
    head = ["policy", "vLLM steps/h (min-max)"] + [f"{name} vllm/sim" for name, _, _ in _METRICS]
    lines_rows = []
    for r in vllm:
        label = _label(r)
        if r.get("skipped"):
            lines_rows.append([label, f"skipped: {r['skipped']}"] + [""] * len(_METRICS))
            continue
        s = sims.get(label, {})
        lo_hi = r.get("spread", {}).get("steps_per_hour")
        cells = [label, f"{r['steps_per_hour']:.0f}" + (f" ({lo_hi[0]:.0f}-{lo_hi[1]:.0f})" if lo_hi else "")]
        for _, key, fmt in _METRICS:
            a, b = r.get(key), s.get(key)
            cells.append(f"{'-' if a is None else fmt.format(a)} / {'-' if b is None else fmt.format(b)}")
        lines_rows.append(cells)
    widths = [max(len(str(x)) for x in col) for col in zip(head, *lines_rows)]
    lines = [title] if title else []
    lines.append("  ".join(h.rjust(w) for h, w in zip(head, widths)))
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(str(x).rjust(w) for x, w in zip(row, widths)) for row in lines_rows]
    return "\n".join(lines)

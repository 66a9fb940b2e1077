"""Process metrics of a benchmark side (:mod:`benchmarks.harness`): CPU of a process
and its children (reaped, and live ones read from ``/proc``), RSS, percentiles,
memory flatness, the staleness histogram.  Standard library only: the AReaL side
uses it under the peer venv's interpreter too.
"""

from __future__ import annotations

import gc
import math
import os
import resource
import time
from typing import Any

__all__ = ["Meter", "Tally", "batch_figures", "children_cpu_s", "children_rss_mib", "memory_summary", "percentile", "process_cpu_s",
           "process_tree_cpu_s", "rounded", "rss_mib", "staleness_histogram", "steady_rate", "batch_figures"]


def _stat(pid: int) -> list[str] | None:
    """The fields of ``/proc/PID/stat`` after the command name (None if gone)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read().decode()
    except OSError:
        return None
    return data[data.rfind(")") + 2:].split()


def process_cpu_s(pid: int) -> float | None:
    """CPU seconds (user + system) of one live process; None if it is gone."""
    rest = _stat(pid)
    return None if rest is None else (int(rest[11]) + int(rest[12])) / os.sysconf("SC_CLK_TCK")


def _children(parent: int | None = None) -> list[int]:
    """The live direct children of ``parent`` (this process by default)."""
    me, out = os.getpid() if parent is None else parent, []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            rest = _stat(int(pid))
            if rest is not None and int(rest[1]) == me:
                out.append(int(pid))
    return out


def process_tree_cpu_s(pids: list[int]) -> dict[str, dict[int, float]]:
    """CPU seconds of each live process in ``pids`` (``"self"``) and of each live direct
    child of theirs (``"children"``, e.g. a shard's reward workers), by pid."""
    own: dict[int, float] = {}
    kids: dict[int, float] = {}
    for pid in pids:
        cpu = process_cpu_s(pid)
        if cpu is not None:
            own[pid] = cpu
        for child in _children(pid):
            cpu = process_cpu_s(child)
            if cpu is not None:
                kids[child] = cpu
    return {"self": own, "children": kids}


def children_cpu_s() -> float:
    """CPU seconds of reaped children plus live direct children (reward workers)."""
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    total = ru.ru_utime + ru.ru_stime
    for pid in _children():
        total += process_cpu_s(pid) or 0.0
    return total


def children_rss_mib() -> float:
    total = 0.0
    for pid in _children():
        try:
            with open(f"/proc/{pid}/status") as f:
                total += next((int(line.split()[1]) for line in f if line.startswith("VmRSS:")), 0) / 1024
        except OSError:
            pass
    return total


def rss_mib() -> tuple[float, float]:
    """(current, peak) resident set size of this process in MiB."""
    cur = peak = 0.0
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                cur = int(line.split()[1]) / 1024
            elif line.startswith("VmHWM:"):
                peak = int(line.split()[1]) / 1024
    return cur, peak


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile, ``q`` in (0, 1]; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(math.ceil(q * len(ordered)), 1) - 1]


class Meter:
    """CPU, wall and memory of one measured run (start after warm-up).

    Starting a meter runs one full garbage collection first, on every side alike: the
    objects left over from importing torch, transformers, tensordict (and AReaL) would
    otherwise be walked by the first full collection inside the measured window, ~0.2 s
    that no side's per-episode work causes.
    """

    def __init__(self) -> None:
        gc.collect()
        self.rss_before, _ = rss_mib()
        self.cpu0, self.children0 = time.process_time(), children_cpu_s()
        self.t0 = time.perf_counter()
        self.samples: list[tuple[float, float, int]] = []  # (s since t0, RSS MiB, episodes done)

    def sample(self, done: int) -> None:
        self.samples.append((round(time.perf_counter() - self.t0, 3), round(rss_mib()[0], 1), done))

    def result(self, *, wall_s: float, episodes: int, generated_tokens: int, max_inflight: int,
               keep_samples: bool) -> dict[str, Any]:
        cpu_main = time.process_time() - self.cpu0
        cpu_children = children_cpu_s() - self.children0
        rss_after, peak = rss_mib()
        peak_sampled = max([s[1] for s in self.samples] + [rss_after])
        out: dict[str, Any] = {
            "wall_s": round(wall_s, 4),
            "episodes_per_s": round(episodes / wall_s, 2) if wall_s > 0 else None,
            "generated_tokens": generated_tokens,
            "tokens_per_s": round(generated_tokens / wall_s, 1) if wall_s > 0 else None,
            "cpu_main_s": round(cpu_main, 4),
            "cpu_children_s": round(cpu_children, 4),
            "cpu_ms_per_episode": round(1000 * (cpu_main + cpu_children) / max(1, episodes), 4),
            "cpu_ms_per_episode_main": round(1000 * cpu_main / max(1, episodes), 4),
            "rss_before_mib": round(self.rss_before, 1),
            "rss_after_mib": round(rss_after, 1),
            "peak_rss_mib": round(peak, 1),
            "rss_children_mib": round(children_rss_mib(), 1),
            "steady_episodes_per_s": steady_rate(self.samples, episodes),
            "max_inflight": max_inflight,
            "rss_per_inflight_kib": round(1024 * max(peak_sampled - self.rss_before, 0.0) / max(1, max_inflight), 2),
        }
        out["memory"] = memory_summary(self.samples, episodes)
        if keep_samples:
            out["memory_samples"] = self.samples
        return out


def steady_rate(samples: list[tuple[float, float, int]], episodes: int,
                span: tuple[float, float] = (0.25, 0.75)) -> float | None:
    """Episodes/s between the first sample with at least ``span[0] x episodes``
    done and the last with at most ``span[1] x episodes`` done: the rate once the
    first episodes have come back and before the last ones drain (with C in flight
    and ~0.56 s episodes, a 2 x C run spends ~1 s of a 3-5 s wall in ramp and
    drain).  None when fewer than two samples fall in the span or no time passed.
    """
    lo = next((s for s in samples if s[2] >= span[0] * episodes), None)
    hi = next((s for s in reversed(samples) if s[2] <= span[1] * episodes), None)
    if lo is None or hi is None or hi[0] <= lo[0] or hi[2] <= lo[2]:
        return None
    return round((hi[2] - lo[2]) / (hi[0] - lo[0]), 2)


def memory_summary(samples: list[tuple[float, float, int]], episodes: int) -> dict[str, Any]:
    """RSS over the last 90% of the run (by episodes done): min, max, and whether
    it stayed within 10% (``flat``)."""
    tail = [s[1] for s in samples if s[2] >= 0.1 * episodes]
    if len(tail) < 2:
        return {"samples": len(samples), "tail_min_mib": None, "tail_max_mib": None, "tail_spread": None,
                "flat": None}
    lo, hi = min(tail), max(tail)
    spread = (hi - lo) / lo
    return {"samples": len(samples), "tail_min_mib": lo, "tail_max_mib": hi, "tail_spread": round(spread, 4),
            "flat": spread <= 0.10}


def staleness_histogram(values: dict[int, int]) -> dict[str, int]:
    """``{staleness: episodes}`` with string keys (JSON), by increasing staleness."""
    return {str(k): values[k] for k in sorted(values)}


def rounded(x: float | None, digits: int = 4) -> float | None:
    """``round(x, digits)``, None stays None."""
    return None if x is None else round(x, digits)


def batch_figures(trajectories: list[Any]) -> tuple[float, list[int]]:
    """The sum of the rewards of a consumed batch of trajectories (TensorDicts of
    batch ``[1]``: ``rewards`` ``[1]``, ``versions`` and ``loss_mask`` ``[1, L]``,
    ``L >= 1``) and each one's oldest generated token's policy version
    (``versions`` where ``loss_mask`` is set; rows of a group give one figure), in
    a few array ops per batch instead of five tensor ops per trajectory.  Every
    side's consumer (the AReaL peer's too) counts with it."""
    if not trajectories:
        return 0.0, []
    import numpy as np
    import torch  # (the AReaL peer's venv has both: AReaL needs them)

    rewards = float(torch.cat([t["rewards"].reshape(-1) for t in trajectories]).to(torch.float64).sum())
    versions, masks = [t["versions"] for t in trajectories], [t["loss_mask"] for t in trajectories]
    if not all(v.dim() == 2 and v.shape[0] == 1 for v in versions):
        versions, masks = [v.reshape(1, -1) for v in versions], [m.reshape(1, -1) for m in masks]
    starts = np.cumsum([0] + [v.shape[1] for v in versions[:-1]])
    flat = torch.cat(versions, dim=1)[0].numpy()
    generated = torch.cat(masks, dim=1)[0].numpy() != 0
    return rewards, np.minimum.reduceat(np.where(generated, flat, 1 << 30), starts).tolist()


class Tally:
    """What a side's consumer counts over the results it takes (the same on every
    engine side): statuses, failure reasons, reward sum and the staleness of each
    accepted trajectory (current version minus its oldest generated token's)."""

    def __init__(self) -> None:
        self.counts: dict[str, Any] = {"accepted": 0, "rejected": 0, "failed": 0}
        self.failed_by: dict[str, int] = {}
        self.stale: dict[int, int] = {}
        self.reward_sum = 0.0

    def add(self, results: Any, version: int) -> None:
        trajectories = []
        for r in results:
            self.counts[r.status] += 1
            if r.status == "failed":
                reason = str(r.reason or "unknown")
                self.failed_by[reason] = self.failed_by.get(reason, 0) + 1
            elif r.trajectory is not None:
                trajectories.append(r.trajectory)
        reward_sum, oldest = batch_figures(trajectories)
        self.reward_sum += reward_sum
        for v in oldest:
            self.stale[version - v] = self.stale.get(version - v, 0) + 1

    def counts_with_reasons(self) -> dict[str, Any]:
        return {**self.counts, "failed_by_reason": self.failed_by}

    @property
    def reward_mean(self) -> float | None:
        return rounded(self.reward_sum / max(1, self.counts["accepted"]))


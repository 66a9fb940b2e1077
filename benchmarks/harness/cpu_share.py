"""Who used the machine's CPUs during a measurement (Linux ``/proc``; standard library only).

A wall-clock benchmark on a shared box is only as good as the box was quiet; the load
average counts the benchmark's own processes too (a vLLM CPU server alone keeps ~2 cores
busy).  :class:`CpuShare` reads the machine's busy CPU time (``/proc/stat``) and that of
the benchmark's own processes (this one and the given process groups: ``/proc/<pid>/stat``)
at the start and the end, and reports the share of the machine's CPU time that *others*
used in between.  Where ``/proc`` is missing every share is None.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any

__all__ = ["CpuShare"]

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _machine() -> tuple[int, int] | None:
    """``(busy, total)`` clock ticks of all CPUs since boot."""
    try:
        with open("/proc/stat", encoding="ascii") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    total = sum(fields[:8])  # guest time is already in user
    return total - idle, total


def _group_ticks(pgids: set[int]) -> int:
    """utime + stime (ticks) of the live processes of these process groups and of this one
    (children that ended and were waited for included)."""
    ticks = 0
    me = os.getpid()
    try:
        pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
                stat = f.read()
        except OSError:
            continue
        rest = stat.rpartition(")")[2].split()  # after "pid (comm)": state ppid pgrp ...
        if pid != me and int(rest[2]) not in pgids:
            continue
        ticks += int(rest[11]) + int(rest[12])  # utime, stime
        if pid == me:
            ticks += int(rest[13]) + int(rest[14])  # cutime, cstime: waited-for children
    return ticks


@dataclass
class CpuShare:
    """A measurement window (:meth:`start`, :meth:`stop` -> its record).

    Attributes:
        pgids: process groups that are the benchmark's own (e.g. a server started with setsid).
    """

    pgids: set[int] = field(default_factory=set)
    _t0: tuple[int, int] | None = None
    _own0: int = 0
    _wall0: float = 0.0

    def start(self) -> None:
        self._t0, self._own0, self._wall0 = _machine(), _group_ticks(self.pgids), time.monotonic()

    def stop(self) -> dict[str, Any]:
        """``{"cpu_busy_share", "cpu_own_share", "cpu_others_share"}``: shares of the
        machine's CPU time (all CPUs) in the window: busy in all, used by the benchmark's
        processes, used by everything else (None without ``/proc``)."""
        t1 = _machine()
        if self._t0 is None or t1 is None or t1[1] <= self._t0[1]:
            return {"cpu_busy_share": None, "cpu_own_share": None, "cpu_others_share": None}
        total = t1[1] - self._t0[1]
        busy = t1[0] - self._t0[0]
        own = max(0, _group_ticks(self.pgids) - self._own0)
        return {"cpu_busy_share": round(busy / total, 3), "cpu_own_share": round(min(own, busy) / total, 3),
                "cpu_others_share": round(max(busy - own, 0) / total, 3)}

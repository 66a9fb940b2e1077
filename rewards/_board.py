"""The job board: how far a worker job got, readable after its worker was killed.

A micro-batch (:mod:`rewards._batch`) runs several calls in one worker job.  When the
job times out or its worker dies, the job's own result never comes back, yet the
retry policy needs to know which call was running then (that call's attempt failed)
and what the calls before it returned (they keep their results; issue 24).  So each
job of a local pool writes its progress into a *board*: one file shared with every
worker process of the pool and mapped into memory by each (``mmap``), one fixed
region per *ticket*.  A ticket is held by one job at a time
(:meth:`JobBoard.take` / :meth:`JobBoard.give`; the pool has as many as workers).

Region layout (little-endian): a header ``started: int32`` (index of the call being
run, -1 before the first), ``recorded: int32`` (calls whose results follow),
``used: int32`` (bytes used, header included), ``flags: int32``
(:data:`RETIRING`), ``started_at: float64`` (when the running call started,
``time.monotonic()`` seconds: one clock for every process of the machine; 0.0
before the first); then ``recorded`` records, each ``length: int32`` and a pickled
tagged result (:mod:`rewards._worker`).  The worker writes a record first and
the header after it, so a record torn by a kill is never counted.  Writes to a
shared mapping are visible to the other processes at once; the host reads a region
only after the job has ended (its worker reaped).

The worker half (attach, record) is in :mod:`rewards._worker`, which imports only
the standard library; this module is the host half.
"""

from __future__ import annotations

import mmap
import os
import pickle
import shutil
import struct
import tempfile
from dataclasses import dataclass
from typing import Any

__all__ = ["HEADER", "REGION_BYTES", "RETIRING", "JobBoard", "Progress"]

#: Bytes per ticket: room for ~64 small results plus a few exceptions with tracebacks;
#: results past it are not recorded (those calls are re-run, uncharged).
REGION_BYTES = 1 << 16
#: ``started, recorded, used, flags, started_at``
HEADER = struct.Struct("<iiiid")
#: flag: the worker retires after this job (:func:`rewards._worker.retire_worker`)
RETIRING = 1


@dataclass(frozen=True)
class Progress:
    """How far a job got (:meth:`JobBoard.progress`).

    Attributes:
        started: index of the call that was running when the job ended (-1: none started).
        results: the tagged results of the calls that finished, in order (a prefix of
            the job's calls; one that finished past the region's room is not in it).
        retiring: the worker said it retires after this job.
    """

    started: int
    results: tuple[tuple[str, Any], ...]
    retiring: bool


class JobBoard:
    """The host's side of a pool's board: ``tickets`` regions in a temporary file.

    Attributes:
        path: the file workers map (:func:`rewards._worker.init_worker` gets it).
        tickets: regions, i.e. jobs that can record at once.

    Raises:
        OSError: the temporary file cannot be made.
    """

    def __init__(self, tickets: int) -> None:
        self.tickets = tickets
        self._dir = tempfile.mkdtemp(prefix="rollout-rewards-")
        self.path = os.path.join(self._dir, "board")
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, tickets * REGION_BYTES)
            self._map: mmap.mmap | None = mmap.mmap(fd, tickets * REGION_BYTES)
        finally:
            os.close(fd)
        self._free = list(range(tickets - 1, -1, -1))

    def take(self) -> int | None:
        """A free ticket, its region reset; None when all are held."""
        if not self._free or self._map is None:
            return None
        ticket = self._free.pop()
        HEADER.pack_into(self._map, ticket * REGION_BYTES, -1, 0, HEADER.size, 0, 0.0)
        return ticket

    def give(self, ticket: int) -> None:
        """Give back a ticket from :meth:`take` (its job has ended)."""
        self._free.append(ticket)

    def started_at(self, ticket: int) -> float:
        """When the running call of ``ticket``'s job started (``time.monotonic()``
        seconds; 0.0 before its first call, or once closed)."""
        if self._map is None:
            return 0.0
        return float(HEADER.unpack_from(self._map, ticket * REGION_BYTES)[4])

    def retiring(self, ticket: int) -> bool:
        """True if the job of ``ticket`` said that its worker retires."""
        if self._map is None:
            return False
        return bool(HEADER.unpack_from(self._map, ticket * REGION_BYTES)[3] & RETIRING)

    def progress(self, ticket: int) -> Progress:
        """What the (ended) job of ``ticket`` recorded."""
        if self._map is None:  # closed
            return Progress(-1, (), False)
        base = ticket * REGION_BYTES
        started, recorded, used, flags, _ = HEADER.unpack_from(self._map, base)
        results = []
        offset = base + HEADER.size
        end = base + min(max(used, HEADER.size), REGION_BYTES)
        for _ in range(max(recorded, 0)):
            if offset + 4 > end:
                break
            (length,) = struct.unpack_from("<i", self._map, offset)
            if length < 0 or offset + 4 + length > end:
                break
            try:
                results.append(pickle.loads(self._map[offset + 4:offset + 4 + length]))
            except Exception:  # a record this process cannot load: that call is re-run
                break
            offset += 4 + length
        return Progress(started, tuple(results), bool(flags & RETIRING))

    def close(self) -> None:
        """Unmap and delete the file (after the pool's workers have exited)."""
        if self._map is not None:
            self._map.close()
            self._map = None
        shutil.rmtree(self._dir, ignore_errors=True)

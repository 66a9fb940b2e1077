"""What a sharded engine reports about its shards: :class:`ShardStatistics` (one
shard as the coordinator sees it), :class:`AdmissionRecord` (one admission, for
audits), and :func:`merge_statistics` (the shards' backend snapshots summed)."""

from __future__ import annotations

from dataclasses import dataclass, fields, is_dataclass, replace
from typing import Any

from ..executor import EngineStatistics

__all__ = ["AdmissionRecord", "ShardStatistics", "merge_statistics"]


@dataclass(frozen=True)
class AdmissionRecord:
    """One admission (``record_admissions=True``): the state right after it.

    Attributes:
        task_id, shard: the episode admitted and the shard it went to.
        version: the policy version then.
        accepted: the staleness counter of accepted episodes (all shards).
        running: episodes dispatched and not ended, per shard (index order).
    """

    task_id: int
    shard: int
    version: int
    accepted: int
    running: tuple[int, ...]


@dataclass(frozen=True)
class ShardStatistics:
    """One shard as the coordinator sees it.

    Attributes:
        index, pid, kind: the shard (``kind``: ``"process"``, ``"ray"`` or ``"inline"``).
        alive: its channel is open; ``exit`` says how it ended otherwise (``"closed
            (...)"`` when the engine closed it, else how it died).
        running: episodes dispatched to it and not ended.
        admitted, ended: lifetime episodes dispatched to it / returned by it.
        rerun: episodes taken back from it when it died and queued again.
        dropped: results it sent for episodes it no longer held (dropped by task id).
        engine: the latest statistics of its own engine (or None before the first).
            A shard sends them every ``stats_interval_s``, with the frame in which it
            becomes idle (nothing running or queued) and when it closes, so once the
            engine is closed (or idle) they are exact.
    """

    index: int
    pid: int | None
    kind: str
    alive: bool
    exit: str | None
    running: int
    admitted: int
    ended: int
    rerun: int
    dropped: int
    engine: EngineStatistics | None

    def summary(self) -> dict[str, Any]:
        """A plain-JSON-ready record (``rollout run``'s ``summary.json`` ``"shards"``):
        ``shard``, ``kind``, ``pid``, ``admitted``, ``ended``, ``reruns``, ``dropped``,
        ``exit``, and from the shard's own engine ``accepted`` / ``rejected`` / ``failed``
        (as the shard ended them: the coordinator may still reject one as stale),
        ``generated_tokens``,
        ``reward_statistics`` (its reward pool's :class:`~engine.rewards` statistics as
        a dataclass, or None) and ``backend_statistics`` (its backend client's), and
        ``statistics_final``: True when the shard closed cleanly after sending its last
        statistics; False for a shard that died or was killed (its figures are the last
        snapshot it sent: its re-run episodes are counted by the shard that re-ran them)."""
        e = self.engine
        final = not self.alive and (self.exit or "").startswith("closed (exited with status 0")
        return {"shard": self.index, "kind": self.kind, "pid": self.pid, "admitted": self.admitted,
                "ended": self.ended, "reruns": self.rerun, "dropped": self.dropped, "exit": self.exit,
                "statistics_final": final,
                **{k: getattr(e, k) if e is not None else None
                   for k in ("accepted", "rejected", "failed", "generated_tokens")},
                "reward_statistics": e.rewards if e is not None else None,
                "backend_statistics": e.backend if e is not None else None}


def merge_statistics(snapshots: list[Any]) -> Any:
    """Sum the int/float fields of same-typed dataclass snapshots (peaks are summed
    too: an upper bound); other fields come from the first."""
    first = snapshots[0]
    if not is_dataclass(first) or isinstance(first, type) or any(type(s) is not type(first) for s in snapshots):
        return first
    merged = {}
    for f in fields(first):
        values = [getattr(s, f.name) for s in snapshots]
        if f.name != "version" and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
            merged[f.name] = sum(values)
    return replace(first, **merged)

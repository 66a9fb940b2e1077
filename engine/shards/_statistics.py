"""What a sharded engine reports about its shards: :class:`ShardStatistics` (one
shard as the coordinator sees it), :class:`AdmissionRecord` (one admission, for
audits), :func:`merge_statistics` (the shards' backend snapshots summed) and
:func:`at_rest` (a dead shard's snapshot with its gauges at 0)."""

from __future__ import annotations

from dataclasses import dataclass, fields, is_dataclass, replace
from typing import Any

from ..executor import EngineStatistics

__all__ = ["GAUGES", "AdmissionRecord", "ShardStatistics", "at_rest", "merge_statistics"]

#: The fields of the statistics a shard sends that are values *now* (in flight,
#: running, queued, idle), not totals: :class:`~engine.backends.base.BackendStatistics`
#: ``requests_running``; the sim's ``sequences_running`` / ``_queued`` / ``_decoding``;
#: the hf backend's ``requests_waiting``; :class:`~rewards.RewardPoolStatistics`
#: ``busy``, ``workers_busy``, ``workers_idle``, ``workers_starting``; a remote
#: server's ``in_flight`` and ``outstanding_tokens`` (``RemoteStatistics.servers``).  Every other
#: int/float field is a total (a counter), a peak or a mean.  A shard that is no
#: longer alive has none of these: its gauges count as 0 (:func:`at_rest`).
GAUGES = frozenset({"requests_running", "sequences_running", "sequences_queued", "sequences_decoding",
                    "requests_waiting", "busy", "workers_busy", "workers_idle", "workers_starting",
                    "in_flight", "outstanding_tokens"})

#: Mean fields, merged weighted by the count they are a mean over (the hf backend's
#: ``batch_occupancy``: requests per ``generate`` call, over ``batches``).
_MEANS = {"batch_occupancy": "batches"}

#: Fields merged as the highest shard's value (of those that have one): the reward
#: pools' latency percentiles (a percentile of the union is not a function of the
#: shards' percentiles; the highest is an upper bound for p99, a plain figure for p50).
_MAXIMA = frozenset({"latency_p50_s", "latency_p99_s"})


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
        reruns: episodes taken back from it when it died and queued again.
        dropped: results it sent for episodes it no longer held (dropped by task id).
        accepted, rejected, failed: how the episodes it returned ended, counted by the
            coordinator as it took them in (after its staleness check), so exact for a
            shard that died too (``accepted + rejected + failed == ended``).
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
    reruns: int
    dropped: int
    engine: EngineStatistics | None
    accepted: int = 0
    rejected: int = 0
    failed: int = 0

    def summary(self) -> dict[str, Any]:
        """A plain-JSON-ready record (``rollout run``'s ``summary.json`` ``"shards"``):
        ``shard``, ``kind``, ``pid``, ``admitted``, ``ended``, ``reruns``, ``dropped``,
        ``exit``, ``accepted`` / ``rejected`` / ``failed`` (the coordinator's counts of
        the episodes it returned: they add up to ``ended``), and from the shard's own
        engine ``generated_tokens``,
        ``reward_statistics`` (its reward pool's :class:`~engine.rewards` statistics as
        a dataclass, or None) and ``backend_statistics`` (its backend client's), and
        ``statistics_final``: True when the shard closed cleanly after sending its last
        statistics; False for a shard that died or was killed (its figures are the last
        snapshot it sent: its re-run episodes are counted by the shard that re-ran them)."""
        e = self.engine
        final = not self.alive and (self.exit or "").startswith("closed (exited with status 0")
        return {"shard": self.index, "kind": self.kind, "pid": self.pid, "admitted": self.admitted,
                "ended": self.ended, "reruns": self.reruns, "dropped": self.dropped, "exit": self.exit,
                "statistics_final": final,
                "accepted": self.accepted, "rejected": self.rejected, "failed": self.failed,
                "generated_tokens": e.generated_tokens if e is not None else None,
                "reward_statistics": e.rewards if e is not None else None,
                "backend_statistics": e.backend if e is not None else None}


def at_rest(snapshot: Any) -> Any:
    """``snapshot`` (a statistics dataclass, or None) with its :data:`GAUGES` at 0: what
    a shard that is no longer alive has in flight.  Its totals stay (they happened)."""
    if not is_dataclass(snapshot) or isinstance(snapshot, type):
        return snapshot
    changes: dict[str, Any] = {f.name: 0 for f in fields(snapshot) if f.name in GAUGES}
    servers = getattr(snapshot, "servers", None)  # (RemoteStatistics: one record per server)
    if isinstance(servers, tuple):
        changes["servers"] = tuple(at_rest(server) for server in servers)
    return replace(snapshot, **changes)


def _merge_servers(per_shard: list[tuple[Any, ...]], alive: list[bool]) -> tuple[Any, ...]:
    """The remote backends' per-server records (``ServerStatistics``, one per URL in
    each shard's client) merged by URL, in the first shard's order: counts summed
    (``requests``, ``failures``, ``ejections``; ``in_flight`` and
    ``outstanding_tokens`` over live shards only: the records are already at rest
    for dead ones), ``healthy`` when every live shard's client finds it healthy,
    ``access_denied`` when any does, ``weight_version`` and ``last_error`` from the
    first live shard that has one."""
    order: list[str] = []
    by_url: dict[str, list[tuple[Any, bool]]] = {}
    for records, up in zip(per_shard, alive):
        for record in records:
            if record.url not in by_url:
                order.append(record.url)
                by_url[record.url] = []
            by_url[record.url].append((record, up))
    merged = []
    for url in order:
        views = by_url[url]
        live = [r for r, up in views if up] or [r for r, _ in views]
        merged.append(replace(
            live[0], healthy=all(r.healthy for r in live), access_denied=any(r.access_denied for r, _ in views),
            weight_version=next((r.weight_version for r in live if r.weight_version is not None), None),
            last_error=next((r.last_error for r in live if r.last_error is not None), None),
            **{name: sum(getattr(r, name) for r, _ in views)
               for name in ("requests", "failures", "ejections", "in_flight", "outstanding_tokens")}))
    return tuple(merged)


def merge_statistics(snapshots: list[Any], alive: list[bool] | None = None) -> Any:
    """The shards' statistics snapshots (same-typed dataclasses) as one.

    Totals (counters) are summed over every shard, dead ones included; gauges
    (:data:`GAUGES`: in flight, running, queued now) over the shards still alive
    only (a dead shard's last snapshot may say ``requests_running=49``: none runs);
    a mean (``batch_occupancy``) is weighted by its count; a reward pool's latency
    percentiles are the highest shard's.  A peak (``peak_*``)
    is the sum of the shards' peaks: an upper bound on the peak across shards (they
    need not have peaked at the same time).  A remote backend's ``servers`` are
    merged by URL (:func:`_merge_servers`).  ``version`` and the other non-numeric
    fields come from the first live shard's snapshot (else the first).

    Args:
        snapshots: one per shard (at least one).
        alive: per snapshot, whether its shard is alive (default: all are).

    Returns:
        A snapshot of the same type; ``snapshots[0]`` itself when they are not
        dataclasses of one type.
    """
    first = snapshots[0]
    if not is_dataclass(first) or isinstance(first, type) or any(type(s) is not type(first) for s in snapshots):
        return first
    alive = [True] * len(snapshots) if alive is None else list(alive)
    settled = [s if up else at_rest(s) for s, up in zip(snapshots, alive)]
    base = next((s for s, up in zip(settled, alive) if up), settled[0])
    merged: dict[str, Any] = {}
    for f in fields(base):
        values = [getattr(s, f.name) for s in settled]
        if f.name in _MAXIMA:
            merged[f.name] = max((v for v in values if v is not None), default=None)
            continue
        if f.name == "servers" and all(isinstance(v, tuple) for v in values):
            merged[f.name] = _merge_servers(values, alive)
            continue
        if f.name == "version" or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
            continue
        if f.name in _MEANS:
            weights = [getattr(s, _MEANS[f.name]) for s in settled]
            merged[f.name] = sum(v * w for v, w in zip(values, weights)) / sum(weights) if sum(weights) else 0.0
        else:
            merged[f.name] = sum(values)
    return replace(base, **merged)

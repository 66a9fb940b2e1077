"""What a run looks like while it runs: one snapshot for the live view, the
progress lines, the Prometheus endpoint and the report's time series.

:class:`RunMonitor` reads :meth:`RolloutEngine.statistics` and learns about single
episodes in two ways, neither of which changes the engine:

* :meth:`RunMonitor.track` wraps the workflow: each episode is seen when it
  starts, and each generation request it makes (``engine.agenerate``) adds its
  tokens to the episode, so the longest-running episodes (stragglers) can be
  listed with their token counts while they run;
* :meth:`RunMonitor.on_results` is the per-episode callback of the consumer: the
  end of each episode, and for an accepted one its staleness when consumed
  (``version - oldest generated token's version``, in versions).

:meth:`RunMonitor.run_recorder` samples a snapshot every ``interval_s`` seconds
into ``metrics.jsonl`` and writes one line per ended episode to
``episodes.jsonl`` (both in the run's ``--out``), for ``rollout report``.

Times are seconds on trio's clock; token counts are generated tokens.
"""

from __future__ import annotations

import collections
import json
from dataclasses import asdict, dataclass
from typing import Any

import trio

from .._tracker import EpisodeTiming, EpisodeTracker

__all__ = ["EpisodeTiming", "EpisodeTracker", "RunMonitor", "RunSnapshot"]

_RATE_WINDOW_S = 10.0  # tokens/s is measured over this many recent seconds


@dataclass(frozen=True)
class RunSnapshot:
    """Every number the live view, the progress line and the metrics endpoint show.

    Episode counts are in episodes (one submitted item, whatever its group size);
    ``tokens_per_s`` is measured over the last 10 s; ``ahead_versions`` is how
    far generation runs ahead of consumption, ``(accepted + running) / B - version``
    (AReaL's staleness accounting, :mod:`engine.staleness`); ``eta`` is the bound
    on it (``--max-head-offpolicyness``, ``None`` = unbounded).  ``consumer`` is
    False when no consumer takes batches of ``consumer_batch_size`` and bumps the
    version (``rollout run`` without ``--consumer-batch-size``): ``ahead_versions``
    then means nothing and the views leave it out.  ``reward_workers_starting``:
    reward workers being started (not counted busy).  ``shards`` /
    ``shards_alive``: a sharded engine's shard count and how many still run
    (``None`` for one process).
    """

    elapsed_s: float
    total: int
    submitted: int
    queued: int
    running: int
    accepted: int
    rejected: int
    failed: int
    rejected_by_reason: dict[str, int]
    failed_by_reason: dict[str, int]
    results_waiting: int
    generated_tokens: int
    tokens_per_s: float
    version: int
    capacity: int
    consumer_batch_size: int
    eta: int | None
    ahead_versions: float
    reward_calls: int = 0
    reward_workers_busy: int = 0
    reward_max_workers: int = 0
    reward_timeouts: int = 0
    reward_workers_killed: int = 0
    reward_worker_deaths: int = 0
    reward_fallbacks: int = 0
    reward_errors: int = 0
    reward_workers_starting: int = 0
    consumer: bool = True
    consumed: int = 0
    consumed_staleness_mean: float = 0.0
    consumed_staleness_max: int = 0
    stragglers: tuple[EpisodeTiming, ...] = ()
    slowest_ended: tuple[EpisodeTiming, ...] = ()
    shards: int | None = None
    shards_alive: int | None = None

    @property
    def ended(self) -> int:
        return self.accepted + self.rejected + self.failed


class RunMonitor:
    """Snapshots of one run (see the module docstring).

    Args:
        engine: the open :class:`~engine.executor.RolloutEngine`.
        total: episodes the run will submit (for "ended N of total").
        top: how many stragglers / slowest ended episodes a snapshot lists.
        consumer: a consumer takes batches and bumps the version (``RunSnapshot.consumer``).
    """

    def __init__(self, engine: Any, *, total: int, top: int = 5, consumer: bool = True) -> None:
        self.engine = engine
        self.total = total
        self.top = top
        self.consumer = consumer
        self.metrics_url: str | None = None  # set by engine.cli._metrics.observe_run when it serves metrics
        self.start = trio.current_time()
        self._ended_timing: dict[int, EpisodeTiming] = {}
        self._tracker = EpisodeTracker(on_ended=lambda timing: self._ended_timing.__setitem__(timing.task_id, timing))
        self._slowest: list[EpisodeTiming] = []
        self._staleness: list[int] = []
        self._episodes: list[dict[str, Any]] = []  # records not yet written to episodes.jsonl
        self._rate: collections.deque[tuple[float, int]] = collections.deque()
        self.last: RunSnapshot | None = None

    # -- hooks ---------------------------------------------------------------------------------
    def track(self, workflow: Any) -> Any:
        """``workflow`` (a spec :func:`workflows.resolve_workflow` accepts) wrapped so
        that its episodes are timed and their tokens counted (:class:`EpisodeTracker`)."""
        return self._tracker.track(workflow)

    def on_results(self, results: list[Any]) -> None:
        """The consumer's per-episode callback: ``results`` just taken from the engine
        (:class:`~engine.executor.EpisodeResult`), consumed at the current version."""
        version = self.engine.version
        now = trio.current_time() - self.start
        for result in results:
            timing = self._ended_timing.pop(result.task_id, None)
            tokens = timing.tokens if timing else _generated_tokens(result.trajectory)
            seconds = result.elapsed_s or (timing.seconds if timing else 0.0)
            ended = EpisodeTiming(result.task_id, seconds, tokens, timing.requests if timing else 0)
            self._slowest = sorted([*self._slowest, ended], key=lambda e: -e.seconds)[: self.top]
            staleness = _staleness(result.trajectory, version)
            self._staleness += staleness
            self._episodes.append({"t": round(now, 3), "task_id": result.task_id, "status": result.status,
                                   "reason": result.reason, "seconds": round(seconds, 4), "tokens": tokens,
                                   "version": version, "staleness": staleness})

    # -- snapshots -----------------------------------------------------------------------------
    def snapshot(self) -> RunSnapshot:
        """Every number of the run now (sync, cheap: call it from the trio thread)."""
        now = trio.current_time()
        s = self.engine.statistics()
        self._rate.append((now, s.generated_tokens))
        while len(self._rate) > 2 and self._rate[1][0] <= now - _RATE_WINDOW_S:
            self._rate.popleft()
        t0, n0 = self._rate[0]
        rate = (s.generated_tokens - n0) / (now - t0) if now > t0 else 0.0
        config = self.engine.config
        b = config.consumer_batch_size
        r = s.rewards  # (a sharded engine: its shards' pools merged into one)
        elsewhere = self.engine.longest_running(self.top)  # a sharded engine: its shards' trackers
        stragglers = elsewhere if elsewhere is not None else self._tracker.longest_running(self.top)
        stale = self._staleness
        snap = RunSnapshot(
            elapsed_s=now - self.start, total=self.total, submitted=s.submitted, queued=s.queued, running=s.running,
            accepted=s.accepted, rejected=s.rejected, failed=s.failed,
            rejected_by_reason=dict(s.rejected_by_reason), failed_by_reason=dict(s.failed_by_reason),
            results_waiting=s.results_waiting, generated_tokens=s.generated_tokens, tokens_per_s=rate,
            version=s.version, capacity=s.capacity, consumer_batch_size=b, eta=config.max_head_offpolicyness,
            ahead_versions=(s.accepted + s.running) / b - s.version,
            reward_calls=getattr(r, "calls", 0), reward_workers_busy=getattr(r, "workers_busy", 0),
            reward_max_workers=getattr(r, "max_workers", 0) or 0, reward_timeouts=getattr(r, "timeouts", 0),
            reward_workers_killed=getattr(r, "workers_killed", 0),
            reward_worker_deaths=getattr(r, "worker_deaths", 0), reward_fallbacks=getattr(r, "fallbacks", 0),
            reward_errors=getattr(r, "errors", 0), reward_workers_starting=getattr(r, "workers_starting", 0),
            consumer=self.consumer, consumed=len(stale), consumed_staleness_mean=sum(stale) / len(stale) if stale else 0.0,
            consumed_staleness_max=max(stale, default=0),
            stragglers=stragglers, slowest_ended=tuple(self._slowest), **self._shard_counts(),
        )
        self.last = snap
        return snap

    # -- the report's time series --------------------------------------------------------------
    def _shard_counts(self) -> dict[str, int]:
        from ..shards import ShardedRolloutEngine  # (not at import: engine.shards imports the executor)

        if not isinstance(self.engine, ShardedRolloutEngine):
            return {}
        records = self.engine.shard_statistics()
        return {"shards": len(records), "shards_alive": sum(r.alive for r in records)}

    async def run_recorder(self, out_dir: Any, *, interval_s: float = 1.0, append: bool = False,
                           task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """Write a sample to ``out_dir/metrics.jsonl`` every ``interval_s`` seconds and
        the ended episodes to ``out_dir/episodes.jsonl`` (new files, or appended to
        with ``append``), until cancelled (then one last sample and the remaining
        episodes, shielded)."""
        out = trio.Path(out_dir)
        await out.mkdir(parents=True, exist_ok=True)
        mode = "a" if append else "w"
        async with await trio.open_file(out / "metrics.jsonl", mode) as metrics, \
                await trio.open_file(out / "episodes.jsonl", mode) as episodes:
            task_status.started()
            try:
                while True:
                    await self._write(metrics, episodes)
                    await trio.sleep(interval_s)
            finally:
                with trio.CancelScope(shield=True):
                    await self._write(metrics, episodes)

    async def _write(self, metrics: Any, episodes: Any) -> None:
        snap = self.snapshot()
        sample = {k: v for k, v in asdict(snap).items() if k not in ("stragglers", "slowest_ended")}
        sample["elapsed_s"] = round(sample["elapsed_s"], 3)
        sample["longest_running_s"] = round(snap.stragglers[0].seconds, 3) if snap.stragglers else 0.0
        await metrics.write(json.dumps(sample) + "\n")
        n = len(self._episodes)
        if n:
            await episodes.write("".join(json.dumps(r) + "\n" for r in self._episodes[:n]))
            del self._episodes[:n]  # only once written: a cancelled write leaves them for the last one
        await metrics.flush()
        await episodes.flush()


def _generated_tokens(traj: Any) -> int:
    if traj is None or "loss_mask" not in traj.keys():
        return 0
    return int(traj["loss_mask"].sum())


def _staleness(traj: Any, version: int) -> list[int]:
    """Per row: ``version`` minus the version of the row's oldest generated token."""
    if traj is None or "versions" not in traj.keys() or "loss_mask" not in traj.keys():
        return []
    import torch

    versions = traj["versions"]  # [B, T] int32, -1 on prompt and padding
    generated = traj["loss_mask"] > 0  # [B, T]
    big = torch.iinfo(versions.dtype).max
    oldest = torch.where(generated, versions, torch.full_like(versions, big)).amin(dim=1)  # [B]
    return [version - int(v) for v in oldest.tolist() if v != big]


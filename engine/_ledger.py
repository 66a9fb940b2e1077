"""The executor's accounting ledger: every submitted episode, from its task id to its end
and its consumption, counted once.

The invariant ``submitted == queued + running + accepted + rejected + failed`` holds
after every call here (``tests/unit/test_accounting_property.py``).  The staleness
counters (:class:`engine.staleness.StalenessManager`) are admission's, not the
ledger's: they reset on restore, the lifetime counts here do not.  Sync, owned by
:class:`engine.executor.RolloutEngine`; ``statistics()`` reads it, the checkpoint
(:mod:`engine._checkpoint`) saves and loads it."""

from __future__ import annotations

import collections
from collections.abc import Iterable
from typing import Any

from ._records import EpisodeResult, EpisodeStatus

__all__ = ["Ledger"]


class Ledger:
    """Counts, reasons and task ids of one engine.

    Attributes:
        counts: episodes by state: ``"submitted"``, ``"queued"``, ``"running"``,
            ``"accepted"``, ``"rejected"``, ``"failed"``.
        rejected_by, failed_by: episodes by reason (reason -> count; zeros may linger).
        generated_tokens: tokens the backend generated for ``agenerate`` (every segment).
        segments_resumed: generation segments re-sent after an abort (or, under a scheduling
            policy, after a chunk boundary or a probe: :mod:`engine._scheduling`).
        reward_fallbacks: reward calls that ended with the pool's fallback value.
        retokenization_drifts: :mod:`engine.chat` drift events inside episodes.
        next_id: the task id the next ``submit`` without one gets.
        live_ids: task ids submitted and not yet consumed (``wait*`` may still take them).
    """

    __slots__ = ("counts", "failed_by", "generated_tokens", "live_ids", "next_id", "rejected_by",
                 "retokenization_drifts", "reward_fallbacks", "segments_resumed")

    def __init__(self) -> None:
        self.counts: collections.Counter[str] = collections.Counter()
        self.rejected_by: collections.Counter[str] = collections.Counter()
        self.failed_by: collections.Counter[str] = collections.Counter()
        self.generated_tokens = 0
        self.segments_resumed = 0
        self.reward_fallbacks = 0
        self.retokenization_drifts = 0
        self.next_id = 0
        self.live_ids: set[int] = set()

    def new_task(self, task_id: int | None) -> int:
        """Count a submitted (queued) episode under ``task_id``, or the next free id; returns the id.

        Raises:
            ValueError: ``task_id`` is in use (submitted and not yet consumed).
        """
        if task_id is None:
            task_id = self.next_id
        elif task_id in self.live_ids:
            raise ValueError(f"task_id {task_id} is already in use")
        self.next_id = max(self.next_id, task_id + 1)
        self.live_ids.add(task_id)
        self.counts["submitted"] += 1
        self.counts["queued"] += 1
        return task_id

    def started(self) -> None:
        """A queued episode was admitted (it is running now)."""
        counts = self.counts
        counts["queued"] -= 1
        counts["running"] += 1

    def requeued(self) -> None:
        """A running episode went back to the queue (a sharded engine's shard died)."""
        counts = self.counts
        counts["running"] -= 1
        counts["queued"] += 1

    def ended(self, result: EpisodeResult, *, was_running: bool) -> None:
        """A queued or running episode ended as ``result``."""
        self.counts["running" if was_running else "queued"] -= 1
        self._count(result, +1)

    def reclassified(self, old: EpisodeResult, new: EpisodeResult) -> None:
        """An ended episode's result changed (accepted -> rejected ``"stale"`` in the buffer)."""
        self._count(old, -1)
        self._count(new, +1)

    def _count(self, result: EpisodeResult, sign: int) -> None:
        self.counts[result.status] += sign
        if result.status == EpisodeStatus.REJECTED:
            self.rejected_by[result.reason or "unknown"] += sign
        elif result.status != EpisodeStatus.ACCEPTED:
            self.failed_by[result.reason or "unknown"] += sign

    def consumed(self, results: list[EpisodeResult]) -> list[EpisodeResult]:
        """``results`` were taken out of the buffer: their task ids are free again."""
        for r in results:
            self.live_ids.discard(r.task_id)
        return results

    def restored(self, accounting: dict[str, Any], *, rejected_by: dict[str, int], failed_by: dict[str, int],
                 task_ids: Iterable[int], next_id: int) -> None:
        """Load a checkpoint's ``"accounting"`` section (:mod:`engine._checkpoint`) into this
        fresh ledger: the ended counts (``submitted`` becomes their sum) and the token
        counters; the reasons as given; ``task_ids`` are the restored results (unconsumed)."""
        counts = self.counts
        for status in ("accepted", "rejected", "failed"):
            counts[status] = int(accounting[status])
        counts["submitted"] = sum(int(accounting[s]) for s in ("accepted", "rejected", "failed"))
        self.rejected_by.update(rejected_by)
        self.failed_by.update(failed_by)
        self.generated_tokens = int(accounting["generated_tokens"])
        self.segments_resumed = int(accounting["segments_resumed"])
        self.reward_fallbacks = int(accounting["reward_fallbacks"])
        self.live_ids.update(task_ids)
        self.next_id = max(self.next_id, next_id)

    def counters(self) -> tuple[int, int, int, int]:
        """(generated tokens, segments resumed, reward fallbacks, retokenization drifts)."""
        return self.generated_tokens, self.segments_resumed, self.reward_fallbacks, self.retokenization_drifts

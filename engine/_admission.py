"""The executor's admission gate: which queued episode may start now, and which results
are stale.

It owns the queue (submitted, not started, FIFO), the running episodes (admitted, not
ended), the staleness counters behind AReaL's capacity (:mod:`engine.staleness`), the
policy version they are measured against, pause and close.  Episodes move queued ->
running -> ended through its methods, which keep the :class:`~engine._ledger.Ledger`'s
counts in step.  The staleness policy (``max_head_offpolicyness`` = eta,
``staleness_policy``) is applied to each result here: a trajectory whose oldest
generated token is more than eta versions behind the current version is rejected
(``"stale"``) or flagged (``is_stale [B] bool``).  Which queued episode starts next is the
scheduling policy's (:mod:`engine._scheduling`; ``"fcfs"``: the oldest), which admission
builds and holds as :attr:`Admission.policy`.  Sync, except :meth:`Admission.parked`;
owned by :class:`engine.executor.RolloutEngine`."""

from __future__ import annotations

import collections
from collections.abc import Awaitable, Callable
from dataclasses import replace

import torch
import trio
from tensordict import TensorDict

from ._config import EngineConfig
from ._ledger import Ledger
from ._records import EpisodeResult, EpisodeStatus, RejectReason, Task
from ._schedule_base import SchedulingPolicy
from ._scheduling import make_policy
from .staleness import StalenessManager

__all__ = ["Admission"]


class Admission:
    """The queue, the running episodes, the staleness counters and the version.

    Args:
        config: the engine's settings (``max_concurrent_rollouts``,
            ``consumer_batch_size``, ``max_head_offpolicyness``, ``staleness_policy``).
        version: the policy version to start at (the backend's).
        ledger: the engine's ledger, kept in step with every move.
        nursery: where :meth:`admit_now` starts each admitted episode, as
            ``run_episode(task)`` (a task named ``episode-<task id>``).

    Attributes:
        policy: the scheduling policy of ``config.scheduling`` (:func:`engine._scheduling.make_policy`).
        version: the current policy version (``RolloutEngine.set_version`` sets it).
        staleness: the counters behind the capacity (``running``, ``accepted``).
        queue: the queued tasks, oldest first.
        running: task id -> the admitted task not yet ended (its data, for ``state_dict``).
        unpaused: set unless paused (replaced by a new event on each :meth:`pause`).
        closed: the engine is closed: nothing starts, ``submit`` raises.
    """

    def __init__(self, config: EngineConfig, version: int, ledger: Ledger, nursery: trio.Nursery,
                 run_episode: Callable[[Task], Awaitable[None]]) -> None:
        self.version = version
        self.policy: SchedulingPolicy = make_policy(config, self.wake)
        self.staleness = StalenessManager(config.max_concurrent_rollouts, config.consumer_batch_size,
                                          config.max_head_offpolicyness, extra=self.policy.extra_capacity)
        self.queue: collections.deque[Task] = collections.deque()
        self.running: dict[int, Task] = {}
        self.unpaused = trio.Event()
        self.unpaused.set()
        self.closed = False
        self._eta = config.max_head_offpolicyness
        self._flag_stale = config.staleness_policy == "flag"
        self._ledger = ledger
        self._nursery = nursery
        self._run_episode = run_episode
        self._lot = trio.lowlevel.ParkingLot()  # the admission actor, between passes

    # -- pause and wake-ups ---------------------------------------------------------------
    @property
    def paused(self) -> bool:
        return not self.unpaused.is_set()

    def pause(self) -> None:
        if self.unpaused.is_set():
            self.unpaused = trio.Event()

    def resume(self) -> None:
        self.unpaused.set()
        self._lot.unpark_all()

    def wake(self) -> None:
        """Wake the admission actor (capacity may have changed)."""
        self._lot.unpark_all()

    async def parked(self) -> None:
        """Wait for the next :meth:`wake` (the admission actor, between passes)."""
        await self._lot.park()

    # -- queued -> running -> ended ---------------------------------------------------------
    def enqueue(self, task: Task) -> None:
        """Queue a submitted task (the ledger has counted it: ``Ledger.new_task``)."""
        self.queue.append(task)
        if self._lot:  # the admission actor is parked (else it runs anyway: no list per submit)
            self._lot.unpark_all()

    def admit_now(self) -> None:
        """Start queued episodes while capacity allows (sync: called by the admission
        actor, and by an ending episode so that its successor starts in the next pass
        of the run queue instead of the one after)."""
        while self.queue and not self.closed and self.unpaused.is_set() and self.staleness.capacity(self.version) > 0:
            task = self.policy.pick(self.queue)  # "fcfs": the oldest
            if task is None:  # the policy holds the queued ones back (it wakes admission when that changes)
                return
            self._start(task)
            self._nursery.start_soon(self._run_episode, task, name=f"episode-{task.task_id}")

    def admit_next(self) -> Task:
        """Move the oldest queued task to running and return it (the caller starts it; a
        sharded engine's coordinator, which schedules first come, first served)."""
        task = self.queue.popleft()
        self._start(task)
        return task

    def _start(self, task: Task) -> None:
        self._ledger.started()
        self.staleness.running += 1
        self.running[task.task_id] = task
        self.policy.started(task)

    def requeued(self, task: Task) -> None:
        """A running task counts as queued again (a sharded engine's shard died with it);
        the caller puts it back in :attr:`queue` or ends it as queued."""
        del self.running[task.task_id]
        self.staleness.running -= 1
        self._ledger.requeued()

    def ended(self, result: EpisodeResult, *, was_running: bool) -> None:
        """A queued or running episode ended as ``result``."""
        if was_running:
            self.staleness.running -= 1
            del self.running[result.task_id]
        if result.status == EpisodeStatus.ACCEPTED:
            self.staleness.accepted += 1
        self._ledger.ended(result, was_running=was_running)
        self.policy.ended(result.task_id)

    def reclassified(self, old: EpisodeResult, new: EpisodeResult) -> None:
        """An ended episode's result changed (accepted -> ``"stale"``): recount, wake admission."""
        self._ledger.reclassified(old, new)
        self.staleness.accepted += (new.status == EpisodeStatus.ACCEPTED) - (old.status == EpisodeStatus.ACCEPTED)
        self._lot.unpark_all()

    def withdraw(self, task_ids: set[int]) -> list[Task]:
        """Take the queued tasks among ``task_ids`` out of the queue (the caller ends them)."""
        keep: collections.deque[Task] = collections.deque()
        withdrawn: list[Task] = []
        for task in self.queue:
            (withdrawn if task.task_id in task_ids else keep).append(task)
        self.queue = keep
        return withdrawn

    def close(self) -> list[Task]:
        """Close: nothing starts from now on; returns the queued tasks (the caller ends them)."""
        self.closed = True
        return self.drain()

    def drain(self) -> list[Task]:
        """Take every queued task out of the queue (the caller ends them)."""
        tasks = list(self.queue)
        self.queue.clear()
        return tasks

    def why_waiting(self) -> str:
        """Why queued episodes do not start, for timeout messages ("" when none is queued
        and none runs)."""
        queued, running = self._ledger.counts["queued"], self._ledger.counts["running"]
        if not queued:
            return (f"; {running} episodes are still running (the first results also wait for the model and "
                    "the reward workers to start)") if running else ""
        if self.paused:
            return f"; {queued} episodes are queued because the engine is paused (call resume())"
        if self.staleness.capacity(self.version) <= 0 and running == 0:
            eta, B = self.staleness.max_head_offpolicyness, self.staleness.consumer_batch_size
            return (f"; {queued} episodes are queued and cannot start: the staleness bound "
                    f"(max_head_offpolicyness={eta}, consumer_batch_size={B}, version={self.version}, "
                    f"{self.staleness.accepted} accepted) allows no more until set_version() is called "
                    "after a training step")
        if self.policy.name != "fcfs" and self.staleness.capacity(self.version) > 0:
            return (f"; {queued} episodes are queued and scheduling={self.policy.name!r} holds those of prepare_batch's "
                    "pipeline back until its next step (the next prepare_batch call)")
        return f"; {queued} episodes are still queued"

    # -- the staleness policy -----------------------------------------------------------------
    def is_stale(self, traj: TensorDict, eta: int) -> torch.Tensor:
        """[B] bool: the row's oldest generated token is more than ``eta`` versions behind."""
        versions = traj["versions"]  # [B, T] int32, -1 on prompt and padding
        generated = (traj["loss_mask"] > 0) & traj["attention_mask"]  # [B, T]
        big = torch.iinfo(versions.dtype).max
        oldest = torch.where(generated, versions, torch.full_like(versions, big)).amin(dim=1)  # [B]
        # in int64, eta capped to it: an int32 comparison with eta >= 2**31 wraps (AReaL's "no
        # staleness control" is eta = int(1e10) or int(1e12)) and would call every row stale
        behind = self.version - oldest.to(torch.int64)  # [B] int64
        return (oldest != big) & (behind > min(eta, torch.iinfo(torch.int64).max))

    def check_staleness(self, result: EpisodeResult) -> EpisodeResult:
        """``result`` under the staleness policy: as is (no bound, no versions, fresh),
        flagged in place (``"flag"``), or rejected ``"stale"`` (a new record)."""
        traj, eta = result.trajectory, self._eta
        if traj is None or eta is None or "versions" not in traj.keys():
            return result
        stale = self.is_stale(traj, eta)
        if self._flag_stale:
            traj["is_stale"] = stale
            return result
        if bool(stale.any()):
            return replace(result, status=EpisodeStatus.REJECTED, trajectory=None, reason=RejectReason.STALE)
        return result

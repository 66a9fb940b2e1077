"""The scheduling protocol the executor's parts call, its default implementation
(:class:`FCFS`: what the engine did before policies existed), a generation segment's
:class:`SegmentPlan` and the engine-side dispatch bound (:class:`SlotGate`).

The policies themselves, their sources and trade-offs: :mod:`engine._scheduling`.
Who calls what (each part is handed the policy by :class:`engine.executor.RolloutEngine`):

* admission (:mod:`engine._admission`): :meth:`~SchedulingPolicy.pick` the next queued
  task to start, :meth:`~SchedulingPolicy.started` / :meth:`~SchedulingPolicy.ended`;
  the staleness capacity adds :attr:`~SchedulingPolicy.extra_capacity`;
* one generation (:mod:`engine._generate`): when :attr:`~SchedulingPolicy.segments` is
  not None, each segment is planned (``await segments.begin``: it may wait, it sets the
  segment's token budget and ``priority``) and reported (``segments.end``);
* the episode task (:mod:`engine.executor`): :meth:`~SchedulingPolicy.episode_scope`, a
  cancel scope the policy may cancel to cut the episode, and
  :meth:`~SchedulingPolicy.episode_finished`, which gives the cut episode's result;
* ``prepare_batch``'s pipeline (:mod:`engine._batches`): a step starts
  (:meth:`~SchedulingPolicy.step_started`) at each call and ends when its batch is
  handed out (:meth:`~SchedulingPolicy.handed_out`); refills ask
  :meth:`~SchedulingPolicy.room`, take the policy's own items first
  (:meth:`~SchedulingPolicy.next_item`) and report what they submitted
  (:meth:`~SchedulingPolicy.submitted`).

Sync except :meth:`SegmentGate.begin` and :meth:`SlotGate.acquire`.
"""

from __future__ import annotations

import collections
import heapq
import itertools
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Protocol

import trio

from ._records import EpisodeResult, Task
from .types import ModelRequest, ModelResponse

__all__ = ["FCFS", "MAX_ESTIMATE_TOKENS", "BoundedFCFS", "PROBE_PRIORITY", "Key", "SchedulingPolicy", "SegmentGate", "SegmentPlan",
           "SlotGate", "Wake", "estimate_priority", "slot_gate", "with_slot"]

#: a group member: ``(task id, sample index)``
Key = tuple[int, int]

#: length estimates are capped here (tokens) before they become a priority
MAX_ESTIMATE_TOKENS = (1 << 24) - 1
#: the most urgent priority a policy sends: a length probe (vLLM's sense: lower is served first)
PROBE_PRIORITY = -(1 << 24)


def estimate_priority(tokens: int) -> int:
    """The priority of a segment whose group is estimated at ``tokens`` new tokens: longer
    is more urgent (lower), in ``(PROBE_PRIORITY, 0]``."""
    return -min(max(int(tokens), 0), MAX_ESTIMATE_TOKENS)


@dataclass(frozen=True)
class SegmentPlan:
    """How one generation segment is sent (what :meth:`SegmentGate.begin` decided).

    Attributes:
        key: the group member that sends it, ``(task id, sample index)``.
        budget: new tokens this segment may produce (>= 1; <= ``left``).
        priority: the request's ``priority`` for this segment (lower is served first).
        done: tokens the generation had before this segment.
        left: tokens the generation could still produce (its budget minus ``done``).
        slot: the segment holds a :class:`SlotGate` slot, released by ``end``.
        probe: the segment is a group's length probe (``"length_aware"``).
        rid: the generation's ``ModelRequest.rid`` (the same for all its segments; set where
            a policy needs to tell one generation of a member from another).
    """

    key: Key
    budget: int
    priority: int
    done: int
    left: int
    slot: bool = False
    probe: bool = False
    rid: str = ""

    @property
    def chunked(self) -> bool:
        """The budget is below what the generation has left: a ``"length"`` stop at the
        budget is a chunk boundary, and the generation goes on with another segment."""
        return self.budget < self.left

    def finished(self, response: ModelResponse | None) -> bool:
        """Whether ``response`` (None: the segment raised) ends the generation."""
        if response is None or response.stop_reason == "abort":
            return False
        return not (self.chunked and response.stop_reason == "length" and response.output_len == self.budget)


class SegmentGate(Protocol):
    """Plans each generation segment of a policy that shapes them."""

    async def begin(self, key: Key, request: ModelRequest, done: int, left: int) -> SegmentPlan:
        """Plan the next segment of ``request`` for member ``key``, which has ``done``
        tokens and may produce ``left`` more; may wait (a parked member, a probe's
        siblings, a dispatch slot).  Cancelling the caller leaves nothing behind."""
        ...

    def end(self, plan: SegmentPlan, response: ModelResponse | None) -> None:
        """The segment of ``plan`` returned ``response`` (None: it raised or was
        cancelled).  Called exactly once per plan that ``begin`` returned."""
        ...


class SchedulingPolicy(Protocol):
    """What the executor's parts call (see the module docstring).  Sync, except the gate.

    Attributes:
        name: the ``EngineConfig.scheduling`` value.
        segments: the segment gate, or None when the policy leaves segments alone (then
            a generation runs exactly as under ``"fcfs"``).
        extra_capacity: episodes the staleness capacity allows beyond AReaL's bound
            (:class:`engine.staleness.StalenessManager`'s ``extra``).
    """

    name: str
    segments: SegmentGate | None
    extra_capacity: int

    def pick(self, queue: collections.deque[Task]) -> Task | None:
        """Take the next task to start out of ``queue`` (None: none may start now)."""
        ...

    def started(self, task: Task) -> None:
        """``task`` was admitted (it runs from now on)."""
        ...

    def ended(self, task_id: int) -> None:
        """A queued or running episode ended (every submitted one, exactly once)."""
        ...

    def episode_scope(self, task: Task) -> trio.CancelScope | None:
        """A cancel scope the episode runs in, which the policy may cancel to cut it; None: none."""
        ...

    def episode_finished(self, task: Task, *, cut: bool) -> EpisodeResult | None:
        """The episode's scope exited; ``cut``: the policy's cancel ended it.  Returns the
        cut episode's result (None when ``cut`` is false)."""
        ...

    def step_started(self) -> None:
        """``prepare_batch`` was called (a step of its pipeline starts; idempotent)."""
        ...

    def handed_out(self) -> None:
        """``prepare_batch`` handed its batch out (the step ends)."""
        ...

    def room(self, inflight: int, accepted_waiting: int, ahead: int, limit: int) -> int:
        """How many episodes the pipeline may submit now, with ``inflight`` of its episodes
        queued or running, ``accepted_waiting`` accepted results in the buffer, and its
        run-ahead ``ahead`` and ``limit`` (:class:`engine._batches.Feeder`)."""
        ...

    def next_item(self, *, stream_exhausted: bool) -> tuple[bool, Any]:
        """``(True, item)``: the pipeline submits the policy's own ``item`` (a deferred
        prompt) before reading its dataloader; ``(False, None)``: none now."""
        ...

    def submitted(self, task_id: int, *, own: bool) -> None:
        """The pipeline submitted ``task_id`` (``own``: an item of :meth:`next_item`)."""
        ...

    def pending_items(self) -> int:
        """Items the policy holds that the pipeline still has to submit (deferred prompts)."""
        ...

    def statistics(self) -> dict[str, Any] | None:
        """The policy's counters (None for ``"fcfs"``)."""
        ...

    def deferred_state(self) -> list[Any]:
        """The items :meth:`pending_items` counts, for a checkpoint."""
        ...

    def load_deferred(self, items: list[Any]) -> None:
        """Hold ``items`` (a checkpoint's :meth:`deferred_state`) again."""
        ...


class FCFS:
    """``"fcfs"``: first come, first served (AReaL's executor): the queue's oldest task
    starts first, segments are sent as the workflow asks, steps cut nothing.  The other
    policies subclass it and override what they change."""

    name = "fcfs"
    segments: SegmentGate | None = None
    extra_capacity = 0

    def pick(self, queue: collections.deque[Task]) -> Task | None:
        return queue.popleft()

    def started(self, task: Task) -> None:
        pass

    def ended(self, task_id: int) -> None:
        pass

    def episode_scope(self, task: Task) -> trio.CancelScope | None:
        return None

    def episode_finished(self, task: Task, *, cut: bool) -> EpisodeResult | None:
        return None

    def step_started(self) -> None:
        pass

    def handed_out(self) -> None:
        pass

    def room(self, inflight: int, accepted_waiting: int, ahead: int, limit: int) -> int:
        return max(0, min(ahead - inflight, limit - inflight - accepted_waiting))

    def next_item(self, *, stream_exhausted: bool) -> tuple[bool, Any]:
        return False, None

    def submitted(self, task_id: int, *, own: bool) -> None:
        pass

    def pending_items(self) -> int:
        return 0

    def statistics(self) -> dict[str, Any] | None:
        return None

    def deferred_state(self) -> list[Any]:
        return []

    def load_deferred(self, items: list[Any]) -> None:
        if items:
            raise ValueError(f"load_state_dict: the state holds {len(items)} prompts deferred by "
                             f"scheduling='tail_batching'; load it into an engine with that scheduling")


class BoundedFCFS(FCFS):
    """``"fcfs"`` with ``EngineConfig.scheduling_max_segments``: first come, first served,
    each generation one segment, at most ``slots`` of them at the server; the others wait
    in the engine in arrival order (their requests' own ``priority`` first), unsent.

    Counters (:meth:`statistics`): ``max_segments`` (the bound), ``segments_waiting`` (now)
    and ``peak_segments_waiting``.
    """

    def __init__(self, slots: int) -> None:
        self._slots = SlotGate(slots)
        self.segments = self

    async def begin(self, key: Key, request: ModelRequest, done: int, left: int) -> SegmentPlan:
        await self._slots.acquire(request.priority)
        return SegmentPlan(key, left, request.priority, done, left, slot=True)

    def end(self, plan: SegmentPlan, response: ModelResponse | None) -> None:
        self._slots.release()

    def statistics(self) -> dict[str, Any] | None:
        return {"policy": self.name, **slot_counters(self._slots)}


class _Waiter:
    __slots__ = ("event", "state")

    def __init__(self) -> None:
        self.event = trio.Event()
        self.state = "waiting"  # -> granted | gone


class SlotGate:
    """At most ``slots`` segments in flight; waiting ones get a slot lowest priority
    first, in arrival order among equals (``EngineConfig.scheduling_max_segments``).

    Attributes:
        slots: the bound.
        busy: slots held now.
        peak_waiting: most segments waiting for a slot at once.
    """

    def __init__(self, slots: int) -> None:
        self.slots = slots
        self.busy = 0
        self.peak_waiting = 0
        self._heap: list[tuple[int, int, _Waiter]] = []
        self._waiting = 0
        self._seq = itertools.count()

    @property
    def waiting(self) -> int:
        return self._waiting

    @property
    def free(self) -> bool:
        """A segment asking now gets a slot at once (one is free and nobody waits)."""
        return self.busy < self.slots and not self._waiting

    async def acquire(self, priority: int) -> None:
        """Wait for a slot (at once when one is free and nobody waits)."""
        if self.free:
            self.busy += 1
            await trio.lowlevel.checkpoint()
            return
        waiter = _Waiter()
        heapq.heappush(self._heap, (priority, next(self._seq), waiter))
        self._waiting += 1
        self.peak_waiting = max(self.peak_waiting, self._waiting)
        try:
            await waiter.event.wait()
        except BaseException:
            if waiter.state == "granted":  # granted, then cancelled before it ran: pass the slot on
                self.release()
            else:
                waiter.state = "gone"
                self._waiting -= 1
            raise

    def release(self) -> None:
        """Give a slot back (a waiting segment takes it)."""
        self.busy -= 1
        while self.busy < self.slots and self._heap:
            waiter = heapq.heappop(self._heap)[2]
            if waiter.state != "waiting":
                continue
            waiter.state = "granted"
            self._waiting -= 1
            self.busy += 1
            waiter.event.set()


def slot_gate(config_slots: int | str | None) -> SlotGate | None:
    """The dispatch bound of ``EngineConfig.scheduling_max_segments`` (None: unbounded).

    Raises:
        ValueError: ``"server"``, not resolved to the backend's limit (the engine resolves
            it when it opens: :func:`engine._scheduling.resolve_max_segments`).
    """
    if isinstance(config_slots, str):
        raise ValueError(f"scheduling_max_segments={config_slots!r} is resolved when the engine opens "
                         "(open_rollout_engine); a policy built outside it needs an int or None")
    return None if config_slots is None else SlotGate(config_slots)


def slot_counters(slots: SlotGate | None) -> dict[str, int | None]:
    """The dispatch bound's counters in a policy's ``statistics()``: ``max_segments`` (the
    bound; None: unbounded), ``segments_waiting`` (now) and ``peak_segments_waiting``."""
    if slots is None:
        return {"max_segments": None, "segments_waiting": 0, "peak_segments_waiting": 0}
    return {"max_segments": slots.slots, "segments_waiting": slots.waiting, "peak_segments_waiting": slots.peak_waiting}


async def with_slot(slots: SlotGate | None, plan: SegmentPlan) -> SegmentPlan:
    """``plan`` once it holds a slot of ``slots`` (``plan`` itself when unbounded); the
    gate's ``end`` releases it."""
    if slots is None:
        return plan
    await slots.acquire(plan.priority)
    return replace(plan, slot=True)


#: wakes the admission actor (``Admission.wake``): a policy that held tasks back lets them go
Wake = Callable[[], None]

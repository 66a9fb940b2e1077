"""``scheduling="length_aware"``: Seer's context-aware scheduling (arXiv 2511.14617,
Moonshot AI / Tsinghua) without its global KV pool; the contract and the trade-off are
in :mod:`engine._scheduling`.

Per group (an episode with ``group_size > 1``): the first member to send a segment is the
group's **probe**; its first segment is sent at :data:`PROBE_PRIORITY` with at most
``length_aware_probe_tokens`` new tokens.  Its siblings wait until that segment returns;
the group's length estimate is then the probe's length if it finished, else its whole
budget (a group still going after the probe is taken to be as long as allowed).  Every
later segment of the group (siblings, the probe's continuation, later turns) is sent
with priority ``-estimate`` (:func:`estimate_priority`): longer groups first.  With
``scheduling_max_segments`` the engine itself dispatches segments in that order (the
admission order for backends without server priorities), and a sibling that finds a free
slot goes at once, unestimated (priority 0): the probe only orders a queue, and waiting
for it would delay the group while its staleness runs from the probe's version (the tail
benchmark: a 256-token probe costs every long group ~7 s).
"""

from __future__ import annotations

from typing import Any

import trio

from ._config import EngineConfig
from ._records import Task
from ._schedule_base import (FCFS, PROBE_PRIORITY, Key, SegmentPlan, Wake, estimate_priority, slot_counters, slot_gate,
                             with_slot)
from .types import ModelRequest, ModelResponse

__all__ = ["LengthAware"]


class _Group:
    __slots__ = ("estimate", "first_call", "known", "probe", "probe_rid", "size")

    def __init__(self, size: int) -> None:
        self.size = size
        self.probe: int | None = None  # the probe's sample index
        self.probe_rid = ""  # the probe's generation (a member may run several at once: n_samples)
        self.first_call = False  # the probe's first generation is still going
        self.estimate = 0  # tokens: the group's length estimate, once `known` is set
        self.known = trio.Event()


class LengthAware(FCFS):
    """See the module docstring.

    Counters (:meth:`statistics`): ``probes`` (probe segments sent), ``probes_finished``
    (probes that ended within the probe budget: their length is the estimate),
    ``siblings_waited`` (members that waited for their group's probe),
    ``siblings_unestimated`` (members sent before their probe returned, at priority 0,
    because the dispatch bound had a free slot: no queue to order), ``max_segments`` (the
    dispatch bound; None: unbounded), ``segments_waiting``
    (now, for a dispatch slot) and ``peak_segments_waiting``.
    """

    name = "length_aware"

    def __init__(self, config: EngineConfig, wake: Wake) -> None:
        self._probe_tokens = config.length_aware_probe_tokens
        self._slots = slot_gate(config.scheduling_max_segments)
        self._groups: dict[int, _Group] = {}
        self.segments = self
        self.probes = 0
        self.probes_finished = 0
        self.siblings_waited = 0
        self.siblings_unestimated = 0

    # -- episodes ------------------------------------------------------------------------------
    def started(self, task: Task) -> None:
        if task.group_size > 1:
            self._groups[task.task_id] = _Group(task.group_size)

    def ended(self, task_id: int) -> None:
        group = self._groups.pop(task_id, None)
        if group is not None:
            group.known.set()

    # -- segments --------------------------------------------------------------------------------
    async def begin(self, key: Key, request: ModelRequest, done: int, left: int) -> SegmentPlan:
        group = self._groups.get(key[0])
        if group is None:  # a group of one, or a generation outside an episode: nothing to estimate
            return await with_slot(self._slots, SegmentPlan(key, left, request.priority, done, left))
        if group.probe is None:
            group.probe, group.probe_rid, group.first_call = key[1], request.rid, True
            self.probes += 1
            budget = min(self._probe_tokens, left)
            return await with_slot(self._slots, SegmentPlan(key, budget, PROBE_PRIORITY, done, left, probe=True,
                                                            rid=request.rid))
        rid = request.rid
        if not group.known.is_set() and rid != group.probe_rid:  # a sibling, or the probe member's other samples
            if self._slots is not None and self._slots.free:  # no queue to order: waiting would only delay it
                self.siblings_unestimated += 1
                return await with_slot(self._slots, SegmentPlan(key, left, 0, done, left))
            self.siblings_waited += 1
            await group.known.wait()  # bounded: the probe's segment is in flight, and ends (or raises) once
        return await with_slot(self._slots, SegmentPlan(key, left, estimate_priority(group.estimate), done, left,
                                                        rid=rid))

    def end(self, plan: SegmentPlan, response: ModelResponse | None) -> None:
        if plan.slot:
            assert self._slots is not None
            self._slots.release()
        group = self._groups.get(plan.key[0])
        if group is None or plan.rid != group.probe_rid or not group.first_call:
            return
        finished = plan.finished(response)
        if finished:
            assert response is not None
            group.estimate = plan.done + response.output_len
            group.first_call = False
            if plan.probe:
                self.probes_finished += 1
        elif plan.probe:  # still going after the probe (or it failed): as long as it may be
            group.estimate = plan.done + plan.left
        if response is None:
            group.first_call = False
        group.known.set()

    def statistics(self) -> dict[str, Any]:
        return {"policy": self.name, "probes": self.probes, "probes_finished": self.probes_finished,
                "siblings_waited": self.siblings_waited, "siblings_unestimated": self.siblings_unestimated,
                **slot_counters(self._slots)}

"""The step policies: ``scheduling="overprovision"`` (APRIL, arXiv 2509.18521) and
``scheduling="tail_batching"`` (RollPacker, arXiv 2509.21009); the contract and the
trade-offs are in :mod:`engine._scheduling`.

Both shape ``prepare_batch``'s pipeline in synchronous steps: a step starts when
``prepare_batch`` is called and ends when it hands out its batch (the first ``B``
complete groups).  During a step the pipeline keeps ``E = ceil((1 + r) * B)`` of its
episodes queued, running or accepted-and-waiting (``r`` = ``overprovision_ratio``);
between steps it submits and starts none of its own (the trainer trains).  At the
hand-out the pipeline's episodes still running are *cut*:

* ``overprovision`` parks each member at its next segment (segments are at most
  ``overprovision_chunk_tokens`` long, so that is soon) with its tokens and their versions
  kept; at the next step they go first: no queued episode of the pipeline starts before
  every parked member has re-sent its segment, and their segments carry ``priority - 1``;
* ``tail_batching`` cancels the episode: it ends rejected ``"deferred"`` (its completed
  segments' tokens are thrown away, counted) and its prompt joins the long-prompt queue;
  a step that starts with at least ``B`` deferred prompts is a *long round*: it runs
  exactly those ``B`` prompts again, from scratch, nothing else, and cuts none of them.

Episodes that ``submit`` / ``rollout_batch`` start are not the pipeline's: they run as
under ``"fcfs"``, at any time.
"""

from __future__ import annotations

import collections
import math
from typing import Any

import trio

from ._config import EngineConfig
from ._records import EpisodeResult, EpisodeStatus, RejectReason, Task
from ._schedule_base import FCFS, Key, SegmentPlan, Wake, slot_counters, slot_gate, with_slot
from .types import ModelRequest, ModelResponse

__all__ = ["Overprovision", "TailBatching"]


class _StepPolicy(FCFS):
    """What both step policies share: the steps, the pipeline's episodes, the room."""

    def __init__(self, config: EngineConfig, wake: Wake) -> None:
        B = config.consumer_batch_size
        self._batch = B
        self._target = math.ceil((1 + config.overprovision_ratio) * B)  # E: episodes per step
        self.extra_capacity = self._target - B
        self._wake = wake
        self._slots = slot_gate(config.scheduling_max_segments)
        self._in_step = False
        self._pipeline: set[int] = set()  # the pipeline's episodes, queued or running
        self._running: set[int] = set()  # of those, admitted
        self.steps = 0
        self.cut_episodes = 0

    def _admissible(self, task_id: int) -> bool:
        return self._in_step or task_id not in self._pipeline

    def pick(self, queue: collections.deque[Task]) -> Task | None:
        for i, task in enumerate(queue):
            if self._admissible(task.task_id):
                del queue[i]
                return task
        return None

    def started(self, task: Task) -> None:
        if task.task_id in self._pipeline:
            self._running.add(task.task_id)

    def ended(self, task_id: int) -> None:
        self._pipeline.discard(task_id)
        self._running.discard(task_id)

    def submitted(self, task_id: int, *, own: bool) -> None:
        self._pipeline.add(task_id)

    def step_started(self) -> None:
        if self._in_step:
            return
        self._in_step = True
        self.steps += 1
        self._wake()  # queued episodes of the pipeline may start again

    def handed_out(self) -> None:
        self._in_step = False

    def room(self, inflight: int, accepted_waiting: int, ahead: int, limit: int) -> int:
        return max(0, self._target - inflight - accepted_waiting) if self._in_step else 0

    def _statistics(self) -> dict[str, Any]:
        return {"policy": self.name, "steps": self.steps, "in_step": self._in_step,
                "episodes_per_step": self._target, "cut_episodes": self.cut_episodes, **slot_counters(self._slots)}


class Overprovision(_StepPolicy):
    """APRIL's active partial rollouts (see the module docstring).

    Counters (:meth:`statistics`): ``steps``, ``cut_episodes`` (episodes running at a
    hand-out), ``parks`` (members parked, over time), ``parked`` (now),
    ``resumed_segments`` (first segments of parked members in their next step),
    ``recycled_episodes`` (episodes that were parked at least once and are alive now).
    """

    name = "overprovision"

    def __init__(self, config: EngineConfig, wake: Wake) -> None:
        super().__init__(config, wake)
        self._chunk = config.overprovision_chunk_tokens
        self._cut: set[int] = set()  # episodes whose members park at their next segment
        self._recycled: set[int] = set()  # alive episodes parked at least once: their segments go first
        self._parked: set[Key] = set()
        self._release = trio.Event()  # set at the next step
        self._resuming: set[Key] = set()  # released members yet to re-send: the pipeline's queue waits
        self.segments = self
        self.parks = 0
        self.resumed_segments = 0

    def _admissible(self, task_id: int) -> bool:
        if task_id not in self._pipeline:
            return True
        return self._in_step and not self._resuming

    def ended(self, task_id: int) -> None:
        super().ended(task_id)
        self._cut.discard(task_id)
        self._recycled.discard(task_id)
        if self._resuming:
            self._resuming = {k for k in self._resuming if k[0] != task_id}
            if not self._resuming:
                self._wake()

    def step_started(self) -> None:
        if self._in_step:
            return
        self._cut.clear()
        if self._parked:
            self._resuming = set(self._parked)
            self._release.set()
            self._release = trio.Event()
        super().step_started()

    def handed_out(self) -> None:
        super().handed_out()
        self._cut.update(self._running)
        self.cut_episodes += len(self._running)

    async def begin(self, key: Key, request: ModelRequest, done: int, left: int) -> SegmentPlan:
        task_id = key[0]
        if task_id not in self._pipeline:
            return await with_slot(self._slots, SegmentPlan(key, left, request.priority, done, left))
        if task_id in self._cut:  # cut at the last hand-out: wait for the next step
            self._parked.add(key)
            self._recycled.add(task_id)  # from its first park on (statistics; its segments' priority)
            self.parks += 1
            release = self._release
            try:
                await release.wait()  # until the next prepare_batch call (or the engine closes)
            finally:
                self._parked.discard(key)
        budget = left if self._chunk is None else min(self._chunk, left)
        priority = request.priority - 1 if task_id in self._recycled else request.priority
        plan = await with_slot(self._slots, SegmentPlan(key, budget, priority, done, left))
        if key in self._resuming:
            self._resuming.discard(key)
            self.resumed_segments += 1
            if not self._resuming:
                self._wake()
        return plan

    def end(self, plan: SegmentPlan, response: ModelResponse | None) -> None:
        if plan.slot:
            assert self._slots is not None
            self._slots.release()

    def statistics(self) -> dict[str, Any]:
        return {**self._statistics(), "parks": self.parks, "parked": len(self._parked),
                "resumed_segments": self.resumed_segments, "recycled_episodes": len(self._recycled)}


class TailBatching(_StepPolicy):
    """RollPacker's tail batching (see the module docstring).

    Counters (:meth:`statistics`): ``steps``, ``long_rounds``, ``cut_episodes`` (episodes
    cancelled at a hand-out), ``deferred_episodes`` (of those, the ones the cut ended:
    an episode that finished first is kept), ``deferred_prompts`` (now, waiting for a long
    round), ``tokens_discarded`` (tokens of the completed segments of deferred episodes).
    """

    name = "tail_batching"

    def __init__(self, config: EngineConfig, wake: Wake) -> None:
        super().__init__(config, wake)
        self._deferred: collections.deque[Any] = collections.deque()  # the long-prompt queue
        self._round: collections.deque[Any] = collections.deque()  # the long round's prompts not yet submitted
        self._long_round = False
        self._own: set[int] = set()  # alive episodes of deferred prompts: never cut
        self._scopes: dict[int, trio.CancelScope] = {}
        self._tokens: collections.Counter[int] = collections.Counter()  # tokens per alive episode
        self.segments = self  # (it counts the tokens of episodes that may be cut)
        self.long_rounds = 0
        self.deferred_episodes = 0
        self.tokens_discarded = 0

    def ended(self, task_id: int) -> None:
        super().ended(task_id)
        self._own.discard(task_id)
        self._scopes.pop(task_id, None)
        self._tokens.pop(task_id, None)

    def submitted(self, task_id: int, *, own: bool) -> None:
        super().submitted(task_id, own=own)
        if own:
            self._own.add(task_id)

    def episode_scope(self, task: Task) -> trio.CancelScope | None:
        if task.task_id not in self._pipeline or task.task_id in self._own:
            return None
        scope = self._scopes[task.task_id] = trio.CancelScope()
        return scope

    def episode_finished(self, task: Task, *, cut: bool) -> EpisodeResult | None:
        self._scopes.pop(task.task_id, None)
        if not cut:
            return None
        self._deferred.append(task.data)
        self.deferred_episodes += 1
        self.tokens_discarded += self._tokens.pop(task.task_id, 0)
        return EpisodeResult(task.task_id, EpisodeStatus.REJECTED, reason=RejectReason.DEFERRED, data=task.data,
                             error_message="cut when its step handed out the first complete groups "
                                           "(scheduling='tail_batching'): its prompt runs again in a long round")

    def step_started(self) -> None:
        if self._in_step:
            return
        self._long_round = len(self._deferred) >= self._batch
        if self._long_round:
            self.long_rounds += 1
            self._round.extend(self._deferred.popleft() for _ in range(self._batch))
        super().step_started()

    def handed_out(self) -> None:
        super().handed_out()
        self._long_round = False
        for task_id in self._running:
            scope = self._scopes.get(task_id)
            if scope is not None:
                self.cut_episodes += 1
                scope.cancel()

    def room(self, inflight: int, accepted_waiting: int, ahead: int, limit: int) -> int:
        if not self._in_step:
            return 0
        if self._long_round:  # its own prompts, then (if rejections left it short) fresh ones up to B
            return len(self._round) or max(0, self._batch - inflight - accepted_waiting)
        return super().room(inflight, accepted_waiting, ahead, limit)

    def next_item(self, *, stream_exhausted: bool) -> tuple[bool, Any]:
        if self._round:
            return True, self._round.popleft()
        if stream_exhausted and self._deferred and not self._long_round:  # the data ran out: the rest, uncut
            return True, self._deferred.popleft()
        return False, None

    def pending_items(self) -> int:
        return len(self._deferred) + len(self._round)

    def deferred_state(self) -> list[Any]:
        return [*self._round, *self._deferred]

    def load_deferred(self, items: list[Any]) -> None:
        self._deferred.extend(items)

    async def begin(self, key: Key, request: ModelRequest, done: int, left: int) -> SegmentPlan:
        return await with_slot(self._slots, SegmentPlan(key, left, request.priority, done, left))

    def end(self, plan: SegmentPlan, response: ModelResponse | None) -> None:
        if plan.slot:
            assert self._slots is not None
            self._slots.release()
        if response is not None and plan.key[0] in self._scopes:
            self._tokens[plan.key[0]] += response.output_len

    def statistics(self) -> dict[str, Any]:
        return {**self._statistics(), "long_rounds": self.long_rounds, "long_round": self._long_round,
                "deferred_episodes": self.deferred_episodes, "deferred_prompts": self.pending_items(),
                "tokens_discarded": self.tokens_discarded}

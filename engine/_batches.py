"""The batch calls of the engine: :meth:`RolloutEngine.rollout_batch` (submit a
batch, wait for all of it) and :meth:`RolloutEngine.prepare_batch` (AReaL's
asynchronous path), and ``prepare_batch``'s run-ahead pipeline (issue 18): keep
``(eta + 1) * B`` episodes of its dataloader queued or running (AReaL
``WorkflowExecutor.prepare_batch``), refilled as each episode ends and right after a
batch is taken, so generation overlaps the trainer's step; the dataloader is read
through a :class:`~engine.datastream.DataStream` (the data position).  The
docstrings, with the contracts, are on the methods of the engine."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import trio
from tensordict import TensorDict

from ._admission import Admission
from ._breaker import BreakerTrip, FailureBreaker
from ._collated import ITEMS_FIX, check_item
from ._config import EngineConfig
from ._ledger import Ledger
from ._records import EngineCalls, EpisodeResult, EpisodeStatus
from .buffer import ResultBuffer
from .data import concat_padded_tensors
from .datastream import DataStream
from .errors import DataExhaustedError, DatasetError, EpisodeFailuresError
from .workflow import EngineRewards

__all__ = ["PATIENCE_S", "BatchPipeline", "Feeder", "accepted_batch", "accepted_trajectories", "check_rewards"]

logger = logging.getLogger("rollout.engine.executor")  # the engine's log lines, wherever they come from

#: seconds a prepare_batch waits before it logs why it is still waiting (and again after each further interval)
PATIENCE_S = 60.0


def accepted_trajectories(results: Iterable[EpisodeResult]) -> list[TensorDict]:
    """The trajectories of the accepted results, in order."""
    return [r.trajectory for r in results if r.status == EpisodeStatus.ACCEPTED and r.trajectory is not None]


def accepted_batch(where: str, results: list[EpisodeResult]) -> TensorDict:
    """The accepted results' trajectories concatenated, in order (``where`` names the call).

    Only rejected results give an empty batch (a filter may reject a whole batch on purpose:
    AReaL's ``rollout_batch`` returns ``[]`` then).

    Raises:
        EpisodeFailuresError: none was accepted and some failed; names the counts by reason
            and the first failures (the first of each distinct error, three at most); ``trip``
            holds the counts.  Without it the caller got a batch with no keys and failed later, on a
            ``KeyError`` far from the cause (a new-user trial).
    """
    accepted = accepted_trajectories(results)
    failed = [r for r in results if r.status == EpisodeStatus.FAILED]
    if accepted or not failed:
        return concat_padded_tensors(accepted)
    by_reason: dict[str, int] = {}
    first: dict[tuple[Any, ...], EpisodeResult] = {}  # the first failure of each distinct error
    for r in sorted(failed, key=lambda r: r.task_id):
        by_reason[str(r.reason)] = by_reason.get(str(r.reason), 0) + 1
        first.setdefault((r.reason, r.error_type, r.error_message), r)
    examples = [f"task {r.task_id}: {r.error_type}: {' '.join(str(r.error_message).split())[:300]}"
                for r in list(first.values())[:3]]
    reasons = ", ".join(f"{k}: {v}" for k, v in sorted(by_reason.items(), key=lambda kv: -kv[1]))
    rejected = len(results) - len(failed)
    rule = (f"none of {len(results)} episodes was accepted: {len(failed)} failed ({reasons})"
            + (f", {rejected} rejected" if rejected else ""))
    raise EpisodeFailuresError(f"{where}: {rule}; first failures: {'; '.join(examples)}",
                               BreakerTrip(len(failed), len(results), by_reason, examples[0], rule))


@dataclass(eq=False)
class Feeder:
    """``prepare_batch``'s pipeline: its data stream, the episode spec of the latest
    call, and the episodes it has in flight (queued or running)."""

    stream: DataStream
    workflow: Any
    should_accept_fn: Callable[..., Any] | None
    group_size: int
    ahead: int  # episodes to keep queued or running: (eta + 1) * B (AReaL)
    limit: int  # in flight + accepted results waiting, at most (ahead + B)
    inflight: set[int] = field(default_factory=set)
    error: BaseException | None = None  # raised by the dataloader while refilling


class BatchPipeline:
    """``rollout_batch``, ``prepare_batch`` and the run-ahead pipeline of one engine.

    Args:
        config: the engine's settings (``consumer_batch_size``, ``max_head_offpolicyness``,
            ``max_concurrent_rollouts``).
        ledger: read for the next task id (the breaker's watermark).
        admission: read for ``closed`` and why a wait waits.
        buffer: where the results are waited for and taken.
        breaker: the failure breaker (reset by a call after it opened, raised when it opens).
        calls: the engine's operations (submit, resolve, admit, refill, take, withdraw).
        reward_pool: the engine's reward pool: a workflow's reward functions are checked in
            one of its workers before the first episode (:func:`check_rewards`).

    Attributes:
        feeder: ``prepare_batch``'s pipeline, or None before its first call (and after
            ``reset_data_stream``).
        restored_position: a checkpoint's data position, kept for the next data stream.
    """

    def __init__(self, config: EngineConfig, ledger: Ledger, admission: Admission, buffer: ResultBuffer,
                 breaker: FailureBreaker, calls: EngineCalls, reward_pool: EngineRewards | None = None) -> None:
        self._config = config
        self._reward_pool = reward_pool
        self._ledger = ledger
        self._admission = admission
        self._buffer = buffer
        self._breaker = breaker
        self._calls = calls
        self.feeder: Feeder | None = None
        self.restored_position: dict[str, Any] | None = None

    async def rollout_batch(self, items: Iterable[Any], workflow: Any, workflow_kwargs: dict[str, Any] | None,
                            should_accept_fn: Callable[..., Any] | None, group_size: int) -> TensorDict:
        if isinstance(items, (dict, str, bytes)):
            raise DatasetError(f"rollout_batch: items must be an iterable of dataset items, got "
                               f"{type(items).__name__} (a dict here is usually a collated batch: "
                               "build the DataLoader with collate_fn=lambda rows: rows and pass each batch)")
        items = items if isinstance(items, list) else list(items)
        for i, item in enumerate(items):  # all of them before any is submitted: nothing is left half-submitted
            check_item(item, "rollout_batch: items[%d]", ITEMS_FIX, i)
        breaker, buffer = self._breaker, self._buffer
        if breaker.open and breaker.reported:
            breaker.reset(watermark=self._ledger.next_id)
        wf = self._calls.resolve(workflow, workflow_kwargs)
        await check_rewards(self._reward_pool, wf)
        ids = [self._calls.submit(item, wf, should_accept_fn=should_accept_fn, group_size=group_size) for item in items]
        trips = breaker.trips
        pos = 0

        def all_ended() -> bool:  # amortised O(len(ids)) over all wake-ups
            nonlocal pos
            while pos < len(ids) and ids[pos] in buffer:
                pos += 1
            return pos == len(ids)

        def tripped() -> bool:
            return breaker.trips > trips and breaker.open

        await buffer.wait_until(lambda: all_ended() or tripped())
        if not all_ended():
            self._calls.withdraw(set(ids), "not started: the failure breaker opened")
            await buffer.wait_until(all_ended)
        results = self._calls.take([buffer.pop(i) for i in ids])
        if breaker.open and breaker.trips > trips:
            self._raise_breaker("rollout_batch")
        return accepted_batch("rollout_batch", results)

    async def prepare_batch(self, dataloader: Iterable[Any] | DataStream, workflow: Any,
                            workflow_kwargs: dict[str, Any] | None, should_accept_fn: Callable[..., Any] | None,
                            group_size: int, dynamic_bs: bool, timeout: float | None) -> TensorDict:
        if self._admission.closed:
            raise trio.ClosedResourceError("the rollout engine is closed")
        B = self._config.consumer_batch_size
        breaker, buffer = self._breaker, self._buffer
        await check_rewards(self._reward_pool, self._calls.resolve(workflow, workflow_kwargs))
        if breaker.open and breaker.reported:  # called again after the error: submit again
            breaker.reset(watermark=self._ledger.next_id)  # what is still in flight ran the old cause
        feeder = self.feeder_for(dataloader, workflow, workflow_kwargs, should_accept_fn, group_size)

        def ready() -> bool:
            return (len(buffer) if dynamic_bs else buffer.accepted_results) >= B

        policy = self._admission.policy

        def drained() -> bool:  # a one-pass dataloader ran out and all its episodes ended
            return feeder.stream.exhausted and not feeder.inflight and not policy.pending_items()

        def stop_waiting() -> bool:
            return ready() or breaker.open or feeder.error is not None or drained()

        policy.step_started()  # a step of the pipeline (what the step policies of engine._scheduling shape)
        self._calls.refill()
        deadline = trio.current_time() + (math.inf if timeout is None else timeout)
        while not stop_waiting() and trio.current_time() < deadline:
            with trio.move_on_at(min(deadline, trio.current_time() + PATIENCE_S)):
                await buffer.wait_until(stop_waiting)
            if not stop_waiting() and trio.current_time() < deadline:  # a long wait says why, once per PATIENCE_S
                logger.warning("prepare_batch has waited %.0f s for %d %s results%s%s", PATIENCE_S, B,
                               "ended" if dynamic_bs else "accepted", self._admission.why_waiting(),
                               breaker.recent_failures())
        if feeder.error is not None:
            exc, feeder.error = feeder.error, None
            raise exc
        if not ready():
            if breaker.open:
                self._raise_breaker("prepare_batch")
            if drained():
                if not len(buffer) or (not dynamic_bs and not buffer.accepted_results):
                    raise DataExhaustedError(
                        f"prepare_batch: the one-pass dataloader is exhausted after {feeder.stream.items_taken} "
                        "items and every episode it fed has been returned")
                rest = self._calls.take([buffer.pop_oldest() for _ in range(len(buffer))])
                policy.handed_out()
                return accepted_batch("prepare_batch", rest)
            raise TimeoutError(f"prepare_batch: fewer than {B} {'ended' if dynamic_bs else 'accepted'} results "
                               f"within {timeout} s{self._admission.why_waiting()}{breaker.recent_failures()}")
        taken: list[EpisodeResult] = []
        accepted = 0
        while (len(taken) < B) if dynamic_bs else (accepted < B):
            taken.append(buffer.pop_oldest())
            accepted += taken[-1].status == EpisodeStatus.ACCEPTED
        self._calls.take(taken)
        policy.handed_out()  # the step ends: a step policy cuts what still runs
        self._calls.refill()  # top the pipeline back up at once: the next batch generates while the trainer trains
        return accepted_batch("prepare_batch", taken)

    def _raise_breaker(self, where: str) -> None:
        trip = self._breaker.trip
        assert trip is not None  # called only while the breaker is open
        self._breaker.reported = True  # stays open: nothing is submitted until the caller calls again
        raise EpisodeFailuresError(
            f"{where}: stopped submitting: {trip.describe()}; fix the cause and call {where} again", trip)

    # -- the run-ahead pipeline --------------------------------------------------------------
    @property
    def stream(self) -> DataStream | None:
        return self.feeder.stream if self.feeder is not None else None

    def position(self) -> dict[str, Any] | None:
        """Where ``prepare_batch`` is in its dataloader (:meth:`DataStream.state_dict`), or None."""
        return self.feeder.stream.state_dict() if self.feeder is not None else None

    def feeder_for(self, dataloader: Any, workflow: Any, workflow_kwargs: dict[str, Any] | None,
                   should_accept_fn: Callable[..., Any] | None, group_size: int) -> Feeder:
        """The pipeline over ``dataloader`` with this call's episode spec.

        Raises:
            ValueError: ``group_size < 1``.
            DatasetError: ``dataloader`` is another object than the one streamed from (not exhausted).
        """
        if group_size < 1:
            raise ValueError(f"group_size must be >= 1, got {group_size}")
        feeder = self.feeder
        if feeder is not None and dataloader is not feeder.stream and dataloader is not feeder.stream.source:
            if not (feeder.stream.exhausted and not feeder.inflight):
                raise DatasetError(
                    f"prepare_batch: dataloader is a different object ({type(dataloader).__name__}) than the one "
                    f"this engine streams from ({feeder.stream!r}); pass the same object every call (a new list "
                    "per call would restart at item 0), call engine.reset_data_stream() to switch, or use "
                    "rollout_batch(items) for a fixed set of items")
            feeder = None
        wf = self._calls.resolve(workflow, workflow_kwargs)
        if feeder is None:
            stream = dataloader if isinstance(dataloader, DataStream) else DataStream(dataloader)
            if self.restored_position is not None and not isinstance(dataloader, DataStream):
                stream.load_state_dict(self.restored_position)  # continue where the checkpoint was
                self.restored_position = None
            B, eta = self._config.consumer_batch_size, self._config.max_head_offpolicyness
            ahead = (eta + 1) * B if eta is not None else max(B, self._config.max_concurrent_rollouts)
            # more queued than the buffer holds could not deposit anyway; a huge eta ("no staleness
            # control", AReaL's int(1e10)) would read the dataloader without end
            if ahead > self._buffer.capacity:  # (the capacity may be math.inf: unbounded)
                ahead = max(B, int(self._buffer.capacity))
            feeder = self.feeder = Feeder(stream, wf, should_accept_fn, group_size, ahead, ahead + B)
        feeder.workflow, feeder.should_accept_fn, feeder.group_size = wf, should_accept_fn, group_size
        return feeder

    def ended(self, task_id: int) -> bool:
        """An episode ended: it leaves the pipeline's episodes in flight.  Returns whether
        there is a pipeline (to refill)."""
        feeder = self.feeder
        if feeder is None:
            return False
        feeder.inflight.discard(task_id)
        return True

    def refill(self) -> None:
        """Submit from ``prepare_batch``'s dataloader while its pipeline has room (sync:
        called after a batch is taken and as each episode ends)."""
        feeder, buffer = self.feeder, self._buffer
        if feeder is None or self._admission.closed or self._breaker.open or feeder.error is not None:
            return
        policy = self._admission.policy  # "fcfs": room = min(ahead - inflight, limit - inflight - accepted waiting)
        room = policy.room(len(feeder.inflight), buffer.accepted_results, feeder.ahead, feeder.limit)
        while room > 0:
            own, item = policy.next_item(stream_exhausted=feeder.stream.exhausted)  # a deferred prompt first
            if not own:
                try:
                    ok, item = feeder.stream.take()
                except Exception as exc:  # the user's dataloader raised: prepare_batch re-raises it
                    feeder.error = exc
                    buffer.wake_consumers()
                    return
                if not ok:
                    own, item = policy.next_item(stream_exhausted=True)  # the data ran out: what the policy holds
                    if not own:
                        buffer.wake_consumers()  # a waiting prepare_batch may be drained now
                        return
            task_id = self._calls.submit(item, feeder.workflow, should_accept_fn=feeder.should_accept_fn,
                                         group_size=feeder.group_size)
            feeder.inflight.add(task_id)
            policy.submitted(task_id, own=own)
            room -= 1
        self._calls.admit()


async def check_rewards(reward_pool: EngineRewards | None, workflow: Any) -> None:
    """Check the reward functions ``workflow`` holds (its ``reward_fn``, and that of each
    :class:`~rewards.AsyncRewardWrapper` among its attributes) in a real reward worker,
    once per pool, before its first episode (:meth:`rewards.RewardPool.check_reward_fn_once`;
    no pool, or a duck-typed pool without it, is not checked).

    Raises:
        RewardError: a reward function cannot be pickled or loaded in a worker (named).
    """
    check = getattr(reward_pool, "check_reward_fn_once", None)
    if check is None:
        return
    from rewards import AsyncRewardWrapper

    found = [getattr(workflow, "reward_fn", None)]
    found += [v.reward_fn for v in getattr(workflow, "__dict__", {}).values() if isinstance(v, AsyncRewardWrapper)]
    for fn in found:
        if callable(fn):
            await check(fn)

"""The batch calls of the engine: :meth:`RolloutEngine.rollout_batch` (submit a
batch, wait for all of it) and :meth:`RolloutEngine.prepare_batch` (AReaL's
asynchronous path over the run-ahead pipeline of :mod:`engine._feeder`).  The
docstrings, with the contracts, are on the methods."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable
from typing import Any

import trio
from tensordict import TensorDict

from ._records import EpisodeResult, EpisodeStatus
from .data import concat_padded_tensors
from ._collated import ITEMS_FIX, check_item
from .datastream import DataStream
from .errors import DataExhaustedError, DatasetError

# ``engine`` parameters are a RolloutEngine, typed loosely: these modules sit below engine.executor
__all__ = ["PATIENCE_S", "accepted_trajectories", "prepare_batch", "rollout_batch"]

logger = logging.getLogger("rollout.engine.executor")  # the engine's log lines, wherever they come from

#: seconds a prepare_batch waits before it logs why it is still waiting (and again after each further interval)
PATIENCE_S = 60.0


def accepted_trajectories(results: Iterable[EpisodeResult]) -> list[TensorDict]:
    """The trajectories of the accepted results, in order."""
    return [r.trajectory for r in results if r.status == EpisodeStatus.ACCEPTED and r.trajectory is not None]


async def rollout_batch(engine: Any, items: Iterable[Any], workflow: Any,
                        workflow_kwargs: dict[str, Any] | None, should_accept_fn: Callable[..., Any] | None,
                        group_size: int) -> TensorDict:
    if isinstance(items, (dict, str, bytes)):
        raise DatasetError(f"rollout_batch: items must be an iterable of dataset items, got "
                           f"{type(items).__name__} (a dict here is usually a collated batch: "
                           "build the DataLoader with collate_fn=lambda rows: rows and pass each batch)")
    items = items if isinstance(items, list) else list(items)
    for i, item in enumerate(items):  # all of them before any is submitted: nothing is left half-submitted
        check_item(item, "rollout_batch: items[%d]", ITEMS_FIX, i)
    if engine._breaker.open and engine._breaker.reported:
        engine._breaker.reset(watermark=engine._ledger.next_id)
    wf = engine._resolve(workflow, workflow_kwargs)
    ids = [engine.submit(item, wf, should_accept_fn=should_accept_fn, group_size=group_size) for item in items]
    trips = engine._breaker.trips
    pos = 0

    def all_ended() -> bool:  # amortised O(len(ids)) over all wake-ups
        nonlocal pos
        while pos < len(ids) and ids[pos] in engine._buffer:
            pos += 1
        return pos == len(ids)

    def tripped() -> bool:
        return engine._breaker.trips > trips and engine._breaker.open

    await engine._buffer.wait_until(lambda: all_ended() or tripped())
    if not all_ended():
        engine._withdraw_queued(set(ids), "not started: the failure breaker opened")
        await engine._buffer.wait_until(all_ended)
    results = engine._take([engine._buffer.pop(i) for i in ids])
    if engine._breaker.open and engine._breaker.trips > trips:
        engine._raise_breaker("rollout_batch")
    return concat_padded_tensors(accepted_trajectories(results))


async def prepare_batch(engine: Any, dataloader: Iterable[Any] | DataStream, workflow: Any,
                        workflow_kwargs: dict[str, Any] | None, should_accept_fn: Callable[..., Any] | None,
                        group_size: int, dynamic_bs: bool, timeout: float | None) -> TensorDict:
    if engine._admission.closed:
        raise trio.ClosedResourceError("the rollout engine is closed")
    B = engine.config.consumer_batch_size
    if engine._breaker.open and engine._breaker.reported:  # called again after the error: submit again
        engine._breaker.reset(watermark=engine._ledger.next_id)  # what is still in flight ran the old cause
    feeder = engine._feeder_for(dataloader, workflow, workflow_kwargs, should_accept_fn, group_size)

    def ready() -> bool:
        return (len(engine._buffer) if dynamic_bs else engine._buffer.accepted_results) >= B

    def drained() -> bool:  # a one-pass dataloader ran out and all its episodes ended
        return feeder.stream.exhausted and not feeder.inflight

    def stop_waiting() -> bool:
        return ready() or engine._breaker.open or feeder.error is not None or drained()

    engine._refill()
    deadline = trio.current_time() + (math.inf if timeout is None else timeout)
    while not stop_waiting() and trio.current_time() < deadline:
        with trio.move_on_at(min(deadline, trio.current_time() + PATIENCE_S)):
            await engine._buffer.wait_until(stop_waiting)
        if not stop_waiting() and trio.current_time() < deadline:  # a long wait says why, once per PATIENCE_S
            logger.warning("prepare_batch has waited %.0f s for %d %s results%s%s", PATIENCE_S, B,
                           "ended" if dynamic_bs else "accepted", engine._admission.why_waiting(),
                           engine._breaker.recent_failures())
    engine._raise_feeder_error(feeder)
    if not ready():
        if engine._breaker.open:
            engine._raise_breaker("prepare_batch")
        if drained():
            if not len(engine._buffer) or (not dynamic_bs and not engine._buffer.accepted_results):
                raise DataExhaustedError(
                    f"prepare_batch: the one-pass dataloader is exhausted after {feeder.stream.items_taken} "
                    "items and every episode it fed has been returned")
            rest = engine._take([engine._buffer.pop_oldest() for _ in range(len(engine._buffer))])
            return concat_padded_tensors(accepted_trajectories(rest))
        raise TimeoutError(f"prepare_batch: fewer than {B} {'ended' if dynamic_bs else 'accepted'} results "
                           f"within {timeout} s{engine._admission.why_waiting()}{engine._breaker.recent_failures()}")
    taken: list[EpisodeResult] = []
    accepted = 0
    while (len(taken) < B) if dynamic_bs else (accepted < B):
        taken.append(engine._buffer.pop_oldest())
        accepted += taken[-1].status == EpisodeStatus.ACCEPTED
    engine._take(taken)
    engine._refill()  # top the pipeline back up at once: the next batch generates while the trainer trains
    return concat_padded_tensors(accepted_trajectories(taken))

"""``prepare_batch``'s pipeline (issue 18): keep ``(eta + 1) * B`` episodes of its
dataloader queued or running (AReaL ``WorkflowExecutor.prepare_batch``), refilled as
each episode ends and right after a batch is taken, so generation overlaps the
trainer's step; read the dataloader through a :class:`~engine.datastream.DataStream`
(the data position).  Functions of the engine (:class:`engine.executor.RolloutEngine`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .datastream import DataStream
from .errors import DatasetError

__all__ = ["Feeder", "feeder_for", "refill"]


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


def feeder_for(engine: Any, dataloader: Any, workflow: Any, workflow_kwargs: dict[str, Any] | None,
               should_accept_fn: Callable[..., Any] | None, group_size: int) -> Feeder:
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    feeder = engine._feeder
    if feeder is not None and dataloader is not feeder.stream and dataloader is not feeder.stream.source:
        if not (feeder.stream.exhausted and not feeder.inflight):
            raise DatasetError(
                f"prepare_batch: dataloader is a different object ({type(dataloader).__name__}) than the one "
                f"this engine streams from ({feeder.stream!r}); pass the same object every call (a new list "
                "per call would restart at item 0), call engine.reset_data_stream() to switch, or use "
                "rollout_batch(items) for a fixed set of items")
        feeder = None
    wf = engine._resolve(workflow, workflow_kwargs)
    if feeder is None:
        stream = dataloader if isinstance(dataloader, DataStream) else DataStream(dataloader)
        if engine._restored_data_position is not None and not isinstance(dataloader, DataStream):
            stream.load_state_dict(engine._restored_data_position)  # continue where the checkpoint was
            engine._restored_data_position = None
        B, eta = engine.config.consumer_batch_size, engine.config.max_head_offpolicyness
        ahead = (eta + 1) * B if eta is not None else max(B, engine.config.max_concurrent_rollouts)
        feeder = engine._feeder = Feeder(stream, wf, should_accept_fn, group_size, ahead, ahead + B)
    feeder.workflow, feeder.should_accept_fn, feeder.group_size = wf, should_accept_fn, group_size
    return feeder

def refill(engine: Any) -> None:
    """Submit from ``prepare_batch``'s dataloader while its pipeline has room (sync:
    called after a batch is taken and as each episode ends)."""
    feeder = engine._feeder
    if feeder is None or engine._admission.closed or engine._breaker.open or feeder.error is not None:
        return
    while (len(feeder.inflight) < feeder.ahead
           and len(feeder.inflight) + engine._buffer.accepted_results < feeder.limit):
        try:
            ok, item = feeder.stream.take()
        except Exception as exc:  # the user's dataloader raised: prepare_batch re-raises it
            feeder.error = exc
            engine._buffer.wake_consumers()
            return
        if not ok:
            engine._buffer.wake_consumers()  # a waiting prepare_batch may be drained now
            return
        feeder.inflight.add(engine.submit(item, feeder.workflow, should_accept_fn=feeder.should_accept_fn,
                                        group_size=feeder.group_size))
    engine._admit_now()

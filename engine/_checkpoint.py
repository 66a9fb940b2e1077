"""``RolloutEngine.state_dict`` / ``load_state_dict``: the engine's part of a
trainer's checkpoint.

State, format 1 (plain containers, tensors and the dataset items, so that
``torch.save`` / ``torch.load(weights_only=True)`` round-trip it when the items are
plain dicts, lists, strings and numbers)::

    {
      "format": 1,
      "version": int,                      # the policy version
      "staleness_accepted": int,           # informational: the live counter at save
      "accounting": {"accepted", "rejected", "failed": int, "rejected_by_reason",
                     "failed_by_reason": {reason: int}, "generated_tokens",
                     "segments_resumed", "reward_fallbacks": int},
      "results": [{"task_id", "status", "trajectory": {"batch_size": [B],
                   "fields": {key: tensor}} | None, "reason", "error_type",
                   "error_message", "member_errors", "data", "elapsed_s"}, ...],
                                           # ended, not consumed: completion order
      "pending": [{"task_id", "data", "group_size"}, ...],
                                           # queued and running: task id order
      "next_task_id": int,
      "data_position": {"epoch", "position", "items_taken", "exhausted"} | None,
    }

On load, the staleness counter follows AReaL's restore (``accepted = version *
B``, :meth:`engine.staleness.StalenessManager.restore`; AReaL issue #1388) plus
the accepted results put back in the buffer, which the trainer has not consumed
yet and which AReaL would have lost.  Pending episodes are re-submitted (their
generation starts over: partial tokens are not kept) with their task ids.
Results and pending episodes are counted once: lifetime ``submitted`` becomes the
ended count, plus one per re-submitted episode.

A sharded engine (:class:`engine.shards.ShardedRolloutEngine`) saves and loads this
same state through these functions (its coordinator holds the queue, the running
episodes, the buffer and the accounting; the token and reward counters are read from
``statistics()``, which sums them over the shards), so a state saved by either kind of
engine loads into the other.
"""

from __future__ import annotations

from typing import Any

__all__ = ["FORMAT", "check_loadable", "data_position_state", "engine_state", "load_data_position",
           "load_engine_state"]

FORMAT = 1


def _plain_trajectory(traj: Any) -> dict[str, Any] | None:
    if traj is None:
        return None
    return {"batch_size": list(traj.batch_size), "fields": {k: traj.get(k) for k in traj.keys()}}


def _trajectory(state: dict[str, Any] | None) -> Any:
    from tensordict import TensorDict

    if state is None:
        return None
    return TensorDict(dict(state["fields"]), batch_size=state["batch_size"])


# -- the data position -------------------------------------------------------------------
def data_position_state(engine: Any) -> Any:
    """Where ``prepare_batch`` is in its dataloader (:meth:`engine.datastream.DataStream.state_dict`),
    or ``None`` when it has not been called."""
    stream = engine.data_stream
    return None if stream is None else stream.state_dict()


def load_data_position(engine: Any, position: Any) -> None:
    """Keep ``position`` for the next ``prepare_batch``: the :class:`~engine.datastream.DataStream`
    it creates over its dataloader continues there (the items of episodes that were in flight
    are re-submitted by :func:`load_engine_state`, so they are not read again).

    Raises:
        ValueError: ``position`` is neither ``None`` nor a data-stream state.
    """
    if position is not None and not (isinstance(position, dict) and {"epoch", "position"} <= position.keys()):
        raise ValueError(f"load_state_dict: data_position must be a DataStream state, got {position!r}")
    engine._batches.restored_position = position


def engine_state(engine: Any) -> dict[str, Any]:
    """See :meth:`engine.RolloutEngine.state_dict`."""
    counts, stats = engine._ledger.counts, engine.statistics()  # (a sharded engine's counters: sums over its shards)
    pending = sorted([*engine._admission.queue, *engine._admission.running.values()], key=lambda t: t.task_id)
    return {
        "format": FORMAT,
        "version": int(engine.version),
        "staleness_accepted": int(engine._admission.staleness.accepted),
        "accounting": {
            "accepted": counts["accepted"], "rejected": counts["rejected"], "failed": counts["failed"],
            "rejected_by_reason": {str(k): v for k, v in engine._ledger.rejected_by.items() if v},
            "failed_by_reason": {str(k): v for k, v in engine._ledger.failed_by.items() if v},
            "generated_tokens": stats.generated_tokens, "segments_resumed": stats.segments_resumed,
            "reward_fallbacks": stats.reward_fallbacks,
        },
        # plain strings, not the status/reason enums: a checkpoint loads with torch.load(weights_only=True)
        "results": [{"task_id": r.task_id, "status": str(r.status), "trajectory": _plain_trajectory(r.trajectory),
                     "reason": None if r.reason is None else str(r.reason), "error_type": r.error_type, "error_message": r.error_message,
                     "member_errors": [list(m) for m in r.member_errors], "data": r.data, "elapsed_s": r.elapsed_s}
                    for r in engine._buffer.results()],
        "pending": [{"task_id": t.task_id, "data": t.data, "group_size": t.group_size} for t in pending],
        "next_task_id": engine._ledger.next_id,
        "data_position": data_position_state(engine),
    }


def check_loadable(engine: Any, state: Any, workflow: Any) -> None:
    """The checks :func:`load_engine_state` makes before it changes anything.

    Raises:
        ValueError: ``state`` is not format :data:`FORMAT`, ``engine`` has submitted
            episodes, or ``state`` holds pending episodes and ``workflow`` is None.
    """
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        found = state.get("format") if isinstance(state, dict) else type(state).__name__
        raise ValueError(f"load_state_dict: unknown state format {found!r} (expected {FORMAT})")
    submitted = engine._ledger.counts["submitted"]
    if submitted:
        raise ValueError(f"load_state_dict needs a fresh engine; this one has submitted {submitted} "
                         "episodes")
    pending = state["pending"]
    if pending and workflow is None:
        raise ValueError(f"load_state_dict: the state holds {len(pending)} queued or running episodes; pass the "
                         "workflow to re-submit them")


def _vocabulary(kind: Any, value: Any) -> Any:
    """``value`` as the member of ``kind`` (a str enum such as ``RejectReason``) it
    names, as the engine records it before a save; unchanged if it names none (a
    custom reason) or is None.  (The state holds plain strings: ``weights_only``.)"""
    try:
        return value if value is None else kind(value)
    except ValueError:
        return value


def load_engine_state(engine: Any, state: dict[str, Any], workflow: Any, workflow_kwargs: dict[str, Any] | None,
                      should_accept_fn: Any) -> list[int]:
    """See :meth:`engine.RolloutEngine.load_state_dict`."""
    from ._records import EpisodeResult, EpisodeStatus, FailReason, RejectReason

    check_loadable(engine, state, workflow)
    pending = state["pending"]
    results = [EpisodeResult(r["task_id"], _vocabulary(EpisodeStatus, r["status"]),
                             trajectory=_trajectory(r["trajectory"]),
                             reason=_vocabulary(FailReason if r["status"] == "failed" else RejectReason, r["reason"]),
                             error_type=r["error_type"], error_message=r["error_message"],
                             member_errors=tuple(tuple(m) for m in r["member_errors"]), data=r["data"],
                             elapsed_s=r["elapsed_s"]) for r in state["results"]]
    wf = engine._resolve(workflow, workflow_kwargs) if pending else None
    load_data_position(engine, state.get("data_position"))
    acc = state["accounting"]
    engine._ledger.restored({**acc, "rejected_by_reason": {_vocabulary(RejectReason, k): v for k, v in acc["rejected_by_reason"].items()},
                             "failed_by_reason": {_vocabulary(FailReason, k): v for k, v in acc["failed_by_reason"].items()}},
                            [r.task_id for r in results], int(state["next_task_id"]))
    for result in results:
        engine._buffer.deposit(result)
    version = int(state["version"])
    engine.restore(version)  # sets the version and re-checks the staleness of the restored results
    engine._admission.staleness.accepted = version * engine.config.consumer_batch_size + engine._buffer.accepted_results
    return [engine.submit(p["data"], wf, should_accept_fn=should_accept_fn, group_size=int(p["group_size"]),
                          task_id=int(p["task_id"])) for p in pending]

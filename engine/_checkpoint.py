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
      "deferred": [data, ...],             # only when scheduling="tail_batching" holds prompts
    }                                      # for a long round (engine._scheduling)

On load, the staleness counter follows AReaL's restore (``accepted = version *
B``, :meth:`engine.staleness.StalenessManager.restore`; AReaL issue #1388) plus
the accepted results put back in the buffer, which the trainer has not consumed
yet and which AReaL would have lost.  Pending episodes are re-submitted (their
generation starts over: partial tokens are not kept) with their task ids.
Results and pending episodes are counted once: lifetime ``submitted`` becomes the
ended count, plus one per re-submitted episode.

A sharded engine (:class:`engine.shards.ShardedRolloutEngine`) saves and loads this
same state through this codec (its coordinator holds the queue, the running episodes,
the buffer and the accounting; the token and reward counters are read from
``statistics()``, which sums them over the shards), so a state saved by either kind of
engine loads into the other.
"""

from __future__ import annotations

from typing import Any

from ._admission import Admission
from ._batches import BatchPipeline
from ._config import EngineConfig
from ._ledger import Ledger
from ._records import EngineCalls, EngineStatistics, EpisodeResult, EpisodeStatus, FailReason, RejectReason
from .buffer import ResultBuffer

__all__ = ["FORMAT", "EngineCheckpoint"]

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


def _vocabulary(kind: Any, value: Any) -> Any:
    """``value`` as the member of ``kind`` (a str enum such as ``RejectReason``) it
    names, as the engine records it before a save; unchanged if it names none (a
    custom reason) or is None.  (The state holds plain strings: ``weights_only``.)"""
    try:
        return value if value is None else kind(value)
    except ValueError:
        return value


class EngineCheckpoint:
    """The codec between an engine's parts and its state (format :data:`FORMAT`).

    Args:
        config: the engine's settings (``consumer_batch_size``: the restored staleness counter).
        ledger, admission, buffer, batches: the parts saved and loaded (accounting and task
            ids; version, queue, running episodes and staleness counter; unconsumed
            results; the data position).
        calls: the engine's ``resolve``, ``restore`` and ``submit`` (pending episodes are
            re-submitted through it).
    """

    def __init__(self, config: EngineConfig, ledger: Ledger, admission: Admission, buffer: ResultBuffer,
                 batches: BatchPipeline, calls: EngineCalls) -> None:
        self._config = config
        self._ledger = ledger
        self._admission = admission
        self._buffer = buffer
        self._batches = batches
        self._calls = calls

    def state(self, stats: EngineStatistics) -> dict[str, Any]:
        """See :meth:`engine.RolloutEngine.state_dict`; ``stats`` is the engine's
        ``statistics()`` (a sharded engine's counters: sums over its shards)."""
        ledger, admission = self._ledger, self._admission
        counts = ledger.counts
        pending = sorted([*admission.queue, *admission.running.values()], key=lambda t: t.task_id)
        return {
            "format": FORMAT,
            "version": int(admission.version),
            "staleness_accepted": int(admission.staleness.accepted),
            "accounting": {
                "accepted": counts["accepted"], "rejected": counts["rejected"], "failed": counts["failed"],
                "rejected_by_reason": {str(k): v for k, v in ledger.rejected_by.items() if v},
                "failed_by_reason": {str(k): v for k, v in ledger.failed_by.items() if v},
                "generated_tokens": stats.generated_tokens, "segments_resumed": stats.segments_resumed,
                "reward_fallbacks": stats.reward_fallbacks,
            },
            # plain strings, not the status/reason enums: a checkpoint loads with torch.load(weights_only=True)
            "results": [{"task_id": r.task_id, "status": str(r.status), "trajectory": _plain_trajectory(r.trajectory),
                         "reason": None if r.reason is None else str(r.reason), "error_type": r.error_type,
                         "error_message": r.error_message, "member_errors": [list(m) for m in r.member_errors],
                         "data": r.data, "elapsed_s": r.elapsed_s}
                        for r in self._buffer.results()],
            "pending": [{"task_id": t.task_id, "data": t.data, "group_size": t.group_size} for t in pending],
            "next_task_id": ledger.next_id,
            "data_position": self._batches.position(),
            **({"deferred": deferred} if (deferred := admission.policy.deferred_state()) else {}),
        }

    def check_loadable(self, state: Any, workflow: Any) -> None:
        """The checks :meth:`load` makes before it changes anything.

        Raises:
            ValueError: ``state`` is not format :data:`FORMAT`, the engine has submitted
                episodes, or ``state`` holds pending episodes and ``workflow`` is None.
        """
        if not isinstance(state, dict) or state.get("format") != FORMAT:
            found = state.get("format") if isinstance(state, dict) else type(state).__name__
            raise ValueError(f"load_state_dict: unknown state format {found!r} (expected {FORMAT})")
        submitted = self._ledger.counts["submitted"]
        if submitted:
            raise ValueError(f"load_state_dict needs a fresh engine; this one has submitted {submitted} episodes")
        pending = state["pending"]
        if pending and workflow is None:
            raise ValueError(f"load_state_dict: the state holds {len(pending)} queued or running episodes; pass the "
                             "workflow to re-submit them")

    def load(self, state: dict[str, Any], workflow: Any, workflow_kwargs: dict[str, Any] | None,
             should_accept_fn: Any) -> list[int]:
        """See :meth:`engine.RolloutEngine.load_state_dict`."""
        self.check_loadable(state, workflow)
        pending = state["pending"]
        results = [EpisodeResult(r["task_id"], _vocabulary(EpisodeStatus, r["status"]),
                                 trajectory=_trajectory(r["trajectory"]),
                                 reason=_vocabulary(FailReason if r["status"] == "failed" else RejectReason, r["reason"]),
                                 error_type=r["error_type"], error_message=r["error_message"],
                                 member_errors=tuple(tuple(m) for m in r["member_errors"]), data=r["data"],
                                 elapsed_s=r["elapsed_s"]) for r in state["results"]]
        wf = self._calls.resolve(workflow, workflow_kwargs) if pending else None
        position = state.get("data_position")
        if position is not None and not (isinstance(position, dict) and {"epoch", "position"} <= position.keys()):
            raise ValueError(f"load_state_dict: data_position must be a DataStream state, got {position!r}")
        self._admission.policy.load_deferred(list(state.get("deferred", [])))  # (raises before anything is loaded)
        self._batches.restored_position = position  # the next prepare_batch's DataStream continues there
        acc = state["accounting"]
        self._ledger.restored(acc, rejected_by={_vocabulary(RejectReason, k): v for k, v in acc["rejected_by_reason"].items()},
                              failed_by={_vocabulary(FailReason, k): v for k, v in acc["failed_by_reason"].items()},
                              task_ids=[r.task_id for r in results], next_id=int(state["next_task_id"]))
        for result in results:
            self._buffer.deposit(result)
        version = int(state["version"])
        self._calls.restore(version)  # sets the version and re-checks the staleness of the restored results
        self._admission.staleness.accepted = version * self._config.consumer_batch_size + self._buffer.accepted_results
        return [self._calls.submit(p["data"], wf, should_accept_fn=should_accept_fn, group_size=int(p["group_size"]),
                                   task_id=int(p["task_id"])) for p in pending]

"""One episode, from the workflow's members to an ``EpisodeResult``: run the group's
members (each with its sample index), collect reward fallbacks and drift events,
classify the outcome (accepted, rejected, failed with a reason), finish the group
(``group_id``, ``group_size``, reward normalization), run the filter under its
deadline (the staleness policy is admission's: :mod:`engine._admission`).  A part of the
engine (:class:`engine.executor.RolloutEngine`), which awaits :meth:`Episodes.result` in
each episode task."""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable
from typing import Any, cast

import torch
import trio
from tensordict import TensorDict

from rewards import RewardOutcome, swap_reward_outcome_collector

from ._admission import Admission
from ._breaker import FailureLog
from ._config import EngineConfig
from ._ledger import Ledger
from ._records import EpisodeResult, EpisodeStatus, FailReason, RejectReason, Task, failed_result, leaf_exception, raised_at, sample_index
from .chat._delta import close_drift_sink, open_drift_sink
from .data import concat_padded_tensors
from .errors import EpisodeTimeoutError, failure_reason
from .trajectory import _copy_with
from .workflow import EpisodeEngine

__all__ = ["Episodes"]


class Episodes:
    """Runs one engine's episodes: each ``result(task)`` is the coroutine an episode task
    awaits.

    Args:
        engine: what each workflow's ``arun_episode`` gets (:class:`~engine.workflow.EpisodeEngine`:
            the :class:`~engine.executor.RolloutEngine` that composes this part).
        config: the engine's settings (``episode_timeout_s``, ``drop_incomplete_group``,
            ``reward_normalization``, ``staleness_policy``, ``max_head_offpolicyness``,
            ``should_accept_timeout_s``).
        admission: read to tell closing from a workflow bug (``closed``).
        ledger: counts each member's reward fallbacks and drift events.
        failure_log: the rate-limited log of failed members.
    """

    def __init__(self, engine: EpisodeEngine, config: EngineConfig, admission: Admission, ledger: Ledger,
                 failure_log: FailureLog) -> None:
        self._engine = engine
        self._config = config
        self._admission = admission
        self._ledger = ledger
        self._failure_log = failure_log

    def result(self, task: Task) -> Awaitable[EpisodeResult]:
        """The episode's coroutine: its members, then :meth:`conclude`.  A group of one is its
        member's own coroutine, run in the episode task's context, which concludes the episode
        itself: no frame around the member stays alive for the episode (see :meth:`_member`).
        With ``episode_timeout_s`` set, it runs under that deadline (:meth:`_timed`)."""
        if task.group_size == 1:
            episode = cast("Awaitable[EpisodeResult]", self._member(task, 0, None, {}))  # outcomes None: a result
        else:
            episode = self._group(task)
        timeout_s = self._config.episode_timeout_s
        return episode if timeout_s is None else self._timed(task, episode, timeout_s)

    async def _timed(self, task: Task, episode: Awaitable[EpisodeResult], timeout_s: float) -> EpisodeResult:
        """``episode`` under its deadline; past it, cancelled and failed ``"episode_timeout"``."""
        with trio.move_on_after(timeout_s):
            return await episode
        exc = EpisodeTimeoutError(f"episode {task.task_id} ran past episode_timeout_s={timeout_s} s and was cancelled")
        self._failure_log.failed(FailReason.EPISODE_TIMEOUT, f"episode {task.task_id} failed: {type(exc).__name__}: {exc}",
                                 trio.current_time())
        return failed_result(task, exc)

    async def _group(self, task: Task) -> EpisodeResult:
        outcomes: list[Any] = [None] * task.group_size
        interaction_rewards: dict[int, float | None] = {}  # member -> episode reward, for interaction dicts
        async with trio.open_nursery() as nursery:  # cancelling the group cancels all members
            for i in range(task.group_size):
                nursery.start_soon(self._member, task, i, outcomes, interaction_rewards)
        return await self.conclude(task, outcomes, interaction_rewards)

    async def conclude(self, task: Task, outcomes: list[Any],
                       interaction_rewards: dict[int, float | None]) -> EpisodeResult:
        """Classify the members' ``outcomes`` (trajectory, exception or None, by sample index) into
        the episode's result: finish the group, run the filter."""
        trajs, errors, rejected = [], [], 0
        for i, out in enumerate(outcomes):
            if isinstance(out, BaseException):
                errors.append((i, out))
            elif out is None:
                rejected += 1
            elif not isinstance(out, TensorDict) or out.batch_dims != 1:
                errors.append((i, TypeError(f"arun_episode returned {type(out).__name__}, expected a "
                                            "TensorDict with batch size [B], a dict of interactions or None")))
            elif out.batch_size[0] == 0:
                errors.append((i, ValueError("arun_episode returned a TensorDict with 0 rows (batch size [0]); "
                                             "return None to reject an episode")))
            else:
                trajs.append(out)
        for i, exc in errors:
            if self._admission.closed and isinstance(exc, trio.ClosedResourceError):
                continue
            self._failure_log.failed(failure_reason(exc), f"episode {task.task_id} sample {i} failed: "
                                     f"{type(exc).__name__}: {exc}{raised_at(exc)}", trio.current_time())
        if not trajs:
            if errors:
                exc = errors[0][1]
                if self._admission.closed and isinstance(exc, trio.ClosedResourceError):  # closing, not a workflow bug
                    return failed_result(task, exc, reason=FailReason.CANCELLED)
                return failed_result(task, exc)
            return EpisodeResult(task.task_id, EpisodeStatus.REJECTED, reason=RejectReason.WORKFLOW_RETURNED_NONE, data=task.data)
        complete = not errors and not rejected
        if not complete and self._config.drop_incomplete_group:
            return EpisodeResult(task.task_id, EpisodeStatus.REJECTED, reason=RejectReason.INCOMPLETE_GROUP, data=task.data)
        if self._config.reward_normalization and complete and None in interaction_rewards.values():
            return EpisodeResult(task.task_id, EpisodeStatus.REJECTED, reason=RejectReason.MISSING_REWARD, data=task.data,
                                 error_message="reward normalization: a sample's last interaction has no reward")
        try:
            traj = self.finish_group(task, trajs, complete, interaction_rewards)
        except ValueError as exc:  # members with different key sets/dtypes
            return failed_result(task, exc, reason=FailReason.WORKFLOW_ERROR)
        member_errors = tuple((i, failure_reason(e).value, type(e).__name__, str(e)) for i, e in errors)
        if task.should_accept_fn is not None:
            reason, filter_exc = await self.run_filter(task.should_accept_fn, traj)
            if reason is not None:
                return EpisodeResult(task.task_id, EpisodeStatus.REJECTED, reason=reason, data=task.data,
                                     error_type=type(filter_exc).__name__ if filter_exc else None,
                                     error_message=str(filter_exc) if filter_exc else None)
        return EpisodeResult(task.task_id, EpisodeStatus.ACCEPTED, trajectory=traj, data=task.data, member_errors=member_errors)

    async def _member(self, task: Task, i: int, outcomes: list[Any] | None,
                      interaction_rewards: dict[int, float | None]) -> EpisodeResult | None:
        """Run group member ``i`` (its own task, or the episode's when the group has one
        member) and leave its trajectory or exception in ``outcomes[i]``; with ``outcomes``
        None (a group of one) conclude the episode and return its result.

        Collects the member's reward outcomes and drift events like
        ``rewards.collect_reward_outcomes()`` / ``engine.chat.collect_drift_events()``
        do, with the context variables set and restored here: no context-manager,
        generator, token or closure objects live for the episode's whole run (each one that
        outlives two young GC passes is promoted, and promotions are what trigger
        the full collections; see benchmarks/README.md).  For the same reason one list
        collects both: the reward outcomes and the drift events (``str``)."""
        sample_index.set(i)  # task-local: each member runs in its own task (or context)
        collected: list[Any] = []  # RewardOutcome records and drift events
        outer_scored = swap_reward_outcome_collector(collected)  # restored below by value: no Token object lives
        outer_sinks = open_drift_sink(collected)
        try:
            out = await task.workflow.arun_episode(self._engine, task.data)
            if isinstance(out, dict):  # AReaL's third return type: dict[id, Interaction] (engine.openai)
                from .openai.interaction import trajectory_from_interactions

                out, interaction_rewards[i] = trajectory_from_interactions(out)
        except Exception as exc:
            out = leaf_exception(exc)
        finally:
            close_drift_sink(outer_sinks)
            swap_reward_outcome_collector(outer_scored)  # the successor task inherits this context: leave it as found
        if collected:
            scored = [o for o in collected if isinstance(o, RewardOutcome)]
            self._ledger.reward_fallbacks += sum(o.is_fallback for o in scored)
            self._ledger.retokenization_drifts += len(collected) - len(scored)
        if outcomes is None:
            return await self.conclude(task, [out], interaction_rewards)
        outcomes[i] = out
        return None

    def finish_group(self, task: Task, trajs: list[TensorDict], complete: bool,
                     interaction_rewards: dict[int, float | None]) -> TensorDict:
        traj = trajs[0] if len(trajs) == 1 else concat_padded_tensors(trajs)
        rows = traj.batch_size[0]
        traj = _copy_with(traj, {"group_id": torch.full((rows,), task.task_id, dtype=torch.int64),  # [B]
                                 "group_size": torch.full((rows,), rows, dtype=torch.int32)})  # [B]
        if self._config.reward_normalization and "rewards" in traj.keys():
            raw = traj["rewards"]  # [B] float32
            traj["original_rewards"] = raw.clone()
            if complete and interaction_rewards:  # AReaL: one reward per member, its last interaction's
                from .openai.interaction import group_normalized_rewards

                traj["rewards"] = group_normalized_rewards(
                    [t.batch_size[0] for t in trajs],
                    [_or(interaction_rewards.get(i), float(t["rewards"][-1])) for i, t in enumerate(trajs)])
            elif complete:  # AReaL: population std + 1e-8
                traj["rewards"] = (raw - raw.mean()) / (raw.std(unbiased=False) + 1e-8)
        if self._config.staleness_policy == "flag" and self._config.max_head_offpolicyness is not None:
            traj["is_stale"] = torch.zeros(rows, dtype=torch.bool)  # [B]
        return traj

    async def run_filter(self, fn: Callable[..., Any], traj: TensorDict) -> tuple[str | None, Exception | None]:
        """Run ``should_accept_fn`` under its deadline -> (rejection reason or None, error)."""
        with trio.move_on_after(self._config.should_accept_timeout_s) as scope:
            try:
                if inspect.iscoroutinefunction(fn):
                    ok = await fn(traj)
                else:
                    ok = await trio.to_thread.run_sync(fn, traj, abandon_on_cancel=True)
            except Exception as exc:
                return RejectReason.FILTER_ERROR, exc
        if scope.cancelled_caught:
            return RejectReason.FILTER_TIMEOUT, None
        return (None, None) if ok else (RejectReason.FILTERED, None)


def _or(value: float | None, default: float) -> float:
    return default if value is None else value

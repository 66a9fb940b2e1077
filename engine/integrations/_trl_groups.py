"""The episodes of one ``rollout_func`` call: one group per prompt block, re-run until
each has its completions (or a sample has used its attempts), then one error or none.

Why re-run rather than drop: TRL lines rewards up with completions by position and
normalises them over consecutive blocks of ``num_generations``; a dropped sample would
shift every later row onto the wrong prompt.  A re-run sample of the same prompt, under
the same weights, is as good a member of its group as the one it replaces.

What is not re-run: a sample that failed ``reward_error`` (:data:`FINAL_REASONS`).  The
reward pool owns reward retries (``EngineConfig.reward_max_retries``, AReaL's policy); a
re-run here would multiply them (a reward that always raises ran 3 x 4 = 12 times per
sample, a new-user trial), so the call raises at once, naming the pool's attempt count.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from ..errors import InvalidRequestError, RolloutError
from ._trl_engine import BlockingEngine
from ._trl_rows import completion_columns, is_conversational

__all__ = ["FINAL_REASONS", "Episodes", "Group", "IncompleteBatchError"]

#: Failure reasons the adapter does not run again: the layer below already retried them
#: (the reward pool, under ``EngineConfig.reward_max_retries``).
FINAL_REASONS = frozenset({"reward_error"})


class IncompleteBatchError(RolloutError):
    """A prompt of a ``rollout_func`` call did not get all its completions within
    ``max_attempts`` attempts per sample, or a sample failed for a reason that is not run
    again (:data:`FINAL_REASONS`); the message names the prompt and the last reason."""


@dataclass(eq=False)
class Group:
    """One prompt block of a call: its episode data and the completions it has."""

    prompt: Any
    data: dict[str, Any]
    size: int
    rows: list[dict[str, Any]] = field(default_factory=list)
    attempts: int = 1
    failure: str | None = None
    exhausted: bool = False
    final: bool = False  # exhausted by a failure of FINAL_REASONS (not by max_attempts)
    pending: list[tuple[int, int]] = field(default_factory=list)  # (task id, samples asked)


def why(result: Any) -> str:
    """One line: why an episode gave fewer rows than asked."""
    if result.status != "accepted":
        detail = f": {result.error_type}: {result.error_message}" if result.error_type else ""
        return f"{result.status} ({result.reason}){detail}".replace("\n", " ")
    if result.member_errors:
        _, reason, etype, message = result.member_errors[0]
        return f"failed ({reason}): {etype}: {message}".replace("\n", " ")
    return "rejected (workflow_returned_none)"


def is_final(result: Any) -> bool:
    """Whether a missing sample of ``result`` failed for one of :data:`FINAL_REASONS`."""
    if result.status == "failed":
        return str(result.reason) in FINAL_REASONS
    return any(str(reason) in FINAL_REASONS for _, reason, _, _ in result.member_errors)


def excerpt(prompt: Any, width: int = 60) -> str:
    """The prompt's (last message's) text, shortened, quoted."""
    text = prompt[-1].get("content", "") if is_conversational(prompt) else prompt
    text = " ".join(str(text).split())
    return repr(text if len(text) <= width else text[: width - 3] + "...")


class Episodes:
    """Submits groups to the engine and collects them (see the module docstring)."""

    def __init__(self, engine: BlockingEngine, workflow: Any, should_accept_fn: Any) -> None:
        self.engine = engine
        self.workflow = workflow
        self.should_accept_fn = should_accept_fn
        self.reruns = 0  # samples run again

    def submit(self, g: Group, count: int) -> None:
        task_id = self.engine.submit(dict(g.data), self.workflow, workflow_kwargs=None,
                                     should_accept_fn=self.should_accept_fn, group_size=count)
        g.pending.append((task_id, count))

    def collect(self, groups: list[Group], *, deadline: float, max_attempts: int, call_timeout_s: float) -> None:
        """Wait for every group's episodes (``deadline``: ``time.monotonic()`` seconds),
        re-running missing samples; once all ended, raise for the first exhausted group.

        Raises:
            IncompleteBatchError: a group lacks completions after ``max_attempts``, or a
                sample failed for one of :data:`FINAL_REASONS`.
            InvalidRequestError: an episode returned more rows than samples asked.
            TimeoutError: ``deadline`` passed (the episodes still running stay in the engine).
        """
        queue = deque(g for g in groups if g.pending)
        while queue:
            g = queue.popleft()
            task_id, asked = g.pending.pop(0)
            try:
                result = self.engine.wait_for_task(task_id, max(deadline - time.monotonic(), 0.0))
            except TimeoutError as exc:
                running = sum(len(x.pending) for x in groups) + 1
                raise TimeoutError(f"rollout_func: call_timeout_s={call_timeout_s} passed with {running} "
                                   f"episode(s) still running ({exc})") from None
            got = completion_columns(result.trajectory) if result.status == "accepted" else []
            if len(got) > asked:
                raise InvalidRequestError(
                    f"rollout_func: an episode of group_size {asked} returned {len(got)} rows; TRL needs one "
                    "completion per sample: make the workflow return one row per episode")
            g.rows += got
            missing = asked - len(got)
            if missing:
                g.failure = why(result)
                if is_final(result):  # retried below us already: not again
                    g.exhausted = g.final = True
                elif g.attempts >= max_attempts:
                    g.exhausted = True
                else:
                    g.attempts += 1
                    self.reruns += missing
                    self.submit(g, missing)
            if g.pending:
                queue.append(g)
        for i, g in enumerate(groups):
            if g.final:
                raise IncompleteBatchError(
                    f"rollout_func: prompt {i} ({excerpt(g.prompt)}) got {len(g.rows)} of {g.size} completions; "
                    f"{g.failure}; not run again: the reward pool owns reward retries "
                    "(EngineConfig.reward_max_retries): fix the reward function")
            if g.exhausted:
                raise IncompleteBatchError(
                    f"rollout_func: prompt {i} ({excerpt(g.prompt)}) got {len(g.rows)} of {g.size} completions in "
                    f"{max_attempts} attempt(s); last: {g.failure}; fix the cause or raise "
                    "TRLRolloutConfig(max_attempts=...)")

    def drop(self, groups: list[Group], timeout_s: float) -> None:
        """Wait for the groups' episodes and throw their results away."""
        for g in groups:
            while g.pending:
                task_id, _ = g.pending.pop(0)
                self.engine.wait_for_task(task_id, timeout_s)

"""Test doubles: stand-ins for the backend and the reward pool.

* :class:`~engine.backends.base.MockBackend` (re-exported): an async function as a backend.
* :class:`InProcessRewardPool`: a reward pool that calls the reward function in-process,
  on the caller's task (no workers, no timeouts, no retries).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from engine.backends.base import MockBackend

__all__ = ["InProcessRewardPool", "MockBackend"]


class InProcessRewardPool:
    """A reward pool stand-in for unit tests (``open_rollout_engine(..., reward_pool=)``):
    :meth:`score` calls ``reward_fn`` in-process, synchronously.

    Attributes:
        calls: :meth:`score` calls so far.
    """

    def __init__(self) -> None:
        self.calls = 0

    async def score(self, reward_fn: Callable[..., Any], prompt: Any, completions: Any, prompt_ids: Any,
                    completion_ids: Any, /, **data: Any) -> Any:
        """``RewardOutcome(reward=float(reward_fn(...)), is_fallback=False, attempts=1,
        latency_s=0.0)``; whatever ``reward_fn`` raises propagates."""
        from rewards import RewardOutcome

        self.calls += 1
        value = reward_fn(prompt, completions, prompt_ids, completion_ids, **data)
        return RewardOutcome(reward=float(value), is_fallback=False, attempts=1, latency_s=0.0)

    def statistics(self) -> dict[str, int]:
        """``{"calls": n}``."""
        return {"calls": self.calls}

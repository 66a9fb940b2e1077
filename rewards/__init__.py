"""Reward functions and the killable reward worker pool.

Public names are exported lazily (module ``__getattr__``): reward worker
processes unpickle ``rewards.math.gsm8k_reward`` and ``rewards._worker.run_job``,
which imports this package first, and they should not pay for trio,
trio-parallel or the engine.  Nothing here imports torch or transformers.

- :func:`open_reward_pool` / :class:`RewardPool`: timeout, retry, fallback and
  kill policy (AReaL ``AsyncRewardWrapper``, ``areal/api/reward_api.py``).
- :func:`gsm8k_reward`, :func:`extract_answer`: GSM8K answer checking.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__all__ = [
    "RewardOutcome",
    "RewardPool",
    "RewardPoolStatistics",
    "extract_answer",
    "gsm8k_reward",
    "open_reward_pool",
]

_LAZY = {
    "RewardOutcome": "rewards._pool",
    "RewardPool": "rewards._pool",
    "RewardPoolStatistics": "rewards._pool",
    "extract_answer": "rewards.math",
    "gsm8k_reward": "rewards.math",
    "open_reward_pool": "rewards._pool",
}

if TYPE_CHECKING:
    from ._pool import RewardOutcome, RewardPool, RewardPoolStatistics, open_reward_pool
    from .math import extract_answer, gsm8k_reward


def __getattr__(name: str) -> Any:
    try:
        module = _LAZY[name]
    except KeyError:
        raise AttributeError(f"module 'rewards' has no attribute {name!r}") from None
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))

"""Reward functions, stateful reward actors and the killable reward worker pool.

Public names are exported lazily (module ``__getattr__``): reward worker
processes unpickle ``rewards.gsm8k.gsm8k_reward`` and ``rewards._worker.run_job``,
which imports this package first, and they should not pay for trio,
trio-parallel or the engine.  Nothing here imports torch or transformers.

- :func:`open_reward_pool` / :class:`RewardPool`: timeout, retry, fallback and
  kill policy (AReaL ``AsyncRewardWrapper``, ``areal/api/reward_api.py``),
  optional micro-batching, settings in one frozen :class:`RewardPoolOptions`;
  :func:`current_reward_pool`,
  :func:`collect_reward_outcomes` (per-episode fallback flag).
- :class:`RewardActor`: ``setup()`` once per worker process, then calls.
- :func:`open_ray_reward_pool`: the same pool with Ray actors as
  workers (``EngineConfig(reward_backend="ray")``; the ``ray`` extra).
- :class:`AsyncRewardWrapper`: AReaL's awaitable wrapper on our pool.
- :class:`TokenText` / :func:`tokenizer_file`: text sent as token ids and decoded
  where the reward runs (``rewards._text``).
- Built-in rewards: :func:`gsm8k_reward` (``rewards.gsm8k``), :func:`math_reward`
  (``rewards.math``, math-verify), :func:`format_reward` / :func:`weighted_sum`
  (``rewards.format``), :func:`code_reward` (``rewards.code``),
  :func:`exact_match_reward` (``rewards.exact_match``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

__all__ = [
    "AsyncRewardWrapper",
    "RewardActor",
    "RewardOutcome",
    "RewardPool",
    "RewardPoolOptions",
    "RewardPoolStatistics",
    "TokenText",
    "code_reward",
    "collect_reward_outcomes",
    "current_reward_pool",
    "exact_match_reward",
    "extract_answer",
    "format_reward",
    "gsm8k_reward",
    "math_reward",
    "open_ray_reward_pool",
    "open_reward_pool",
    "rust_tokenizer",
    "swap_reward_outcome_collector",
    "tokenizer_file",
    "weighted_sum",
]

_LAZY = {
    "AsyncRewardWrapper": "rewards._wrapper",
    "RewardActor": "rewards._actor",
    "RewardOutcome": "rewards._stats",
    "RewardPool": "rewards._pool",
    "RewardPoolOptions": "rewards._options",
    "RewardPoolStatistics": "rewards._stats",
    "TokenText": "rewards._worker",
    "code_reward": "rewards.code",
    "collect_reward_outcomes": "rewards._context",
    "swap_reward_outcome_collector": "rewards._context",
    "current_reward_pool": "rewards._pool",
    "exact_match_reward": "rewards.exact_match",
    "extract_answer": "rewards.gsm8k",
    "format_reward": "rewards.format",
    "gsm8k_reward": "rewards.gsm8k",
    "math_reward": "rewards.math",
    "open_ray_reward_pool": "rewards._ray_pool",
    "open_reward_pool": "rewards._pool",
    "rust_tokenizer": "rewards._text",
    "tokenizer_file": "rewards._text",
    "weighted_sum": "rewards.format",
}

if TYPE_CHECKING:
    from ._actor import RewardActor
    from ._context import collect_reward_outcomes, swap_reward_outcome_collector
    from ._options import RewardPoolOptions
    from ._pool import RewardPool, current_reward_pool, open_reward_pool
    from ._stats import RewardOutcome, RewardPoolStatistics
    from ._text import rust_tokenizer, tokenizer_file
    from ._worker import TokenText
    from ._wrapper import AsyncRewardWrapper
    from .code import code_reward
    from .exact_match import exact_match_reward
    from .format import format_reward, weighted_sum
    from .gsm8k import extract_answer, gsm8k_reward
    from .math import math_reward


from engine.lazy import lazy_exports  # noqa: E402

__getattr__, __dir__ = lazy_exports(globals(), _LAZY)

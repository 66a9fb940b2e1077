"""``EngineReward``: a torchrl env transform that scores in the engine's reward pool.

Imports torchrl (0.14.1); reached through :mod:`engine.integrations.torchrl`.

Where torchrl scores (0.14.1): a ``Transform`` on the env whose ``_step(tensordict,
next_tensordict)`` reads the policy's response from ``tensordict`` and writes ``reward``
(and maybe ``done``) into ``next_tensordict``, e.g. ``envs/llm/reward/gsm8k.py``
(``GSM8KRewardParser``).  This transform does the same, but each row's reward runs in the
engine's reward pool (``engine.reward_pool.score``): sync rewards in killable worker
processes, a per-attempt timeout that kills the worker, retries, a flagged fallback after
the last timeout (the CONTRACTS.md reward policy); all rows of a step at once, in order.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from tensordict import NonTensorStack, TensorDictBase
from torchrl.data import Composite, Unbounded
from torchrl.envs import Transform

from ..imports import resolve_reward_fn
from ._torchrl_bridge import Bridge, TorchRLConfig, score_rows

__all__ = ["EngineReward", "EngineRewardStatistics"]


@dataclass(frozen=True)
class EngineRewardStatistics:
    """A snapshot of an :class:`EngineReward`: ``steps`` scored, ``rows`` scored,
    ``fallbacks`` (rows whose every attempt timed out: reward is the pool's fallback),
    ``wait_s`` (seconds the env step spent scoring)."""

    steps: int
    rows: int
    fallbacks: int
    wait_s: float


class EngineReward(Transform):
    """Score each env step's responses with ``reward_fn`` in the engine's reward pool.

    ``reward_fn(prompt, completions, prompt_ids, completion_ids, **data) -> float`` (the
    engine's reward signature, CONTRACTS.md) is called once per row with: ``prompt`` and
    ``completions`` the row's ``text.prompt`` / ``text.response`` (decoded from the tokens
    in ``input_mode="tokens"``), ``prompt_ids`` / ``completion_ids`` its ``tokens.prompt``
    / ``tokens.response`` (``list[int]``), and ``data`` the row's ``data_keys`` entries
    (e.g. the dataset's ``answer``), read from the step's input.

    Writes into the step's ``next``: ``reward_key`` (float32, shape ``[*batch, 1]``: the
    env's reward spec) and ``fallback_key`` (bool, same shape: True where the reward is the
    pool's fallback after timeouts); with ``done_on_reward=True`` also ``done`` and
    ``terminated`` (single-turn tasks end once scored).

    Args:
        engine: a :class:`engine.RolloutEngineThread` or a trio-native engine; its reward
            pool runs the rewards (``RolloutEngineThread(..., reward_pool=...)``).
        reward_fn: a callable or an import string (``"rewards.gsm8k:gsm8k_reward"``), resolved
            and checked once here (:func:`engine.resolve_reward_fn`).
        data_keys: entries of the step's tensordict passed to ``reward_fn`` by name.
        config: :class:`~engine.integrations.torchrl.TorchRLConfig` (``call_timeout_s`` bounds a step).

    Raises:
        RewardError: (at construction) ``reward_fn`` cannot be resolved or pickled; (from a
            step) a row's reward raised on its last attempt, returned a non-finite value, or
            its worker died every time; the message names the function.
        TimeoutError: (from a step) ``config.call_timeout_s`` passed.
    """

    def __init__(self, engine: Any, reward_fn: Any, *, data_keys: Sequence[str] = (), reward_key: str = "reward",
                 fallback_key: str = "reward_fallback", done_on_reward: bool = False, text_key: str = "text",
                 tokens_key: str = "tokens", tokenizer: Any = None, config: TorchRLConfig | None = None) -> None:
        super().__init__(in_keys=[], out_keys=[reward_key, fallback_key])
        self.engine = engine
        self.reward_fn = resolve_reward_fn(reward_fn)
        self.data_keys = tuple(data_keys)
        self.reward_key, self.fallback_key = reward_key, fallback_key
        self.done_on_reward = done_on_reward
        self.text_key, self.tokens_key = text_key, tokens_key
        self.tokenizer = tokenizer
        self.config = config or TorchRLConfig()
        self._bridge = Bridge(engine)
        self._stats: dict[str, Any] = {"steps": 0, "rows": 0, "fallbacks": 0, "wait_s": 0.0}

    def _step(self, tensordict: TensorDictBase, next_tensordict: TensorDictBase) -> TensorDictBase:
        if next_tensordict.batch_dims > 1:
            with tensordict.view(-1) as td_flat, next_tensordict.view(-1) as next_flat:
                self._step(td_flat, next_flat)
            return next_tensordict
        rows = self._rows(tensordict, next_tensordict)
        start = time.perf_counter()
        try:
            outcomes = self._bridge.run(score_rows, self.reward_fn, rows, timeout_s=self.config.call_timeout_s)
        finally:
            self._stats["wait_s"] += time.perf_counter() - start
        shape = (*next_tensordict.batch_size, 1)
        reward = torch.tensor([float(o.reward) for o in outcomes], dtype=torch.float32).reshape(shape)
        fallback = torch.tensor([bool(o.is_fallback) for o in outcomes], dtype=torch.bool).reshape(shape)
        next_tensordict.set(self.reward_key, reward)
        next_tensordict.set(self.fallback_key, fallback)
        if self.done_on_reward:
            for key in ("done", "terminated"):
                old = next_tensordict.get(key, None)
                new = torch.ones(shape, dtype=torch.bool)
                next_tensordict.set(key, new if old is None else new.view_as(old) | old)
        self._stats["steps"] += 1
        self._stats["rows"] += len(outcomes)
        self._stats["fallbacks"] += int(fallback.sum())
        return next_tensordict

    def _rows(self, td: Any, next_td: Any) -> list[tuple[tuple[Any, ...], dict[str, Any]]]:
        """``((prompt, completions, prompt_ids, completion_ids), data)`` per row (``td``: a
        TensorDict; ``Any`` because its ``get(..., as_list=True)`` is not in its type stubs)."""
        n = td.batch_size[0] if td.batch_dims else 1
        prompt_ids = _ids(td.get((self.tokens_key, "prompt"), None, as_list=True), n, "prompt")
        completion_ids = _ids(td.get((self.tokens_key, "response"), None, as_list=True), n, "response")
        prompts = _texts(td.get((self.text_key, "prompt"), None))
        completions = _texts(td.get((self.text_key, "response"), None))
        if prompts is None or completions is None:  # tokens mode: torchrl has no text
            tok = self._tokenizer()
            prompts = prompts or tok.batch_decode(prompt_ids, skip_special_tokens=False)
            completions = completions or tok.batch_decode(completion_ids, skip_special_tokens=False)
        data: list[dict[str, Any]] = [{} for _ in range(n)]
        for key in self.data_keys:
            values = td.get(key, None)
            if values is None:
                values = next_td.get(key, None)
            if values is None:
                raise KeyError(f"EngineReward: data key {key!r} is in neither the step's tensordict nor its next "
                               "(add it to the env, e.g. a column of the dataloader)")
            listed = _texts(values)
            for i in range(n):
                data[i][key] = listed[i] if listed is not None else values[i]
        return [((prompts[i], completions[i], prompt_ids[i], completion_ids[i]), data[i]) for i in range(n)]

    def _tokenizer(self) -> Any:
        if self.tokenizer is not None:
            return self.tokenizer
        parent = self.parent
        tok = getattr(getattr(parent, "base_env", None), "tokenizer", None) if parent is not None else None
        if tok is None:
            raise ValueError("EngineReward: the step has no text (input_mode='tokens'): pass tokenizer=")
        return tok

    def transform_reward_spec(self, reward_spec: Composite) -> Composite:
        shape = (*reward_spec.shape, 1)
        reward_spec.update(Composite({self.reward_key: Unbounded(shape, dtype=torch.float32),
                                      self.fallback_key: Unbounded(shape, dtype=torch.bool)}, shape=reward_spec.shape))
        return reward_spec

    def statistics(self) -> EngineRewardStatistics:
        """A frozen snapshot (sync, cheap)."""
        return EngineRewardStatistics(**self._stats)


def _ids(values: Any, n: int, what: str) -> list[list[int]]:
    if values is None:
        raise KeyError(f"EngineReward: the step has no tokens.{what} (is the policy an EngineWrapper or a torchrl "
                       "LLM wrapper?)")
    return [torch.as_tensor(v).reshape(-1).tolist() for v in values]


def _texts(values: Any) -> list[Any] | None:
    if values is None:
        return None
    if isinstance(values, NonTensorStack) or hasattr(values, "tolist"):
        values = values.tolist()
    if isinstance(values, str):
        return [values]
    return list(values)

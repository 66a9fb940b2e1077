"""``sim``: a deterministic simulated inference server, for tests and benchmarks.

Latency model (seconds): a request with ``P`` prompt tokens that produces ``N``
tokens takes ``prefill_s + P * prefill_s_per_token + N * per_token_s`` and its
first token arrives after ``prefill_s + P * prefill_s_per_token + per_token_s``.
Output lengths are drawn from a seeded lognormal distribution with median
``out_len_median`` tokens and shape ``out_len_sigma`` (``0`` = always the
median), capped by the request's token budget.  Token ids are uniform in
``[first_token_id, vocab_size)`` and logprobs uniform in ``[-5, -0.01]``; a
request that finishes before its budget ends with ``eos_token_id`` and stop
reason ``"stop"``, otherwise ``"length"``.

Determinism: a request whose ``gconfig.seed`` is set gets the same output for
the same prompt; otherwise draws come from one RNG seeded with ``seed`` and
advanced in dispatch order (deterministic for a deterministic schedule).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import trio

from ..errors import InvalidRequestError
from ..types import ModelRequest, ModelResponse
from .base import PerRequestBackend

__all__ = ["SimBackend", "SimConfig"]


@dataclass(frozen=True, kw_only=True)
class SimConfig:
    """Parameters of the simulated server (units in the names)."""

    vocab_size: int = 49152
    eos_token_id: int = 2
    first_token_id: int = 3
    prefill_s: float = 0.0
    prefill_s_per_token: float = 0.0
    per_token_s: float = 0.0
    out_len_median: int = 64
    out_len_sigma: float = 0.0
    max_concurrency: int | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("prefill_s", "prefill_s_per_token", "per_token_s", "out_len_sigma"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise InvalidRequestError(f"SimConfig.{name} must be a finite number >= 0, got {value!r}")
        if self.out_len_median < 1:
            raise InvalidRequestError(f"SimConfig.out_len_median must be >= 1, got {self.out_len_median}")
        if not (0 <= self.first_token_id < self.vocab_size):
            raise InvalidRequestError("SimConfig.first_token_id must be in [0, vocab_size)")


class SimBackend(PerRequestBackend):
    """A simulated server; see the module docstring for the model."""

    logprob_semantics = "processed"

    def __init__(self, config: SimConfig | None = None, **overrides) -> None:
        self.config = config or SimConfig(**overrides)
        super().__init__(max_concurrency=self.config.max_concurrency)
        self._rng = random.Random(self.config.seed)

    def _draw(self, request: ModelRequest, budget: int) -> tuple[list[int], list[float], bool]:
        cfg = self.config
        if request.gconfig.seed is not None:
            rng = random.Random(f"{cfg.seed}:{request.gconfig.seed}:{request.input_ids}")
        else:
            rng = random.Random(self._rng.getrandbits(64))
        n = cfg.out_len_median
        if cfg.out_len_sigma > 0:
            n = max(1, round(rng.lognormvariate(math.log(cfg.out_len_median), cfg.out_len_sigma)))
        finished = n < budget
        n = min(n, budget)
        tokens = [rng.randrange(cfg.first_token_id, cfg.vocab_size) for _ in range(n)]
        if finished:
            tokens[-1] = cfg.eos_token_id
        logprobs = [-rng.uniform(0.01, 5.0) for _ in range(n)]
        return tokens, logprobs, finished

    async def generate(self, request: ModelRequest, budget: int) -> ModelResponse:
        cfg = self.config
        version = self.version  # read before the segment is sent (AReaL PR #1569)
        tokens, logprobs, finished = self._draw(request, budget)
        start = trio.current_time()
        prefill = cfg.prefill_s + len(request.input_ids) * cfg.prefill_s_per_token
        await trio.sleep(prefill + len(tokens) * cfg.per_token_s)
        return ModelResponse(
            input_tokens=list(request.input_ids),
            output_tokens=tokens,
            output_logprobs=logprobs,
            output_versions=[version] * len(tokens),
            stop_reason="stop" if finished else "length",
            latency=trio.current_time() - start,
            ttft=prefill + cfg.per_token_s,
        )

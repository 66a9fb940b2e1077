"""The simulated server's per-request draws (:mod:`engine.backends.sim`): standard library only.

Everything that decides *what* a request gets (output length, straggling,
injected failure, where its tokens and logprobs are sliced from) lives here and
imports nothing but the standard library, so that the AReaL peer of the
benchmark harness (``benchmarks/harness/peer_areal.py``, run by the AReaL venv's
interpreter, which has neither trio nor this project's dependencies) makes the
same draws as :class:`~engine.backends.sim.SimBackend` by calling the same code.

The length model: a prompt's difficulty ``d = exp(difficulty_sigma * z)``, ``z ~ N(0, 1)``
drawn once per ``(seed, prompt)`` (:func:`prompt_difficulty`), sets the median length of
its samples to ``out_len_median * d``; each sample's length is lognormal around it with
shape ``out_len_sigma``, capped at the request's budget.  So log-lengths have variance
``difficulty_sigma**2 + out_len_sigma**2`` and the samples of one group share the first
part: their log-lengths correlate with ``difficulty_sigma**2 / (difficulty_sigma**2 +
out_len_sigma**2)`` (Seer, arXiv 2511.14617: requests sharing a prompt have similar
lengths).  With ``difficulty_sigma = 0`` the draws are exactly those of earlier versions.

A request's draws come from one ``random.Random`` (:func:`draw`), seeded by
:func:`prompt_rng` (``SimConfig.draws_by_prompt``: a pure function of seed,
prompt and occurrence), :func:`request_seed_rng` (``gconfig.seed`` set) or the
backend's own RNG in dispatch order.  Token ids and logprobs are slices of two
pools of :data:`POOL_SIZE` entries (:func:`token_pools`, :func:`tile_pool`,
:func:`completion`).
"""

from __future__ import annotations

import hashlib
import math
import random
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

__all__ = [
    "ABORT",
    "ERROR",
    "OK",
    "POOL_SIZE",
    "DrawParams",
    "SimDraw",
    "completion",
    "draw",
    "prompt_difficulty",
    "prompt_key",
    "prompt_rng",
    "request_seed_rng",
    "tile_pool",
    "token_pools",
]

#: Entries of the token and logprob pools (drawn once per backend, sliced per request).
POOL_SIZE = 1 << 16

#: Outcomes of a request: served, failed after its prefill, or half served then aborted.
OK, ERROR, ABORT = "ok", "error", "abort"


class DrawParams(Protocol):
    """The fields of :class:`~engine.backends.sim.SimConfig` that the draws read."""

    @property
    def seed(self) -> int: ...
    @property
    def out_len_median(self) -> int: ...
    @property
    def out_len_sigma(self) -> float: ...
    @property
    def difficulty_sigma(self) -> float: ...
    @property
    def straggler_fraction(self) -> float: ...
    @property
    def straggler_multiplier(self) -> float: ...
    @property
    def error_fraction(self) -> float: ...
    @property
    def abort_fraction(self) -> float: ...


@dataclass(frozen=True)
class SimDraw:
    """What :func:`draw` decided for one request.

    Attributes:
        n: tokens the request produces in all (capped by its budget).
        finished: the completion ends with EOS before the budget.
        offset: where its tokens and logprobs start in the pools.
        multiplier: latency multiplier (``straggler_multiplier`` or 1).
        outcome: :data:`OK`, :data:`ERROR` or :data:`ABORT`.
        key: :func:`prompt_key` of the prompt, when the draw needed it.
        wanted: tokens the completion has before the budget's cap (``>= n``; None:
            a draw that does not say, then taken as ``n``): a request cut by its budget
            continues with the other ``wanted - n`` when the engine sends the next
            segment (:class:`~engine.backends.sim.SimBackend`).
    """

    n: int
    finished: bool
    offset: int
    multiplier: float
    outcome: str
    key: int | None = None
    wanted: int | None = None


def prompt_key(input_ids: Sequence[int]) -> int:
    """A 64-bit key of a token sequence (stable across processes, runs and interpreters)."""
    return int.from_bytes(hashlib.blake2b(array("q", input_ids).tobytes(), digest_size=8).digest(), "little")


def prompt_rng(seed: int, key: int, occurrence: int) -> random.Random:
    """The RNG of the ``occurrence``-th request (0-based) whose prompt has :func:`prompt_key` ``key``."""
    return random.Random((seed * 1_000_003 + occurrence) ^ key)


def prompt_difficulty(seed: int, key: int, sigma: float) -> float:
    """The difficulty ``exp(sigma * z)`` of the prompt whose :func:`prompt_key` is ``key``:
    ``z ~ N(0, 1)`` from an RNG of its own, a pure function of ``(seed, key)`` (the same for
    every sample and occurrence of the prompt, whatever else is drawn); ``sigma`` is
    dimensionless, ``0`` gives ``1.0``.  A prompt's median length is ``out_len_median`` times this."""
    if sigma == 0:
        return 1.0
    return math.exp(sigma * random.Random(f"sim-difficulty:{seed}:{key}").gauss(0.0, 1.0))


def request_seed_rng(seed: int, gconfig_seed: int, input_ids: Sequence[int]) -> random.Random:
    """The RNG of a request that carries ``gconfig.seed``: same seed and prompt, same draws."""
    return random.Random(f"{seed}:{gconfig_seed}:{list(input_ids)}")


def draw(params: DrawParams, rng: random.Random, budget: int, *, key: int | None = None) -> SimDraw:
    """One request's draws from ``rng`` (advanced by exactly the draws made).

    Args:
        params: a :class:`~engine.backends.sim.SimConfig` (or anything with its draw fields).
        rng: the request's RNG (:func:`prompt_rng`, :func:`request_seed_rng`, or a
            backend RNG's child).
        budget: tokens the request may still produce (>= 0).
        key: the prompt's :func:`prompt_key`, carried into :attr:`SimDraw.key`; needed
            when ``params.difficulty_sigma > 0`` (it sets the prompt's difficulty).

    Raises:
        ValueError: ``difficulty_sigma > 0`` and no ``key``.
    """
    median: float = params.out_len_median
    if params.difficulty_sigma > 0:
        if key is None:
            raise ValueError("draw: a per-prompt difficulty (difficulty_sigma > 0) needs the prompt's key")
        median *= prompt_difficulty(params.seed, key, params.difficulty_sigma)
    n = params.out_len_median
    if params.out_len_sigma > 0:
        n = max(1, round(rng.lognormvariate(math.log(median), params.out_len_sigma)))
    elif params.difficulty_sigma > 0:
        n = max(1, round(median))
    u_straggle, u_fail = rng.random(), rng.random()
    finished = n < budget
    wanted = n
    n = max(min(n, budget), 0)
    multiplier = params.straggler_multiplier if u_straggle < params.straggler_fraction else 1.0
    outcome = OK
    if u_fail < params.error_fraction:
        outcome = ERROR
    elif u_fail < params.error_fraction + params.abort_fraction and n >= 2:
        outcome = ABORT
    offset = rng.randrange(POOL_SIZE - min(wanted, POOL_SIZE - 1))  # (the uncapped length: chunks continue it)
    return SimDraw(n, finished, offset, multiplier, outcome, key, wanted)


def token_pools(seed: int, first_token_id: int, vocab_size: int) -> tuple[list[int], list[float]]:
    """The default pools of a seed: :data:`POOL_SIZE` token ids uniform in
    ``[first_token_id, vocab_size)`` and as many logprobs uniform in ``[-5, -0.01]``."""
    rng = random.Random(f"sim-pool:{seed}")
    tokens = [rng.randrange(first_token_id, vocab_size) for _ in range(POOL_SIZE)]
    return tokens, [-rng.uniform(0.01, 5.0) for _ in range(POOL_SIZE)]


def tile_pool(token_pool: Sequence[int]) -> list[int]:
    """``token_pool`` repeated or cut to exactly :data:`POOL_SIZE` ids.

    Raises:
        ValueError: ``token_pool`` is empty or holds something other than ints >= 0.
    """
    ids = list(token_pool)
    if not ids or any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in ids):
        raise ValueError("token_pool must be a non-empty sequence of token ids (ints >= 0)")
    return (ids * -(-POOL_SIZE // len(ids)))[:POOL_SIZE]


def completion(tokens: Sequence[int], logprobs: Sequence[float], offset: int, n: int,
               eos_token_id: int | None) -> tuple[list[int], list[float]]:
    """``n`` token ids and logprobs from the pools at ``offset`` (wrapping around past
    the end); the last id becomes ``eos_token_id`` unless that is None (the
    completion hit its budget)."""
    out_tokens = list(tokens[offset:offset + n])
    out_logprobs = list(logprobs[offset:offset + n])
    while len(out_tokens) < n:  # longer than the pool: wrap around
        out_tokens += tokens[: n - len(out_tokens)]
        out_logprobs += logprobs[: n - len(out_logprobs)]
    if eos_token_id is not None and out_tokens:
        out_tokens[-1] = eos_token_id
    return out_tokens, out_logprobs

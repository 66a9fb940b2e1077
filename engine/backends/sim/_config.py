"""``SimConfig``: the parameters of the simulated server (:mod:`engine.backends.sim`).

Imports only the standard library and :mod:`engine.errors` (itself standard library
only), so the AReaL peer of the benchmark harness can build one under its own
interpreter (no trio, no torch).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ...errors import InvalidRequestError

__all__ = ["SCHEDULING_POLICIES", "SimConfig"]

#: The server's admission orders (vLLM ``--scheduling-policy``): ``"fcfs"`` (arrival order;
#: a request's ``priority`` is ignored) or ``"priority"`` (lowest ``priority`` first, then arrival).
SCHEDULING_POLICIES = ("fcfs", "priority")


@dataclass(frozen=True, kw_only=True)
class SimConfig:
    """Parameters of the simulated server (units in the names or listed here).

    Attributes:
        vocab_size: token ids are drawn from ``[first_token_id, vocab_size)``.
        eos_token_id: ends a completion that finishes before its budget.
        first_token_id: lowest token id drawn.
        prefill_s: seconds of prefill per request (fixed part).
        prefill_s_per_token: seconds of prefill per prompt token.
        per_token_s: seconds per decode step of a lone sequence (one token per
            step per decoding sequence).
        out_len_median: median output length in tokens (lognormal).
        out_len_sigma: lognormal shape, dimensionless (``0``: always the median); with
            ``difficulty_sigma`` the spread *within* a prompt's samples.
        difficulty_sigma: the spread of prompt difficulty, dimensionless: a prompt's
            median length is ``out_len_median * exp(difficulty_sigma * z)`` with ``z ~
            N(0, 1)`` a pure function of ``(seed, prompt)`` (:func:`prompt_difficulty`), so
            the samples of one GRPO group share it (``0``: no per-prompt difficulty).
        max_concurrency: requests the backend works on at once (a client
            side cap; ``None`` = unbounded).  Kept for compatibility; prefer
            ``max_running_seqs``.
        seed: seeds every draw.
        max_running_seqs: ``K``, sequences the server holds at once, prefilling
            or decoding (``None`` = unbounded); the rest queue FIFO.
        decode_slowdown_per_seq: dimensionless; each decoding sequence beyond
            the first makes a decode step this fraction of ``per_token_s``
            longer.
        straggler_fraction: fraction of requests (0 to 1) that are stragglers.
        straggler_multiplier: latency multiplier (>= 1) of a straggler.
        error_fraction: fraction of requests (0 to 1) that raise ``BackendError``
            after their prefill.
        abort_fraction: fraction of requests (0 to 1) that return half of their
            tokens with stop reason ``"abort"``; the resumed request gets the rest.
        draws_by_prompt: draws depend only on ``(seed, prompt ids, occurrence)``
            (holds one counter per distinct prompt).
        kv_token_budget: tokens of KV cache the server holds (prompt + generated tokens
            of every sequence holding a slot; ``None`` = unbounded).  A sequence is
            admitted only if its prompt fits with a 1% watermark to spare (or the server
            is empty); when the
            running sequences grow past the budget the lowest-priority, latest-arrived
            one is preempted (vLLM's recompute preemption: it goes back to the queue
            keeping its tokens and re-prefills prompt + output when readmitted).
        scheduling_policy: admission order when the server is full, one of
            :data:`SCHEDULING_POLICIES` (vLLM ``--scheduling-policy``).
        frontend_s_per_request: seconds each request holds the server's front end, one
            request at a time, before it reaches the scheduler (``0``: none).  Models the
            serial per-request work of an API-server process (HTTP, tokenisation,
            handing the request to the engine): measured ~10 ms on the vLLM 0.32 CPU
            server here (``benchmarks/harness/tail_vllm.py``, ``request_serial_s``), where a
            policy that splits generations into many segments pays it once per segment.
            Not part of :func:`simulate_makespan`'s ideal.
    """

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
    max_running_seqs: int | None = None
    decode_slowdown_per_seq: float = 0.0
    straggler_fraction: float = 0.0
    straggler_multiplier: float = 1.0
    error_fraction: float = 0.0
    abort_fraction: float = 0.0
    draws_by_prompt: bool = False
    difficulty_sigma: float = 0.0
    kv_token_budget: int | None = None
    scheduling_policy: str = "fcfs"
    frontend_s_per_request: float = 0.0

    def __post_init__(self) -> None:
        for name in ("prefill_s", "prefill_s_per_token", "per_token_s", "out_len_sigma", "decode_slowdown_per_seq",
                     "difficulty_sigma", "frontend_s_per_request"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise InvalidRequestError(f"SimConfig.{name} must be a finite number >= 0, got {value!r}")
        for name in ("straggler_fraction", "error_fraction", "abort_fraction"):
            value = getattr(self, name)
            if not (0.0 <= value <= 1.0):
                raise InvalidRequestError(f"SimConfig.{name} must be in [0, 1], got {value!r}")
        if self.error_fraction + self.abort_fraction > 1.0:
            raise InvalidRequestError("SimConfig.error_fraction + abort_fraction must be <= 1")
        if not (math.isfinite(self.straggler_multiplier) and self.straggler_multiplier >= 1.0):
            raise InvalidRequestError(
                f"SimConfig.straggler_multiplier must be a finite number >= 1, got {self.straggler_multiplier!r}")
        if self.out_len_median < 1:
            raise InvalidRequestError(f"SimConfig.out_len_median must be >= 1, got {self.out_len_median}")
        if not (0 <= self.first_token_id < self.vocab_size):
            raise InvalidRequestError("SimConfig.first_token_id must be in [0, vocab_size)")
        for name in ("max_concurrency", "max_running_seqs", "kv_token_budget"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise InvalidRequestError(f"SimConfig.{name} must be >= 1 or None, got {value}")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise InvalidRequestError(
                f"SimConfig.scheduling_policy must be one of {SCHEDULING_POLICIES}, got {self.scheduling_policy!r}")

    @property
    def shared_clock(self) -> bool:
        """True when requests interact (``K`` bounded, decode slowdown or a KV budget): then
        one event clock serves them all; otherwise each request just sleeps."""
        return self.max_running_seqs is not None or self.decode_slowdown_per_seq > 0 or self.kv_token_budget is not None

    def prefill_seconds(self, prompt_len: int) -> float:
        """Prefill time of a ``prompt_len``-token prompt (seconds, no straggling)."""
        return self.prefill_s + prompt_len * self.prefill_s_per_token


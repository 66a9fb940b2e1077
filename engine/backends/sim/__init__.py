"""``sim``: a deterministic simulated inference server, for tests and benchmarks.

Latency model (all times in seconds, token counts in tokens).  The server is a
GPU that holds at most ``max_running_seqs`` sequences (``K``) at once; requests
beyond that wait in a FIFO queue.  A request with ``P`` prompt tokens that will
produce ``N`` tokens, once it has a slot:

1. prefills for ``prefill_s + P * prefill_s_per_token`` (prefill does not slow
   down other sequences and is not slowed by them);
2. decodes: every decoding sequence advances one token per decode step, and a
   step takes ``per_token_s * (1 + decode_slowdown_per_seq * (R - 1))`` with
   ``R`` the number of sequences decoding at that moment (so ``per_token_s`` is
   the step time of a lone sequence; steps speed up again as others finish);
3. leaves, freeing its slot.

Admission is FCFS, or with ``scheduling_policy="priority"`` lowest
``ModelRequest.priority`` first, then arrival (vLLM ``--scheduling-policy priority``:
a lower value is served first).  With a ``kv_token_budget`` every sequence holding a
slot holds ``prompt + decoded`` tokens of KV: a sequence is admitted only if its
prompt fits with a 1% watermark to spare, and when the decoding sequences outgrow the
budget the lowest-priority, latest-arrived one is preempted (vLLM's recompute
preemption: back to the queue in its place, its tokens kept, prompt + output
re-prefilled at ``prefill_s_per_token`` when readmitted).  So the step cost is flat up
to the KV budget (``decode_slowdown_per_seq`` small), then requests queue.

With the defaults (``K`` unbounded, no slowdown) a request therefore takes
exactly ``prefill_s + P * prefill_s_per_token + N * per_token_s`` and its first
token arrives after ``prefill_s + P * prefill_s_per_token + per_token_s``.  One
event clock (:class:`ServerModel`, driven by one task that ``SimBackend.open`` runs)
serves every request: a request parks once, however many tokens it produces,
and the clock wakes once per event time, so tens of thousands of requests in
flight cost little CPU.

Draws.  Output lengths come from a seeded lognormal distribution with median
``out_len_median`` tokens and shape ``out_len_sigma`` (``0`` = always the
median), capped by the request's token budget.  With ``difficulty_sigma > 0`` each
prompt has a difficulty ``d = exp(difficulty_sigma * z)``, ``z ~ N(0, 1)`` a pure
function of ``(seed, prompt)``: its samples' lengths are lognormal around
``out_len_median * d``, so lengths are heavy-tailed and correlated within a GRPO group
(``_draws``; the fit to Seer's tail shape: ``benchmarks/harness/tail_config.py``,
``TAIL_SIM``).  A ``straggler_fraction`` of
requests is ``straggler_multiplier`` times slower (its prefill takes that many
times longer and it needs that many decode steps per token).  An
``error_fraction`` of requests fails after its prefill with
:class:`~engine.errors.BackendError`; an ``abort_fraction`` returns half of its
tokens with stop reason ``"abort"`` (as a server does during a weight update);
the engine resumes it with prompt + partial output and the sim serves the rest;
:meth:`SimBackend.abort_request` does the same on demand (SGLang's ``/abort_request``):
the request answers at once with the tokens decoded so far.  A request cut at its
budget (``"length"``) before its drawn length is a chunk: a next segment with the same
``rid`` (prompt + output so far, as the engine's scheduling policies send them:
``overprovision_chunk_tokens``, the ``length_aware`` probe) continues the same draw, so a
generation has the same length and tokens however it is cut into segments.
Token ids are slices of a seeded pool of 65536 ids uniform in
``[first_token_id, vocab_size)`` (or of ``SimBackend(token_pool=...)``), logprobs
of a pool uniform in ``[-5, -0.01]``; a request that
finishes before its budget ends with ``eos_token_id`` and stop reason
``"stop"``, otherwise ``"length"``.  ``image_data`` is accepted and otherwise
ignored: the image tokens are already in the prompt ids, so they cost prefill like
any prompt token; ``statistics()["image_requests"]`` counts such requests.

Determinism.  A request whose ``gconfig.seed`` is set gets the same output for
the same prompt.  Otherwise, with ``draws_by_prompt=True`` the draws of the
``k``-th request carrying a given prompt are a pure function of ``(seed,
prompt ids, k)``, whatever the schedule (what benchmarks need to give several
executors the same work); by default draws come from one RNG seeded with
``seed`` and advanced in dispatch order (deterministic for a deterministic
schedule).

Recording.  ``SimBackend(..., record=True)`` keeps one :class:`SimRequest` per
original request (resumed segments and chunks are folded into it; a chunked one's
``out_len`` is its first segment's) in
:attr:`SimBackend.requests`; :func:`simulate_makespan` replays them through the
same server model with a zero-overhead client, which is how the benchmarks
compute the ideal makespan.

Modules: ``_config`` (:class:`SimConfig`), ``_draws`` (the per-request draws and
token pools; standard library only), ``_server_model`` (:class:`ServerModel`,
:func:`simulate_makespan`, :func:`group_episodes`), ``_backend``
(:class:`SimBackend`, the trio side).  Names are exported lazily (PEP 562), so
``from engine.backends.sim import SimConfig, draw`` imports neither trio nor
torch: the benchmark harness's AReaL peer, which runs under an interpreter
without them, imports the draws this way instead of keeping copies.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ...lazy import lazy_exports

__all__ = [
    "POOL_SIZE",
    "ServerModel",
    "SimBackend",
    "SimConfig",
    "SimDraw",
    "SimRequest",
    "SimStatistics",
    "SCHEDULING_POLICIES",
    "completion",
    "draw",
    "group_episodes",
    "prompt_difficulty",
    "prompt_key",
    "prompt_rng",
    "simulate_makespan",
    "tile_pool",
    "token_pools",
]

_LAZY = {
    "POOL_SIZE": "engine.backends.sim._draws",
    "ServerModel": "engine.backends.sim._server_model",
    "SimBackend": "engine.backends.sim._backend",
    "SimConfig": "engine.backends.sim._config",
    "SimDraw": "engine.backends.sim._draws",
    "SimRequest": "engine.backends.sim._server_model",
    "SimStatistics": "engine.backends.sim._backend",
    "SCHEDULING_POLICIES": "engine.backends.sim._config",
    "completion": "engine.backends.sim._draws",
    "draw": "engine.backends.sim._draws",
    "group_episodes": "engine.backends.sim._server_model",
    "prompt_difficulty": "engine.backends.sim._draws",
    "prompt_key": "engine.backends.sim._draws",
    "prompt_rng": "engine.backends.sim._draws",
    "simulate_makespan": "engine.backends.sim._server_model",
    "tile_pool": "engine.backends.sim._draws",
    "token_pools": "engine.backends.sim._draws",
}

if TYPE_CHECKING:
    from ._backend import SimBackend, SimStatistics
    from ._config import SCHEDULING_POLICIES, SimConfig
    from ._draws import (POOL_SIZE, SimDraw, completion, draw, prompt_difficulty, prompt_key, prompt_rng, tile_pool,
                         token_pools)
    from ._server_model import ServerModel, SimRequest, group_episodes, simulate_makespan

__getattr__, __dir__ = lazy_exports(globals(), _LAZY)

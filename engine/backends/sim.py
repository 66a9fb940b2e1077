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

With the defaults (``K`` unbounded, no slowdown) a request therefore takes
exactly ``prefill_s + P * prefill_s_per_token + N * per_token_s`` and its first
token arrives after ``prefill_s + P * prefill_s_per_token + per_token_s``.  One
event clock (:class:`ServerModel`, driven by one task that ``SimBackend.open`` runs)
serves every request: a request parks once, however many tokens it produces,
and the clock wakes once per event time, so tens of thousands of requests in
flight cost little CPU.

Draws.  Output lengths come from a seeded lognormal distribution with median
``out_len_median`` tokens and shape ``out_len_sigma`` (``0`` = always the
median), capped by the request's token budget.  A ``straggler_fraction`` of
requests is ``straggler_multiplier`` times slower (its prefill takes that many
times longer and it needs that many decode steps per token).  An
``error_fraction`` of requests fails after its prefill with
:class:`~engine.errors.BackendError`; an ``abort_fraction`` returns half of its
tokens with stop reason ``"abort"`` (as a server does during a weight update);
the engine resumes it with prompt + partial output and the sim serves the rest.
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
original request (resumed segments are folded into it) in
:attr:`SimBackend.requests`; :func:`simulate_makespan` replays them through the
same server model with a zero-overhead client, which is how the benchmarks
compute the ideal makespan.
"""

from __future__ import annotations

import collections
import hashlib
import heapq
import math
import random
from array import array
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import trio

from ..errors import BackendError, InvalidRequestError
from ..types import ModelRequest, ModelResponse
from .base import BackendStatistics, PerRequestBackend

__all__ = [
    "ServerModel",
    "SimBackend",
    "SimConfig",
    "SimDraw",
    "SimRequest",
    "SimStatistics",
    "group_episodes",
    "prompt_key",
    "simulate_makespan",
    "tile_pool",
]

_POOL = 1 << 16  # tokens / logprobs drawn once per backend, sliced per request
_EPS_STEPS = 1e-9  # decode-progress tolerance (in steps) for float round-off

OK, ERROR, ABORT = "ok", "error", "abort"


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
        out_len_sigma: lognormal shape, dimensionless (``0``: always the median).
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

    def __post_init__(self) -> None:
        for name in ("prefill_s", "prefill_s_per_token", "per_token_s", "out_len_sigma", "decode_slowdown_per_seq"):
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
        for name in ("max_concurrency", "max_running_seqs"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise InvalidRequestError(f"SimConfig.{name} must be >= 1 or None, got {value}")

    @property
    def shared_clock(self) -> bool:
        """True when requests interact (``K`` bounded or decode slowdown): then
        one event clock serves them all; otherwise each request just sleeps."""
        return self.max_running_seqs is not None or self.decode_slowdown_per_seq > 0

    def prefill_seconds(self, prompt_len: int) -> float:
        """Prefill time of a ``prompt_len``-token prompt (seconds, no straggling)."""
        return self.prefill_s + prompt_len * self.prefill_s_per_token


@dataclass(frozen=True)
class SimRequest:
    """One original request as the sim served it (``SimBackend(record=True)``).

    Attributes:
        key: :func:`prompt_key` of the prompt (groups the requests of an episode).
        prompt_len: prompt tokens.
        out_len: tokens the request produces in all (across an abort + resume).
        multiplier: latency multiplier (``straggler_multiplier`` or 1).
        outcome: ``"ok"``, ``"error"`` (raised after prefill) or ``"abort"``
            (``out_len // 2`` tokens, then resumed for the rest).
    """

    key: int
    prompt_len: int
    out_len: int
    multiplier: float = 1.0
    outcome: str = OK

    def segments(self) -> list[tuple[int, float, float]]:
        """``(prompt_len, prefill_s_factor, decode_steps)`` per segment sent: the
        resumed segment re-prefills prompt + partial output."""
        m = self.multiplier
        if self.outcome == ERROR:
            return [(self.prompt_len, m, 0.0)]
        if self.outcome == ABORT:
            half = self.out_len // 2
            return [(self.prompt_len, m, half * m), (self.prompt_len + half, m, (self.out_len - half) * m)]
        return [(self.prompt_len, m, self.out_len * m)]


def tile_pool(token_pool: Sequence[int]) -> list[int]:
    """``token_pool`` repeated or cut to exactly the pool size (65536 ids)."""
    ids = list(token_pool)
    if not ids or any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in ids):
        raise InvalidRequestError("token_pool must be a non-empty sequence of token ids (ints >= 0)")
    return (ids * -(-_POOL // len(ids)))[:_POOL]


def prompt_key(input_ids: Sequence[int]) -> int:
    """A 64-bit key of a token sequence (stable across processes and runs)."""
    return int.from_bytes(hashlib.blake2b(array("q", input_ids).tobytes(), digest_size=8).digest(), "little")


# -- the server model ------------------------------------------------------------------------------
class _Seq:
    __slots__ = ("prefill_s", "steps", "on_done", "state", "end", "decode_start")

    def __init__(self, prefill_s: float, steps: float, on_done: Callable[[float, float], None]) -> None:
        self.prefill_s = prefill_s
        self.steps = steps
        self.on_done = on_done
        self.state = "waiting"  # -> prefill -> decode -> done | cancelled
        self.end = 0.0  # prefill end (seconds) or decode end (steps), by state
        self.decode_start = 0.0


class ServerModel:
    """Event-driven model of the GPU (see the module docstring); sync and exact.

    Times are seconds on the caller's clock.  ``submit`` a sequence (prefill
    seconds, decode steps, ``on_done(end_time, decode_start_time)``), call
    :meth:`advance` with the current time to fire every event up to it (in time
    order, each ``on_done`` with the exact event time), and sleep until
    :meth:`next_event_time`.  Callbacks may submit new sequences.
    """

    def __init__(self, *, per_token_s: float, max_running_seqs: int | None = None,
                 decode_slowdown_per_seq: float = 0.0) -> None:
        self.per_token_s = per_token_s
        self.slots = max_running_seqs if max_running_seqs is not None else math.inf
        self.slowdown = decode_slowdown_per_seq
        self.t = 0.0  # model time of the last update (seconds)
        self.g = 0.0  # decode steps taken by every sequence decoding since t = 0
        self._waiting: collections.deque[_Seq] = collections.deque()
        self._prefill: list[tuple[float, int, _Seq]] = []  # (end time, tie, seq)
        self._decode: list[tuple[float, int, _Seq]] = []  # (end progress g, tie, seq)
        self._tie = 0
        self.decoding = 0  # R
        self.occupied = 0  # sequences holding a slot (prefill + decode)
        self.queued = 0
        self.peak_occupied = 0

    def step_s(self) -> float:
        """Seconds per decode step now."""
        return self.per_token_s * (1.0 + self.slowdown * max(self.decoding - 1, 0))

    def submit(self, now: float, prefill_s: float, steps: float, on_done: Callable[[float, float], None]) -> _Seq:
        if now > self.t:
            self.advance(now)
        seq = _Seq(prefill_s, steps, on_done)
        self._waiting.append(seq)
        self.queued += 1
        self._admit()
        return seq

    def cancel(self, now: float, seq: _Seq) -> None:
        """Withdraw ``seq`` (frees its slot at ``now``); no callback."""
        if now > self.t:
            self.advance(now)
        if seq.state == "waiting":
            self.queued -= 1
        elif seq.state == "prefill":
            self.occupied -= 1
        elif seq.state == "decode":
            self.decoding -= 1
            self.occupied -= 1
        else:
            return
        seq.state = "cancelled"  # left in its queue/heap, skipped when reached
        self._admit()

    def next_event_time(self) -> float:
        t = math.inf
        while self._prefill and self._prefill[0][2].state != "prefill":
            heapq.heappop(self._prefill)
        if self._prefill:
            t = self._prefill[0][0]
        while self._decode and self._decode[0][2].state != "decode":
            heapq.heappop(self._decode)
        if self._decode:
            t = min(t, self.t + max(self._decode[0][0] - self.g, 0.0) * self.step_s())
        return t

    def advance(self, now: float) -> None:
        """Fire every event at or before ``now``, then move the clock to ``now``."""
        while True:
            te = self.next_event_time()
            if te > now:
                break
            self._move_to(te)
            while self._prefill and self._prefill[0][0] <= self.t:
                _, _, seq = heapq.heappop(self._prefill)
                if seq.state == "prefill":
                    self._start_decode(seq)
            while self._decode and self._decode_due(self._decode[0][0]):
                _, _, seq = heapq.heappop(self._decode)
                if seq.state == "decode":
                    self.decoding -= 1
                    self._finish(seq)
            self._admit()
        self._move_to(now)

    def _decode_due(self, g_end: float) -> bool:
        """A decode ending at progress ``g_end`` is due now: reached within round-off,
        or so close that its end time rounds to the current time (at clock values of
        ~1e5 s, as trio's, a few picoseconds vanish in a float)."""
        return g_end <= self.g + _EPS_STEPS or self.t + (g_end - self.g) * self.step_s() <= self.t

    def _move_to(self, t: float) -> None:
        if t > self.t:
            if self.decoding and self.per_token_s > 0:
                self.g += (t - self.t) / self.step_s()
            self.t = t

    def _admit(self) -> None:
        while self._waiting and self.occupied < self.slots:
            seq = self._waiting.popleft()
            if seq.state != "waiting":
                continue
            self.queued -= 1
            self.occupied += 1
            self.peak_occupied = max(self.peak_occupied, self.occupied)
            if seq.prefill_s > 0:
                seq.state = "prefill"
                seq.end = self.t + seq.prefill_s
                self._tie += 1
                heapq.heappush(self._prefill, (seq.end, self._tie, seq))
            else:
                self._start_decode(seq)

    def _start_decode(self, seq: _Seq) -> None:
        seq.decode_start = self.t
        if seq.steps <= 0 or self.per_token_s == 0:
            self._finish(seq)
            return
        seq.state = "decode"
        self.decoding += 1
        seq.end = self.g + seq.steps
        self._tie += 1
        heapq.heappush(self._decode, (seq.end, self._tie, seq))

    def _finish(self, seq: _Seq) -> None:
        seq.state = "done"
        self.occupied -= 1
        seq.on_done(self.t, seq.decode_start)


def simulate_makespan(episodes: Iterable[Sequence[SimRequest]], concurrency: int, config: SimConfig) -> float:
    """Makespan (seconds) of a zero-overhead client over the same server model.

    Episodes start in order, at most ``concurrency`` at a time; an episode sends
    all its requests at once (an aborted one re-sends its rest the instant the
    first part returns) and frees its slot when the last one ends; the next
    episode starts that same instant.  Nothing else takes time (tokenisation,
    rewards, scheduling).  With ``K`` unbounded and no slowdown this is list
    scheduling of per-episode latencies on ``concurrency`` slots.
    """
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    slots = config.max_running_seqs
    if config.max_concurrency is not None:
        slots = config.max_concurrency if slots is None else min(slots, config.max_concurrency)
    model = ServerModel(per_token_s=config.per_token_s, max_running_seqs=slots,
                        decode_slowdown_per_seq=config.decode_slowdown_per_seq)
    pending = collections.deque(episodes)
    ended: collections.deque[tuple[list[tuple[int, float, float]], list[int], float]] = collections.deque()
    makespan = 0.0
    running = 0

    def send(segs: list[tuple[int, float, float]], left: list[int]) -> None:
        prompt_len, factor, steps = segs[0]
        model.submit(model.t, config.prefill_seconds(prompt_len) * factor, steps,
                     lambda end, _decode_start: ended.append((segs, left, end)))

    def start_episodes() -> None:
        nonlocal running
        while pending and running < concurrency:
            episode = pending.popleft()
            if not episode:  # nothing to generate: ends at once
                continue
            running += 1
            left = [len(episode)]
            for request in episode:
                send(request.segments(), left)

    start_episodes()
    while True:
        while ended:  # callbacks only queue; events are handled here, at model.t
            segs, left, end = ended.popleft()
            makespan = max(makespan, end)
            if len(segs) > 1:
                send(segs[1:], left)  # an aborted request is resumed at once
                continue
            left[0] -= 1
            if left[0] == 0:
                running -= 1
                start_episodes()
        t = model.next_event_time()
        if t == math.inf:
            return makespan
        model.advance(t)


def group_episodes(requests: Iterable[SimRequest]) -> list[list[SimRequest]]:
    """Group recorded requests into episodes by prompt key, in first-seen order."""
    groups: dict[int, list[SimRequest]] = {}
    for r in requests:
        groups.setdefault(r.key, []).append(r)
    return list(groups.values())


# -- the backend --------------------------------------------------------------------------------------
@dataclass
class SimDraw:
    """What :meth:`SimBackend.draw` decided for one request."""

    n: int  # tokens in all
    finished: bool  # ends with EOS before the budget
    offset: int  # into the token/logprob pools
    multiplier: float
    outcome: str
    key: int | None = None  # prompt_key, when the draw needed it


@dataclass
class _Resume:
    rest: int
    finished: bool
    offset: int
    multiplier: float


@dataclass(frozen=True, kw_only=True)
class SimStatistics(BackendStatistics):
    """:class:`~engine.backends.base.BackendStatistics` of a :class:`SimBackend`.

    Attributes:
        errors_injected, aborts_injected, stragglers: requests given each draw.
        peak_requests_in_progress: most requests inside the backend at once.
        sequences_running, sequences_queued, sequences_decoding: the server model now
            (holding a slot, waiting for one, past prefill).
        peak_running_seqs: most sequences holding a slot at once.
        image_requests: requests that carried ``image_data``.
    """

    errors_injected: int = 0
    image_requests: int = 0
    aborts_injected: int = 0
    stragglers: int = 0
    peak_requests_in_progress: int = 0
    sequences_running: int = 0
    sequences_queued: int = 0
    sequences_decoding: int = 0
    peak_running_seqs: int = 0


class SimBackend(PerRequestBackend):
    """A simulated server; see the module docstring for the model.

    Args:
        config: a :class:`SimConfig` (or pass its fields as keyword arguments).
        record: keep one :class:`SimRequest` per original request in
            :attr:`requests` (memory grows with the requests served).
        token_pool: token ids that outputs are sliced from (tiled or cut to
            65536 ids), e.g. a tokenised corpus so that completions decode to
            plausible text; default: ids uniform in ``[first_token_id, vocab_size)``.
    """

    kind = "sim"

    def __init__(self, config: SimConfig | None = None, *, record: bool = False,
                 token_pool: Sequence[int] | None = None, **overrides: Any) -> None:
        self.config = config or SimConfig(**overrides)
        super().__init__(max_concurrency=self.config.max_concurrency)
        cfg = self.config
        self._rng = random.Random(cfg.seed)
        pool_rng = random.Random(f"sim-pool:{cfg.seed}")
        self._tok_pool = [pool_rng.randrange(cfg.first_token_id, cfg.vocab_size) for _ in range(_POOL)]
        self._lp_pool = [-pool_rng.uniform(0.01, 5.0) for _ in range(_POOL)]
        if token_pool is not None:
            self._tok_pool = tile_pool(token_pool)
        self._seen: dict[int, int] = {}
        self._resumes: dict[str, _Resume] = {}
        self.record = record
        self.requests: list[SimRequest] = []
        self.errors_injected = 0
        self.aborts_injected = 0
        self.stragglers = 0
        self.image_requests = 0  # requests that carried image_data (served like any other)
        self.in_progress = 0  # requests being served now (prefill, decode or queued at the server)
        self.peak_in_progress = 0
        # One event clock for every request, even when they do not interact: waking
        # a parked task is much cheaper than a trio.sleep per request (a timeout is
        # a cancellation: an exception raised and caught per wake-up).
        self._model = ServerModel(per_token_s=cfg.per_token_s, max_running_seqs=cfg.max_running_seqs,
                                  decode_slowdown_per_seq=cfg.decode_slowdown_per_seq)
        self._clock_scope: trio.CancelScope | None = None

    # -- draws ---------------------------------------------------------------------------------------
    def draw(self, input_ids: Sequence[int], budget: int, *, gconfig_seed: int | None = None,
             occurrence: int | None = None) -> SimDraw:
        """The draws of one request (length, straggling, failure, pool offset).

        With ``draws_by_prompt`` and an explicit ``occurrence`` this has no side
        effect, so a benchmark can plan the work ahead of a run.
        """
        cfg = self.config
        key = None
        if gconfig_seed is not None:
            rng = random.Random(f"{cfg.seed}:{gconfig_seed}:{list(input_ids)}")
        elif cfg.draws_by_prompt:
            key = prompt_key(input_ids)
            if occurrence is None:
                occurrence = self._seen.get(key, 0)
                self._seen[key] = occurrence + 1
            rng = random.Random((cfg.seed * 1_000_003 + occurrence) ^ key)
        else:
            rng = random.Random(self._rng.getrandbits(64))
        n = cfg.out_len_median
        if cfg.out_len_sigma > 0:
            n = max(1, round(rng.lognormvariate(math.log(cfg.out_len_median), cfg.out_len_sigma)))
        u_straggle, u_fail = rng.random(), rng.random()
        finished = n < budget
        n = max(min(n, budget), 0)
        multiplier = cfg.straggler_multiplier if u_straggle < cfg.straggler_fraction else 1.0
        outcome = OK
        if u_fail < cfg.error_fraction:
            outcome = ERROR
        elif u_fail < cfg.error_fraction + cfg.abort_fraction and n >= 2:
            outcome = ABORT
        offset = rng.randrange(_POOL - min(n, _POOL - 1))
        return SimDraw(n, finished, offset, multiplier, outcome, key)

    def _tokens(self, offset: int, n: int, eos: bool) -> tuple[list[int], list[float]]:
        tokens = self._tok_pool[offset:offset + n]
        logprobs = self._lp_pool[offset:offset + n]
        while len(tokens) < n:  # longer than the pool: wrap around
            tokens += self._tok_pool[: n - len(tokens)]
            logprobs += self._lp_pool[: n - len(logprobs)]
        if eos and tokens:
            tokens[-1] = self.config.eos_token_id
        return tokens, logprobs

    # -- serving -------------------------------------------------------------------------------------
    @asynccontextmanager
    async def open(self) -> AsyncIterator[SimBackend]:
        """Run the event clock while open (needed when requests interact:
        ``max_running_seqs`` or a decode slowdown; otherwise requests sleep alone)."""
        try:
            async with trio.open_nursery() as nursery:
                await nursery.start(self._clock)
                yield self
                nursery.cancel_scope.cancel()
        finally:
            self._clock_scope = None

    async def _clock(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Sleep until the model's next event, fire every due event, repeat
        (arrivals move the deadline earlier when they need to)."""
        model = self._model
        task_status.started()
        while True:
            with trio.CancelScope(deadline=model.next_event_time()) as scope:
                self._clock_scope = scope
                await trio.sleep_forever()
            model.advance(trio.current_time())

    async def _occupy(self, prefill_s: float, steps: float) -> tuple[float, float]:
        """Hold a slot for ``prefill_s`` then ``steps`` decode steps; returns
        (end time, decode start time)."""
        model = self._model
        if self._clock_scope is None:  # generate() called outside open()
            if self.config.shared_clock:
                raise RuntimeError("SimBackend with max_running_seqs or decode slowdown serves requests only "
                                   "inside `async with backend.open()` (open_rollout_engine enters it)")
            start = trio.current_time()
            await trio.sleep(prefill_s + steps * self.config.per_token_s)
            return trio.current_time(), start + prefill_s
        done = trio.Event()
        times: list[float] = []

        def on_done(end: float, decode_start: float) -> None:
            times.extend((end, decode_start))
            done.set()

        seq = model.submit(trio.current_time(), prefill_s, steps, on_done)
        self._wake_clock()
        try:
            await done.wait()
        except BaseException:
            model.cancel(trio.current_time(), seq)  # frees the slot: a queued sequence may start now
            self._wake_clock()
            raise
        return times[0], times[1]

    def _wake_clock(self) -> None:
        """Move the clock's deadline earlier if the model's next event is now
        sooner (a later one only makes the clock wake early and sleep again:
        cheaper than moving a deadline on every arrival)."""
        scope = self._clock_scope
        if scope is not None:
            t = self._model.next_event_time()
            if t < scope.deadline:
                scope.deadline = t

    async def _generate(self, request: ModelRequest, budget: int) -> ModelResponse:
        self.image_requests += bool(request.image_data)  # images cost nothing here: their tokens are in the prompt
        self.in_progress += 1
        self.peak_in_progress = max(self.peak_in_progress, self.in_progress)
        try:
            return await self._simulate(request, budget)
        finally:
            self.in_progress -= 1

    async def _simulate(self, request: ModelRequest, budget: int) -> ModelResponse:
        cfg = self.config
        version = self.version  # read before the segment is sent (AReaL PR #1569)
        start = trio.current_time()
        prompt_len = len(request.input_ids)
        resume = self._resumes.pop(request.rid, None)
        if resume is not None:  # the rest of an aborted request
            n, finished, offset, mult, outcome = resume.rest, resume.finished, resume.offset, resume.multiplier, OK
            n = min(n, budget)
            finished = finished and n == resume.rest
        else:
            d = self.draw(request.input_ids, budget, gconfig_seed=request.gconfig.seed)
            n, finished, offset, mult, outcome = d.n, d.finished, d.offset, d.multiplier, d.outcome
            if mult > 1:
                self.stragglers += 1
            if self.record:
                key = d.key if d.key is not None else prompt_key(request.input_ids)
                self.requests.append(SimRequest(key, prompt_len, n, mult, outcome))
        prefill = cfg.prefill_seconds(prompt_len) * mult
        if outcome == ERROR:
            self.errors_injected += 1
            await self._occupy(prefill, 0.0)
            raise BackendError(f"request {request.rid}: injected server error (sim error_fraction)")
        if outcome == ABORT:
            self.aborts_injected += 1
            half = n // 2
            self._resumes[request.rid] = _Resume(n - half, finished, offset + half, mult)
            n, finished = half, False
        end, decode_start = await self._occupy(prefill, n * mult)
        tokens, logprobs = self._tokens(offset, n, finished)
        return ModelResponse(
            input_tokens=list(request.input_ids),
            output_tokens=tokens,
            output_logprobs=logprobs,
            output_versions=[version] * n,
            stop_reason=ABORT if outcome == ABORT else ("stop" if finished else "length"),
            latency=end - start,
            ttft=decode_start - start + cfg.per_token_s * mult,
        )

    def statistics(self) -> SimStatistics:
        model = self._model
        return SimStatistics(**self._base_stats(), errors_injected=self.errors_injected,
                             aborts_injected=self.aborts_injected, stragglers=self.stragglers,
                             image_requests=self.image_requests,
                             peak_requests_in_progress=self.peak_in_progress, sequences_running=model.occupied,
                             sequences_queued=model.queued, sequences_decoding=model.decoding,
                             peak_running_seqs=model.peak_occupied)

"""``SimBackend``: the simulated server as a trio backend (:mod:`engine.backends.sim`).

One event clock task (:meth:`SimBackend.open`) drives the :class:`ServerModel`;
each request parks once on it.  The per-request draws are :mod:`._draws`
(shared with the benchmark harness's AReaL peer).
"""

from __future__ import annotations

import collections
import random
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import trio

from ...errors import BackendError, InvalidRequestError
from ...types import ModelRequest, ModelResponse, StopReason
from ..base import BackendStatistics, PerRequestBackend
from ._config import SimConfig
from ._draws import (
    ABORT,
    ERROR,
    OK,
    SimDraw,
    completion,
    draw,
    prompt_key,
    prompt_rng,
    request_seed_rng,
    tile_pool,
    token_pools,
)
from ._server_model import ServerModel, SimRequest

__all__ = ["SimBackend", "SimStatistics"]


#: continuations kept (:class:`_Resume`, oldest dropped first): a request cut at its budget
#: that is never continued (a generation that reached its own cap) leaves one behind
_MAX_RESUMES = 1 << 16


@dataclass
class _Resume:
    """The rest of a draw: ``rest`` tokens from pool ``offset`` on, for the next segment
    of the same rid (after an abort, or a chunk cut at its budget)."""

    rest: int
    offset: int
    multiplier: float


@dataclass
class _Live:
    """A request on the event clock: its sequence, and the tokens decoded when aborted."""

    seq: Any
    done: trio.Event
    aborted_tokens: int | None = None


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
        tokens_discarded: tokens decoded for requests withdrawn before they answered
            (cancelled callers): server work nobody received.
        requests_aborted: requests answered early by :meth:`SimBackend.abort_request`.
        preemptions: sequences preempted for KV room (``kv_token_budget``).
        busy_slot_s: slot-seconds held by sequences (prefilling or decoding) since the clock
            started; divided by ``max_running_seqs`` and a duration, the slot occupancy.
        peak_kv_tokens: most KV tokens held at once (tracked with a ``kv_token_budget``; 0 without).
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
    tokens_discarded: int = 0
    requests_aborted: int = 0
    preemptions: int = 0
    busy_slot_s: float = 0.0
    peak_kv_tokens: int = 0


class SimBackend(PerRequestBackend):
    """A simulated server; see the module docstring for the model.

    Args:
        config: a :class:`SimConfig` (or pass its fields as keyword arguments).
        record: keep one :class:`SimRequest` per original request in
            :attr:`requests` (memory grows with the requests served).
        token_pool: token ids that outputs are sliced from (tiled or cut to
            65536 ids, :data:`POOL_SIZE`), e.g. a tokenised corpus so that completions decode to
            plausible text; default: ids uniform in ``[first_token_id, vocab_size)``.
    """

    kind = "sim"

    def __init__(self, config: SimConfig | None = None, *, record: bool = False,
                 token_pool: Sequence[int] | None = None, **overrides: Any) -> None:
        self.config = config or SimConfig(**overrides)
        super().__init__(max_concurrency=self.config.max_concurrency)
        cfg = self.config
        self._rng = random.Random(cfg.seed)
        self._tok_pool, self._lp_pool = token_pools(cfg.seed, cfg.first_token_id, cfg.vocab_size)
        if token_pool is not None:
            try:
                self._tok_pool = tile_pool(token_pool)
            except ValueError as exc:
                raise InvalidRequestError(str(exc)) from None
        self._seen: dict[int, int] = {}
        self._resumes: collections.OrderedDict[str, _Resume] = collections.OrderedDict()
        self.record = record
        self.requests: list[SimRequest] = []
        self.errors_injected = 0
        self.aborts_injected = 0
        self.stragglers = 0
        self.image_requests = 0  # requests that carried image_data (served like any other)
        self.in_progress = 0  # requests being served now (prefill, decode or queued at the server)
        self.peak_in_progress = 0
        self.tokens_discarded = 0
        self.requests_aborted = 0
        self._live: dict[str, _Live] = {}  # rid -> request on the event clock
        # the serial front end (frontend_s_per_request): requests pass it one at a time, FIFO
        self._frontend = trio.Lock() if cfg.frontend_s_per_request > 0 else None
        # One event clock for every request, even when they do not interact: waking
        # a parked task is much cheaper than a trio.sleep per request (a timeout is
        # a cancellation: an exception raised and caught per wake-up).
        self._model = ServerModel(per_token_s=cfg.per_token_s, max_running_seqs=cfg.max_running_seqs,
                                  decode_slowdown_per_seq=cfg.decode_slowdown_per_seq,
                                  kv_token_budget=cfg.kv_token_budget, recompute_s_per_token=cfg.prefill_s_per_token)
        self._clock_scope: trio.CancelScope | None = None

    # -- draws ---------------------------------------------------------------------------------------
    def draw(self, input_ids: Sequence[int], budget: int, *, gconfig_seed: int | None = None,
             occurrence: int | None = None) -> SimDraw:
        """The draws of one request (length, straggling, failure, pool offset).

        With ``draws_by_prompt`` and an explicit ``occurrence`` this has no side
        effect, so a benchmark can plan the work ahead of a run.
        """
        cfg = self.config
        key = prompt_key(input_ids) if cfg.difficulty_sigma > 0 else None
        if gconfig_seed is not None:
            rng = request_seed_rng(cfg.seed, gconfig_seed, input_ids)
        elif cfg.draws_by_prompt:
            key = prompt_key(input_ids) if key is None else key
            if occurrence is None:
                occurrence = self._seen.get(key, 0)
                self._seen[key] = occurrence + 1
            rng = prompt_rng(cfg.seed, key, occurrence)
        else:
            rng = random.Random(self._rng.getrandbits(64))
        return draw(cfg, rng, budget, key=key)

    @property
    def token_pool(self) -> Sequence[int]:
        """The :data:`POOL_SIZE` token ids that outputs are sliced from (read only)."""
        return self._tok_pool

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

    def abort_request(self, rid: str) -> bool:
        """Answer request ``rid`` now, as SGLang's ``/abort_request`` and vLLM's abort do:
        its ``generate`` returns the tokens decoded so far with stop reason ``"abort"``
        (none if it was still queued or prefilling) and frees its slot; the engine's
        resumed segment (same ``rid``, prompt + partial output) gets the rest of the same
        draw.  Returns False when ``rid`` is not on the server (finished, unknown, or the
        backend is not open).  Sync: no schedule point."""
        live = self._live.get(rid)
        if live is None or live.aborted_tokens is not None or live.seq.state in ("done", "cancelled"):
            return False
        live.aborted_tokens = int(self._model.cancel(trio.current_time(), live.seq))
        self._wake_clock()
        live.done.set()
        return True

    async def _occupy(self, rid: str, prefill_s: float, steps: float, *, prompt_tokens: int, rate: float,
                      priority: int) -> tuple[float, float, int | None]:
        """Hold a slot for ``prefill_s`` then ``steps`` decode steps; returns (end time,
        decode start time or NaN, tokens decoded when aborted or None)."""
        model = self._model
        if self._clock_scope is None:  # generate() called outside open()
            if self.config.shared_clock:
                raise RuntimeError("SimBackend with max_running_seqs, decode slowdown or a KV budget serves requests "
                                   "only inside `async with backend.open()` (open_rollout_engine enters it)")
            start = trio.current_time()
            await trio.sleep(prefill_s + steps * self.config.per_token_s)
            return trio.current_time(), start + prefill_s, None
        times: list[float] = []
        done = trio.Event()

        def on_done(end: float, decode_start: float) -> None:
            times.extend((end, decode_start))
            done.set()

        try:  # (a sequence with nothing to do finishes inside submit)
            seq = model.submit(trio.current_time(), prefill_s, steps, on_done, prompt_tokens=prompt_tokens,
                               tokens_per_step=rate, priority=priority)
        except ValueError as exc:
            raise InvalidRequestError(f"request {rid}: {exc}") from None
        live = self._live[rid] = _Live(seq, done)
        self._wake_clock()
        try:
            await live.done.wait()
        except BaseException:  # the caller withdrew: what the server decoded for it is lost
            if live.aborted_tokens is not None:
                self.discarded(rid, live.aborted_tokens)
            elif times:
                self.discarded(rid, round(steps * rate))
            else:
                self.discarded(rid, int(model.cancel(trio.current_time(), seq)))  # frees the slot
                self._wake_clock()
            raise
        finally:
            del self._live[rid]
        if live.aborted_tokens is not None:
            return trio.current_time(), seq.decode_start, live.aborted_tokens
        return times[0], times[1], None

    def discarded(self, rid: str, tokens: int) -> None:
        """Request ``rid`` was withdrawn with ``tokens`` decoded: they count in
        ``tokens_discarded``.  A hook: a subclass may attribute them (the tail benchmark
        counts each prompt's tokens); sync, called once per withdrawn request."""
        self.tokens_discarded += tokens

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
        if self._frontend is not None:  # before any draw: a request cancelled here takes none
            async with self._frontend:
                await trio.sleep(cfg.frontend_s_per_request)
        prompt_len = len(request.input_ids)
        resume = self._resumes.pop(request.rid, None)
        if resume is not None:  # the rest of an aborted request, or of one cut at its budget (a chunk)
            n, offset, mult, outcome = min(resume.rest, budget), resume.offset, resume.multiplier, OK
            finished = resume.rest < budget  # (the rule of a fresh draw: reaching the budget is "length")
            beyond: int | None = resume.rest - n
        else:
            d = self.draw(request.input_ids, budget, gconfig_seed=request.gconfig.seed)
            n, finished, offset, mult, outcome = d.n, d.finished, d.offset, d.multiplier, d.outcome
            beyond = None if d.wanted is None else max(d.wanted - n, 0)  # tokens past this budget (None: unknown)
            if mult > 1:
                self.stragglers += 1
            if self.record:
                key = d.key if d.key is not None else prompt_key(request.input_ids)
                self.requests.append(SimRequest(key, prompt_len, n, mult, outcome))
        prefill = cfg.prefill_seconds(prompt_len) * mult
        priority = request.priority if cfg.scheduling_policy == "priority" else 0
        rate = 1.0 / mult
        if outcome == ERROR:
            self.errors_injected += 1
            await self._occupy(request.rid, prefill, 0.0, prompt_tokens=prompt_len, rate=rate, priority=priority)
            raise BackendError(f"request {request.rid}: injected server error (sim error_fraction)")
        if outcome == ABORT:
            self.aborts_injected += 1
            half = n // 2
            self._keep_rest(request.rid, _Resume(n - half + (beyond or 0), offset + half, mult))
            n, finished = half, False
        end, decode_start, aborted = await self._occupy(request.rid, prefill, n * mult, prompt_tokens=prompt_len,
                                                        rate=rate, priority=priority)
        stop_reason: StopReason = "abort" if outcome == ABORT else ("stop" if finished else "length")
        if aborted is not None:  # abort_request: the tokens so far; the resumed segment gets the rest
            self.requests_aborted += 1
            after = self._resumes.pop(request.rid, None)  # the rest of an injected abort, if any
            rest = n - aborted + (after.rest if after is not None else beyond or 0)
            self._keep_rest(request.rid, _Resume(rest, offset + aborted, mult))
            n, finished, stop_reason = aborted, False, "abort"
        elif outcome == OK and not finished and beyond is not None:  # cut at the budget: a next segment continues
            self._keep_rest(request.rid, _Resume(beyond, offset + n, mult))
        tokens, logprobs = completion(self._tok_pool, self._lp_pool, offset, n,
                                      cfg.eos_token_id if finished else None)
        ttft = decode_start - start + cfg.per_token_s * mult if decode_start == decode_start else end - start
        return ModelResponse(
            input_tokens=list(request.input_ids),
            output_tokens=tokens,
            output_logprobs=logprobs,
            output_versions=[version] * n,
            stop_reason=stop_reason,
            latency=end - start,
            ttft=ttft,
        )

    def _keep_rest(self, rid: str, rest: _Resume) -> None:
        self._resumes[rid] = rest
        if len(self._resumes) > _MAX_RESUMES:
            self._resumes.popitem(last=False)

    def running_sequence_limit(self) -> int | None:
        """``SimConfig.max_running_seqs`` (None: unbounded, so no limit to bound by)."""
        return self.config.max_running_seqs

    def statistics(self) -> SimStatistics:
        model = self._model
        try:  # the slot-seconds up to now (the model counts them up to its last event)
            busy = model.busy_slot_s + model.occupied * max(trio.current_time() - model.t, 0.0)
        except RuntimeError:  # outside trio.run
            busy = model.busy_slot_s
        return SimStatistics(**self._base_stats(), errors_injected=self.errors_injected,
                             aborts_injected=self.aborts_injected, stragglers=self.stragglers,
                             image_requests=self.image_requests,
                             peak_requests_in_progress=self.peak_in_progress, sequences_running=model.occupied,
                             sequences_queued=model.queued, sequences_decoding=model.decoding,
                             peak_running_seqs=model.peak_occupied, tokens_discarded=self.tokens_discarded,
                             requests_aborted=self.requests_aborted, preemptions=model.preemptions,
                             busy_slot_s=busy, peak_kv_tokens=round(model.peak_kv_tokens))


"""The inference backend interface: one method to generate, one protocol to swap weights.

A backend is what :meth:`engine.RolloutEngine.agenerate` calls, on the episode's own task
(httpx's transport shape: one method plus ``aclose``)::

    async with backend.open():                        # open_rollout_engine does this
        resp = await backend.generate(request, budget)  # one segment
    stats = backend.statistics()                       # frozen BackendStatistics
    await backend.aclose()

* :meth:`InferenceBackend.generate` serves one segment: up to ``budget`` new tokens after
  ``request.input_ids``.  Cancelling the caller withdraws the request (a queued one is
  skipped, a running one stopped or aborted on its server).
* :meth:`InferenceBackend.open` is the backend's *lifetime*: an async context inside which
  it serves.  Backends with background work run it in a nursery this context opens (the
  sim's event clock, the remote pool's health probes, the ``hf`` batcher with its job
  channel); others just yield.  Chosen over a lazy start because a trio task needs a
  nursery, and only a scope can give one: the engine enters ``open()`` around its episode
  nursery, so episodes are cancelled before the backend's actors stop, and a start-up
  failure (model not loadable, no healthy server) raises from ``open_rollout_engine``.
* :meth:`InferenceBackend.statistics` returns a frozen :class:`BackendStatistics` (a
  subclass per backend: ``SimStatistics``, ``HFStatistics``, ``RemoteStatistics``).
* The policy version is owned by whoever drives the backend (the engine; ``rollout
  serve`` for its local model) and told with :meth:`InferenceBackend.set_version`; the
  backend only reads it, to tag each segment's tokens with the version read before the
  segment is sent (AReaL PR #1569).

Weight updates are a separate, optional interface, :class:`WeightSync` (``pause``,
``resume``, ``update_weights``), checked with ``isinstance`` (a runtime-checkable
:class:`typing.Protocol`).

:class:`PerRequestBackend` is a base for backends that serve each request independently
(sim, remote, mock): subclasses implement ``_generate``; ``generate`` adds an optional
concurrency limit and counters with no extra task or channel hop.  :class:`MockBackend`
turns a plain async function into a backend for tests (httpx ``MockTransport`` style).
"""

from __future__ import annotations

import abc
import math
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol, runtime_checkable

import trio

from ..errors import BackendError, InvalidRequestError
from ..types import STOP_REASONS, ModelRequest, ModelResponse
from .lora import AdapterVersions, LoraStatistics

__all__ = [
    "BackendStatistics",
    "InferenceBackend",
    "MockBackend",
    "PerRequestBackend",
    "WeightSync",
    "validate_response",
]

#: vLLM returns this for a logprob it could not compute.
VLLM_LOGPROB_SENTINEL = -9999.0

#: The modes of :meth:`WeightSync.pause` and :meth:`WeightSync.update_weights`.
WEIGHT_SYNC_MODES = ("abort", "in_place")


@dataclass(frozen=True, kw_only=True)
class BackendStatistics:
    """A snapshot of a backend's counters (subclassed per backend with its own fields).

    Attributes:
        kind: the backend's name (``"mock"``, ``"sim"``, ``"hf"``, ``"sglang"``, ``"vllm"``).
        version: the policy version its next segment's tokens will carry.
        logprob_semantics: the distribution ``output_logprobs`` come from (always
            ``"processed"``: after temperature, top-k and top-p).
        requests_served: segments answered (any stop reason).
        requests_running: segments being served now.
        tokens_generated: tokens in the answered segments.
        lora: the LoRA adapters served (:class:`~engine.backends.lora.LoraStatistics`),
            ``None`` when the backend serves none.
    """

    kind: str
    version: int
    logprob_semantics: str
    requests_served: int = 0
    requests_running: int = 0
    tokens_generated: int = 0
    lora: LoraStatistics | None = None


@runtime_checkable
class WeightSync(Protocol):
    """Pause generation and swap a backend's weights (the hf backend, the remote clients,
    ``rollout serve`` through the sglang client).

    ``engine.update_weights`` drives it: ``pause(mode)``, ``update_weights(source,
    version=, mode=)``, then (the engine sets the version) ``resume()``.

    Modes: ``"abort"``: in-flight generations return at once with stop reason ``"abort"``
    and their partial tokens (the engine re-sends prompt + partial output after the
    update); ``"in_place"``: they freeze between two decoding steps and continue with the
    new weights (only where the backend can tag the tokens after the swap with the new
    version: the hf backend).  A backend that cannot honour a mode raises
    :class:`~engine.errors.BackendError` naming it.
    """

    async def pause(self, mode: str = "abort") -> None:
        """Stop starting generation work; ``mode`` says what happens to work in flight.
        Returns once that is done (aborted requests answered, or decoding parked)."""
        ...

    async def resume(self) -> None:
        """Undo :meth:`pause`: queued and frozen generations go on."""
        ...

    async def update_weights(self, source: Any, *, version: int, mode: str = "abort") -> None:
        """Load new weights from ``source`` (a checkpoint folder; the hf backend also takes
        a state dict; backends that serve LoRA take an adapter: a peft model, a peft state
        dict or an adapter folder, :mod:`engine.backends.lora`); tokens generated with them
        will be tagged ``version``.  Called
        between :meth:`pause` and :meth:`resume` (when called alone it pauses and resumes
        around itself).  On failure the old weights stay and it raises
        :class:`~engine.errors.BackendError`."""
        ...


def check_sync_mode(owner: str, mode: str) -> None:
    """Raise :class:`InvalidRequestError` naming ``owner`` for an unknown weight-sync mode."""
    if mode not in WEIGHT_SYNC_MODES:
        raise InvalidRequestError(f"{owner}: mode must be one of {WEIGHT_SYNC_MODES}, got {mode!r}")


class InferenceBackend(abc.ABC):
    """An inference server as the engine sees it (see the module docstring).

    Attributes:
        kind: a short name, reported in :class:`BackendStatistics`.
        logprob_semantics: which distribution ``output_logprobs`` come from; every
            backend of this package reports ``"processed"`` (after temperature, top-k and
            top-p: the distribution that was sampled; SGLang's default, vLLM's
            ``--logprobs-mode processed_logprobs``).
        weights_shared_across_clients: False (default): the model lives in this
            process, so each copy of the backend loads its own weights; True (the remote
            clients): the weights live in servers that several clients share, so a
            weight update loads them once for all (engine shards: :mod:`engine.shards._weights`).
        lora: the LoRA adapters it serves (:class:`~engine.backends.lora.AdapterVersions`),
            ``None`` (default) when it serves none: then a request naming a ``lora_name``
            is refused.
    """

    kind: ClassVar[str] = "backend"
    logprob_semantics: ClassVar[str] = "processed"
    weights_shared_across_clients: ClassVar[bool] = False
    _version: int = 0
    lora: AdapterVersions | None = None

    @property
    def version(self) -> int:
        """The policy version tokens are tagged with (read-only: see :meth:`set_version`)."""
        return self._version

    def set_version(self, version: int) -> None:
        """Called by the version's owner (the engine's ``set_version``; ``rollout serve``)
        only: segments sent from now on carry ``version``."""
        self._version = version

    @asynccontextmanager
    async def open(self) -> AsyncIterator[InferenceBackend]:
        """Serve inside this scope (see the module docstring).  The default has no
        background work.  Raises what start-up raises (e.g. no model, no server)."""
        yield self

    @abc.abstractmethod
    async def generate(self, request: ModelRequest, budget: int) -> ModelResponse:
        """Generate up to ``budget`` (> 0) new tokens after ``request.input_ids``.

        Returns a response whose tokens carry the version read before the segment was
        sent; stop reason ``"abort"`` (with the partial output) when it was interrupted
        (pause, weight update): the engine resumes it.  Cancelling the caller withdraws
        the request.

        Raises:
            InvalidRequestError: the backend does not support a request field.
            BackendError: the backend failed (or is not open, for batching backends).
        """

    async def aclose(self) -> None:
        """Release resources (models, HTTP clients).  Idempotent."""

    def running_sequence_limit(self) -> int | None:
        """Sequences its servers run at once, summed over them (vLLM's ``--max-num-seqs``,
        the sim's ``max_running_seqs``): what ``EngineConfig(scheduling_max_segments="server")``
        bounds the engine's segments in flight by.  Read once the backend is open; ``None``
        (the default): unknown, also when one server's limit is unknown."""
        return None

    @abc.abstractmethod
    def statistics(self) -> BackendStatistics:
        """A frozen snapshot of the backend's counters; cheap, sync."""


class PerRequestBackend(InferenceBackend):
    """A backend that serves each request independently, on the caller's task.

    Subclasses implement :meth:`_generate`.  ``max_concurrency`` bounds requests in
    progress (``None`` = unbounded: then no limiter is entered, so no extra schedule
    point).  Cancelling the caller cancels :meth:`_generate`.
    """

    def __init__(self, *, max_concurrency: int | None = None) -> None:
        self._limiter = trio.CapacityLimiter(max_concurrency) if max_concurrency else None
        self.requests_served = 0
        self.requests_running = 0
        self.tokens_generated = 0

    @abc.abstractmethod
    async def _generate(self, request: ModelRequest, budget: int) -> ModelResponse:
        """Generate up to ``budget`` new tokens for ``request`` (see :meth:`generate`)."""

    async def generate(self, request: ModelRequest, budget: int) -> ModelResponse:
        self.requests_running += 1
        try:
            if self._limiter is None:
                resp = await self._generate(request, budget)
            else:
                async with self._limiter:
                    resp = await self._generate(request, budget)
        finally:
            self.requests_running -= 1
        self.requests_served += 1
        self.tokens_generated += resp.output_len
        return resp

    def _base_stats(self) -> dict[str, Any]:
        """The :class:`BackendStatistics` fields, for subclasses' records."""
        return {"kind": self.kind, "version": self.version, "logprob_semantics": self.logprob_semantics,
                "requests_served": self.requests_served, "requests_running": self.requests_running,
                "tokens_generated": self.tokens_generated,
                "lora": None if self.lora is None else self.lora.statistics()}

    def statistics(self) -> BackendStatistics:
        return BackendStatistics(**self._base_stats())


class MockBackend(PerRequestBackend):
    """Turn ``async handler(request, budget) -> ModelResponse`` into a backend.  The
    handler tags tokens itself (``backend.version`` is the engine's version)."""

    kind = "mock"

    def __init__(
        self,
        handler: Callable[[ModelRequest, int], Awaitable[ModelResponse]],
        *,
        max_concurrency: int | None = None,
    ) -> None:
        super().__init__(max_concurrency=max_concurrency)
        self._handler = handler

    async def _generate(self, request: ModelRequest, budget: int) -> ModelResponse:
        return await self._handler(request, budget)


def validate_response(resp: ModelResponse, request: ModelRequest) -> None:
    """Evidence rules (ours; AReaL fixed this late, PR #1554).

    Raises:
        BackendError: naming the request id, when the logprob or version count
            differs from the token count, a logprob is NaN/inf/bool/positive or vLLM's
            -9999 sentinel, a token id is not a non-negative int, or the stop reason
            is unknown.
    """
    n = len(resp.output_tokens)
    rid = request.rid
    if len(resp.output_logprobs) != n:
        raise BackendError(f"request {rid}: {n} output_tokens but {len(resp.output_logprobs)} output_logprobs")
    if len(resp.output_versions) != n:
        raise BackendError(f"request {rid}: {n} output_tokens but {len(resp.output_versions)} output_versions")
    if _plain_evidence(resp.output_tokens, resp.output_logprobs) and resp.stop_reason in STOP_REASONS:
        return  # fast path: C-level scans; the loops below only run to name a bad element
    for i, lp in enumerate(resp.output_logprobs):
        if isinstance(lp, bool) or not isinstance(lp, (int, float)):
            raise BackendError(f"request {rid}: output_logprobs[{i}] is {type(lp).__name__}, not a float")
        try:
            bad = not math.isfinite(lp) or lp == VLLM_LOGPROB_SENTINEL or lp > 1e-4
        except OverflowError:  # an int past the float range
            bad = True
        if bad:
            raise BackendError(f"request {rid}: output_logprobs[{i}] = {lp!r} is not a valid log-probability")
    for i, tok in enumerate(resp.output_tokens):
        if isinstance(tok, bool) or not isinstance(tok, int) or tok < 0:
            raise BackendError(f"request {rid}: output_tokens[{i}] = {tok!r} is not a token id")
    if resp.stop_reason not in STOP_REASONS:
        raise BackendError(f"request {rid}: unknown stop_reason {resp.stop_reason!r}")


def _plain_evidence(tokens: list[int], logprobs: list[float]) -> bool:
    """True when every token is a plain ``int >= 0`` and every logprob a plain finite
    ``float`` <= 1e-4 other than the vLLM sentinel (exact types; anything else, ints among
    the logprobs included, takes the precise per-element path).  C-level passes only:
    the types' list counted, and ``sum``, which is NaN or +-inf iff an element is NaN or
    inf (or finite ones overflow: then the precise path decides)."""
    n = len(tokens)
    if not n:
        return True
    if list(map(type, tokens)).count(int) != n or min(tokens) < 0:
        return False
    if list(map(type, logprobs)).count(float) != n or not math.isfinite(sum(logprobs)):
        return False
    return max(logprobs) <= 1e-4 and VLLM_LOGPROB_SENTINEL not in logprobs

"""The inference backend interface: an actor that serves generation jobs.

An episode never calls a backend directly.  ``RolloutEngine.agenerate`` wraps the
request in a :class:`GenerationJob`, sends it over a bounded trio memory channel
to the backend actor (started in the engine's nursery), and awaits the reply on a
one-shot channel.  Cancelling the episode cancels ``job.cancel_scope``: a job not
yet started is skipped, a running one is interrupted (or, for batched local
generation, its row is stopped at the next token).

Backends implement :meth:`InferenceBackend.run` (the actor loop).  Most backends
serve each request independently and only implement
:meth:`PerRequestBackend.generate`; :class:`MockBackend` turns a plain async
function into a backend for tests (httpx ``MockTransport`` style).
"""

from __future__ import annotations

import abc
import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import outcome
import trio

from ..errors import BackendError
from ..types import STOP_REASONS, ModelRequest, ModelResponse

__all__ = ["GenerationJob", "InferenceBackend", "MockBackend", "PerRequestBackend", "validate_response"]

#: vLLM returns this for a logprob it could not compute.
VLLM_LOGPROB_SENTINEL = -9999.0


@dataclass(eq=False)
class GenerationJob:
    """One request in flight between an episode and the backend actor.

    Attributes:
        request: the (validated) request.
        budget: new-token budget, ``min(max_tokens - prompt_len, max_new_tokens)``.
        cancel_scope: cancelled when the episode withdraws the request
            (:meth:`withdraw`); per-request backends run the request inside it.
        enqueued_at: ``trio.current_time()`` when the job was sent (seconds).
    """

    request: ModelRequest
    budget: int
    reply_channel: trio.MemorySendChannel[outcome.Outcome[ModelResponse]]
    cancel_scope: trio.CancelScope = field(default_factory=trio.CancelScope)
    enqueued_at: float = 0.0
    #: True once the episode gave up on this job; a plain bool so that backend
    #: threads (the ``hf`` generate loop) may read it.
    withdrawn: bool = False

    def withdraw(self) -> None:
        """Give up on this job: skipped if queued, cancelled if running."""
        self.withdrawn = True
        self.cancel_scope.cancel()

    def reply(self, result: outcome.Outcome[ModelResponse]) -> None:
        """Deliver the result; silently dropped if the episode already left."""
        try:
            self.reply_channel.send_nowait(result)
        except (trio.BrokenResourceError, trio.ClosedResourceError, trio.WouldBlock):
            pass


class InferenceBackend(abc.ABC):
    """An inference server seen as an actor.

    Attributes:
        version: the current policy version (weights generation); tokens are
            tagged with the version read *before* each segment is sent (AReaL PR #1569).
        logprob_semantics: which distribution ``output_logprobs`` come from:
            ``"processed"`` (after temperature/top-k/top-p, SGLang's default) or
            ``"raw"`` (before, vLLM's default).
    """

    version: int = 0
    logprob_semantics: str = "processed"

    @abc.abstractmethod
    async def run(
        self,
        jobs: trio.MemoryReceiveChannel[GenerationJob],
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Serve jobs until ``jobs`` is closed (``EndOfChannel``) or cancelled.

        Must call ``task_status.started()`` once ready; a start-up failure is raised
        before that.  Every job received must get exactly one ``job.reply(...)``
        unless it was withdrawn.
        """

    async def aclose(self) -> None:
        """Release resources (models, HTTP clients).  Idempotent."""

    def statistics(self) -> dict[str, Any]:
        """A snapshot of backend counters (requests, tokens); cheap, sync."""
        return {"version": self.version}


class PerRequestBackend(InferenceBackend):
    """A backend that serves each request on its own task.

    Subclasses implement :meth:`generate`.  ``max_concurrency`` bounds requests
    in progress (``None`` = unbounded); withdrawn jobs are skipped, running ones
    are cancelled through ``job.cancel_scope``.
    """

    def __init__(self, *, max_concurrency: int | None = None) -> None:
        self._limiter = trio.CapacityLimiter(max_concurrency if max_concurrency else math.inf)
        self.requests_served = 0
        self.tokens_generated = 0

    @abc.abstractmethod
    async def generate(self, request: ModelRequest, budget: int) -> ModelResponse:
        """Generate up to ``budget`` new tokens for ``request``."""

    async def run(self, jobs, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            task_status.started()
            async with jobs:
                async for job in jobs:
                    if not job.withdrawn:
                        nursery.start_soon(self._serve_one, job)

    async def serve_inline(self, request: ModelRequest, budget: int) -> ModelResponse:
        """Serve one request on the caller's task: what :meth:`run` does for a job,
        without the channel hop and the extra task (the engine's path for
        per-request backends; the actor still runs, for backends that keep shared
        state in it).  Same limiter and counters; cancelling the caller cancels
        :meth:`generate`."""
        if self._limiter.total_tokens == math.inf:  # unlimited: skip the limiter's schedule point (a run-queue pass)
            resp = await self.generate(request, budget)
        else:
            async with self._limiter:
                resp = await self.generate(request, budget)
        self.requests_served += 1
        self.tokens_generated += resp.output_len
        return resp

    async def _serve_one(self, job: GenerationJob) -> None:
        with job.cancel_scope:
            async with self._limiter:
                result = await outcome.acapture(self.generate, job.request, job.budget)
            if isinstance(result, outcome.Value):
                self.requests_served += 1
                self.tokens_generated += result.value.output_len
            job.reply(result)

    def statistics(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "requests_served": self.requests_served,
            "requests_running": self._limiter.borrowed_tokens,
            "tokens_generated": self.tokens_generated,
        }


class MockBackend(PerRequestBackend):
    """Turn ``async handler(request, budget) -> ModelResponse`` into a backend."""

    def __init__(
        self,
        handler: Callable[[ModelRequest, int], Awaitable[ModelResponse]],
        *,
        max_concurrency: int | None = None,
    ) -> None:
        super().__init__(max_concurrency=max_concurrency)
        self._handler = handler

    async def generate(self, request: ModelRequest, budget: int) -> ModelResponse:
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
        if not math.isfinite(lp) or lp == VLLM_LOGPROB_SENTINEL or lp > 1e-4:
            raise BackendError(f"request {rid}: output_logprobs[{i}] = {lp!r} is not a valid log-probability")
    for i, tok in enumerate(resp.output_tokens):
        if isinstance(tok, bool) or not isinstance(tok, int) or tok < 0:
            raise BackendError(f"request {rid}: output_tokens[{i}] = {tok!r} is not a token id")
    if resp.stop_reason not in STOP_REASONS:
        raise BackendError(f"request {rid}: unknown stop_reason {resp.stop_reason!r}")


_INT_ONLY = frozenset({int})
_REAL_TYPES = frozenset({int, float})


def _plain_evidence(tokens: list[int], logprobs: list[float]) -> bool:
    """True when every token is a plain ``int >= 0`` and every logprob a plain
    finite ``int``/``float`` <= 1e-4 other than the vLLM sentinel (exact types;
    anything else takes the precise per-element path)."""
    if not tokens:
        return True
    if not set(map(type, tokens)) <= _INT_ONLY or min(tokens) < 0:
        return False
    if not set(map(type, logprobs)) <= _REAL_TYPES or any(map(math.isnan, logprobs)):
        return False
    return max(logprobs) <= 1e-4 and min(logprobs) > -math.inf and VLLM_LOGPROB_SENTINEL not in logprobs

"""``HFBackend(mode="continuous")``: transformers' continuous batching, bridged to trio.

transformers' ``ContinuousBatchingManager`` runs its decoding loop in a
background thread; requests join and leave the running batch independently.
Its result handlers are asyncio-only, so a pump thread drains ``get_result``
and routes each streamed output into the trio loop (``trio.from_thread``), as
measured in ``TOOLING_NOTES.md`` §5.  One trio task per request waits for its
result inside the job's cancel scope; withdrawing the job cancels the request in
the manager (its slot is freed).

Supported per request: ``temperature``, ``top_k``, ``top_p`` (per-request
logits processors), the token budget (clamped to the model's context length, a
prompt at or over it refused, as in static mode), stop token ids / EOS (``ignore_eos``
honoured) and stop strings (checked on streamed text; the request is cancelled
at the match).  Not supported (a clear :class:`InvalidRequestError`; use
``mode="static"``): ``greedy``, ``seed``, ``min_new_tokens``,
``frequency_penalty``, ``image_data``.  Logprobs are those of transformers' ``return_logprobs``:
the log-softmax of the processed scores, the same semantics as static mode.

Weight sync (driven by :class:`~engine.backends.hf.HFBackend`): :meth:`ContinuousBatcher.pause`
closes the gate (new requests wait); ``"abort"`` cancels every running request and replies
``"abort"`` with its tokens so far (the engine resumes them); both modes then hold
``manager.pause()`` (between two decoding steps; cache and requests kept) and,
``"in_place"``, wait until the pump has routed every output produced before the pause.
:meth:`ContinuousBatcher.weights_loaded` records, after the weights were swapped, the
version boundary of every request still running; :meth:`ContinuousBatcher.resume`
releases the manager and opens the gate.
"""

from __future__ import annotations

import itertools
import math
import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import outcome
import trio

from ...errors import BackendError, InvalidRequestError
from ...types import ModelResponse, StopReason
from ..lora import AdapterLease
from ._gate import Gate
from ._jobs import Batcher, BatcherCounts, GenerationJob
from ._lora import HFAdapters
from ._model import LoadedModel, stop_ids, tag_versions

__all__ = ["ContinuousBatcher"]

#: the base warpers must exist for per-request values to apply (transformers
#: only builds a warper whose config value is not neutral)
_BASE_TEMPERATURE, _BASE_TOP_P = 0.5, 0.5


@dataclass(eq=False)
class _Live:
    job: GenerationJob
    rid: str
    version: int
    stop_ids: frozenset[int]
    start: float
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    boundaries: list[tuple[int, int]] = field(default_factory=list)
    ttft: float | None = None
    result: outcome.Outcome[ModelResponse] | None = None
    done: trio.Event = field(default_factory=trio.Event)
    lease: AdapterLease | None = None


class ContinuousBatcher(Batcher):
    """Continuous batching over ``lm`` (see the module docstring).

    Args:
        lm: the backend's loaded model.
        current_version: the policy version tokens are tagged with, read before each request.
        max_batch_size: requests per decoding step.
        cache_tokens: KV-cache size, in tokens.
        page_size: tokens per KV-cache block.
        adapters: the backend's LoRA adapters (``None``: none).  peft's active adapter is
            the model's, shared by every running request: the current version, switched
            only inside a weight sync (the manager held); each request leases it.
    """

    def __init__(self, lm: LoadedModel, current_version: Callable[[], int], *, max_batch_size: int,
                 cache_tokens: int, page_size: int = 32,
                 adapters: Callable[[], HFAdapters | None] = lambda: None) -> None:
        self.lm = lm
        self.current_version = current_version
        self.adapters = adapters
        self.max_batch_size = max_batch_size
        self.gate = Gate()  # open unless a weight sync holds new requests
        self._stats: Counter[str] = Counter()
        self._pause_cm: Any = None
        self.cache_tokens = cache_tokens
        self.page_size = page_size
        self.manager: Any = None
        self._live: dict[str, _Live] = {}
        self._ids = itertools.count()
        self._pump_lock = threading.Lock()
        self._token: trio.lowlevel.TrioToken | None = None

    # -- lifecycle ---------------------------------------------------------------------
    def _start_manager(self) -> None:
        import torch
        from transformers import ContinuousBatchingConfig, GenerationConfig

        lm = self.lm
        gen = GenerationConfig(do_sample=True, temperature=_BASE_TEMPERATURE, top_k=lm.vocab_size,
                               top_p=_BASE_TOP_P, eos_token_id=-1, max_new_tokens=1024,
                               pad_token_id=lm.tokenizer.pad_token_id or 0)
        try:
            cbc = ContinuousBatchingConfig(
                page_size=self.page_size, num_blocks=max(4, math.ceil(self.cache_tokens / self.page_size)),
                max_batch_tokens=max(self.page_size, min(self.cache_tokens, 4096)),
                max_requests_per_batch=self.max_batch_size, return_logprobs=True, per_request_processors=True,
                # no prefix sharing: cached blocks would outlive a weight update (stale KV)
                allow_block_sharing=False,
            )
        except TypeError as exc:  # an older transformers (5.17 has no page_size): seen on a GPU machine
            import transformers

            raise BackendError(f"hf backend mode='continuous' needs a transformers whose ContinuousBatchingConfig "
                               f"takes page_size/return_logprobs/per_request_processors/allow_block_sharing "
                               f"(tested with 5.24; this is {transformers.__version__}: {exc}); "
                               f"upgrade transformers or use mode='static'") from exc
        with torch.inference_mode():
            self.manager = lm.model.init_continuous_batching(generation_config=gen, continuous_batching_config=cbc)
        self.manager.start()

    async def run(self, jobs: trio.MemoryReceiveChannel[GenerationJob], *,
                  task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        self._token = trio.lowlevel.current_trio_token()
        await trio.to_thread.run_sync(self._start_manager)
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._run_pump)
                task_status.started()
                async with jobs:
                    async for job in jobs:
                        if job.withdrawn:
                            continue
                        problem = self.unsupported(job) or self.lm.fit_context(job)
                        if problem:
                            job.reply(outcome.Error(InvalidRequestError(f"request {job.request.rid}: {problem}")))
                            continue
                        await self.gate.wait_open()
                        nursery.start_soon(self._serve, job)
                nursery.cancel_scope.cancel()
        finally:
            with trio.CancelScope(shield=True):
                await trio.to_thread.run_sync(self._stop_manager)

    async def _run_pump(self) -> None:
        await trio.to_thread.run_sync(self._pump, abandon_on_cancel=True)

    def _stop_manager(self) -> None:
        if self.manager is not None:
            self.manager.stop(block=True)
            self.lm.model.destroy_cached_continuous_batching_manager()
            self.manager = None

    @staticmethod
    def unsupported(job: GenerationJob) -> str | None:
        g = job.request.gconfig
        if job.request.image_data is not None:  # transformers' continuous batching takes token ids only
            return "hf backend mode='continuous' does not support image_data (image inputs); use mode='static'"
        for name, bad in (("greedy", g.greedy), ("seed", g.seed is not None), ("min_new_tokens", g.min_new_tokens),
                          ("frequency_penalty", g.frequency_penalty)):
            if bad:
                return f"hf backend mode='continuous' does not support gconfig.{name}; use mode='static'"
        return None

    # -- one request -----------------------------------------------------------------------
    async def _serve(self, job: GenerationJob) -> None:
        req, g = job.request, job.request.gconfig
        live = _Live(job, f"{req.rid}#{next(self._ids)}", self.current_version(),  # read before sending (PR #1569)
                     frozenset(stop_ids(self.lm.tokenizer, req)), trio.current_time())
        adapters = self.adapters()
        if adapters is not None and adapters.versions.current() is not None:
            live.lease = adapters.versions.acquire()  # the active adapter (read with the version)
        self._live[live.rid] = live
        self._stats["requests_running"] += 1
        try:
            with job.cancel_scope:
                self.manager.add_request(
                    list(req.input_ids), request_id=live.rid, max_new_tokens=job.budget, streaming=True,
                    eos_token_id=sorted(live.stop_ids) or -1, temperature=float(max(g.temperature, 1e-5)),
                    top_k=int(min(g.top_k, self.lm.vocab_size)), top_p=float(g.top_p),
                )
                await live.done.wait()
        finally:
            self._stats["requests_running"] -= 1
            if self._live.pop(live.rid, None) is not None and live.result is None:
                self.manager.cancel_request(live.rid)  # withdrawn: free its slot
            self._release(live)  # (withdrawn; else _finish did)
        if live.result is not None and not job.withdrawn:
            job.reply(live.result)

    def _pump(self) -> None:
        """Worker thread: route every streamed output into the trio loop, all the outputs
        queued at that moment in one call (a decoding step streams one output per running
        request: one trio round trip each, 32 per step at 32 rows, each a GIL hand-off
        between this thread, the trio thread and the decoding thread).  Holds
        ``_pump_lock`` from taking an output until it is routed."""
        manager = self.manager
        while manager is not None and manager.is_running():
            with self._pump_lock:
                out = manager.get_result(timeout=0.05)
                if out is None:
                    continue
                outs = [out]
                while (more := manager.get_result(timeout=0)) is not None:
                    outs.append(more)
                try:
                    trio.from_thread.run_sync(self._route_all, outs, trio_token=self._token)
                except trio.RunFinishedError:
                    return

    def _route_all(self, outs: list[Any]) -> None:
        for out in outs:
            self._route(out)

    def _route(self, out: Any) -> None:
        live = self._live.get(out.request_id)
        if live is None:
            return  # withdrawn or already answered (abort)
        if live.ttft is None and out.generated_tokens:
            live.ttft = trio.current_time() - live.start
        live.tokens = list(out.generated_tokens)
        live.logprobs = [float(x) for x in out.logprobs]
        stop_hit = self._stop_string_cut(live)
        if out.error:
            self._finish(live, error=BackendError(f"request {live.job.request.rid}: {out.error}"))
        elif stop_hit or out.is_finished():
            self._finish(live)

    def _stop_string_cut(self, live: _Live) -> bool:
        k = self.lm.stop_string_cut(live.tokens, live.job.request.gconfig.stop)
        if k is None:
            return False
        del live.tokens[k:], live.logprobs[k:]  # the cut is at the match
        self.manager.cancel_request(live.rid)
        return True

    def _release(self, live: _Live) -> None:
        lease, live.lease = live.lease, None
        adapters = self.adapters()
        if lease is not None and adapters is not None:
            adapters.versions.release(lease)  # a retired version is deleted inside the weight sync

    def _finish(self, live: _Live, *, error: Exception | None = None, aborted: bool = False) -> None:
        self._live.pop(live.rid, None)
        self._release(live)
        if error is not None:
            live.result = outcome.Error(error)
        else:
            n = min(len(live.tokens), live.job.budget)
            tokens, logprobs = live.tokens[:n], live.logprobs[:n]
            reason: StopReason
            if tokens and tokens[-1] in live.stop_ids:
                reason = "stop"
            elif n >= live.job.budget:
                reason = "length"
            elif aborted:
                reason = "abort"
            else:
                reason = "stop"  # a stop string
            versions = tag_versions(live.version, n, live.boundaries)
            self._stats["requests_served"] += 1
            self._stats["tokens_generated"] += n
            self._stats["aborts"] += reason == "abort"
            live.result = outcome.Value(ModelResponse(
                input_tokens=list(live.job.request.input_ids), output_tokens=tokens, output_logprobs=logprobs,
                output_versions=versions, stop_reason=reason, latency=trio.current_time() - live.start,
                ttft=live.ttft if live.ttft is not None else float("inf"),
            ))
        live.done.set()

    # -- weight sync (Batcher) -----------------------------------------------------------------
    async def pause(self, mode: str) -> None:
        """Hold new requests; ``"abort"``: answer every running request ``"abort"``; then
        hold the manager between two steps (``"in_place"``: once every earlier output is routed)."""
        self.gate.close()
        if self.manager is None:  # not running (not open yet, or closed): nothing in flight
            return
        if mode == "abort":
            for live in list(self._live.values()):
                self.manager.cancel_request(live.rid)
                self._finish(live, aborted=True)
        cm = self.manager.pause()
        await trio.to_thread.run_sync(cm.__enter__)
        self._pause_cm = cm
        if mode == "in_place":
            await trio.to_thread.run_sync(self._wait_routed)

    def weights_loaded(self, version: int) -> None:
        """The weights changed (manager held): later tokens of running requests carry ``version``."""
        for live in self._live.values():
            live.boundaries.append((len(live.tokens), version))

    def move_leases(self, move: Callable[[AdapterLease], AdapterLease]) -> None:
        for live in self._live.values():
            if live.lease is not None:
                live.lease = move(live.lease)

    async def resume(self) -> None:
        cm, self._pause_cm = self._pause_cm, None
        if cm is not None:
            await trio.to_thread.run_sync(cm.__exit__, None, None, None)
        self.gate.open()

    def counts(self) -> BatcherCounts:
        s = self._stats
        return BatcherCounts(requests_served=s["requests_served"], requests_running=s["requests_running"],
                             tokens_generated=s["tokens_generated"], aborts=s["aborts"])

    def _wait_routed(self) -> None:
        """Thread, loop paused: return once every output produced before the
        pause has been routed (the pump holds its lock from get to route)."""
        queue = self.manager.output_router.output_queue
        pause = threading.Event()
        while True:
            with self._pump_lock:
                if queue.empty():
                    return
            pause.wait(0.001)  # let the pump take the lock

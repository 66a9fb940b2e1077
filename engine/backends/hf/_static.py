"""``HFBackend(mode="static")``: one static, left-padded ``model.generate`` per batch.

The batcher takes every request queued at the moment it becomes free (up to
``max_batch_size``, collecting more while they keep arriving within ``batch_window_s``),
groups them by sampling parameters, and runs one ``generate`` per group in a worker
thread.  Each row stops at its own budget or at its first stop token; a withdrawn
(cancelled) row is stopped at the next token through a stopping criterion.

Sampling and seeds: every row samples with its own ``torch.Generator``, seeded with its
request's ``gconfig.seed`` (or a random seed), by inverse CDF over the processed
distribution (:class:`_SampleRows`); ``generate`` itself runs greedy over the one token
left.  So the same seed gives the same tokens whatever the batch, and torch's global RNG
is never used (it belongs to the host, e.g. a trainer in the same process).

Logprobs: ``log_softmax`` of the processed scores at the sampled token, captured at each
step by :class:`_CaptureLogprobs`, placed after our warpers (temperature, top-k, top-p).

Weight sync: :class:`~._gate.StepGate`; :class:`_RowStop` calls it after every step.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from typing import Any

import outcome
import torch
import trio

from ...errors import BackendError, InvalidRequestError
from ...types import ModelRequest, ModelResponse, StopReason
from ..lora import AdapterLease
from ._gate import StepGate
from ._jobs import Batcher, BatcherCounts, GenerationJob
from ._lora import HFAdapters
from ._model import NO_TOP_K, LoadedModel, stop_ids, tag_versions

__all__ = ["StaticBatcher", "generation_config"]

logger = logging.getLogger(f"rollout.{__name__}")  # the package's one logging namespace

#: one generated row: (tokens, logprobs, stop reason)
Row = tuple[list[int], list[float], StopReason]


def _adapter_key(job: GenerationJob) -> tuple:
    """Rows of one batch compute with one adapter: a pinned version, or a name's current one."""
    return ("pinned", job.lease.served_name) if job.lease is not None else ("name", job.request.lora_name)


def _batch_key(req: ModelRequest) -> tuple:
    """Requests with equal keys share one ``generate`` call (seeds do not matter:
    each row has its own generator)."""
    g = req.gconfig
    return (
        g.greedy,
        None if g.greedy else g.temperature,
        None if g.greedy else g.top_p,
        None if g.greedy or g.top_k >= NO_TOP_K else g.top_k,
        g.min_new_tokens,
        tuple(g.stop_token_ids),
        g.ignore_eos,
    )


def generation_config(*, max_new_tokens: int, min_new_tokens: int, eos_token_id: list[int] | None,
                      pad_token_id: int) -> Any:
    """The ``GenerationConfig`` of a static batch: greedy (``do_sample=False``) over our
    processed distribution, sampling flags at transformers' neutral values.

    Every sampling flag is set, so that ``generate`` fills none of them from the model's
    ``generation_config.json`` (e.g. Qwen's ``top_k=20``), and each at the value
    transformers treats as unset (temperature 1, top-p 1, top-k 50): a greedy config that
    sets any other value is flagged ("generation flags are not valid") on every call.
    ``generate`` uses none of them with ``do_sample=False``: our own warpers sample.
    """
    from transformers import GenerationConfig

    return GenerationConfig(
        max_new_tokens=max_new_tokens,
        min_new_tokens=min_new_tokens or None,
        do_sample=False,
        temperature=1.0,
        top_p=1.0,
        top_k=50,
        repetition_penalty=1.0,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
    )


class _CaptureLogprobs:
    """A logits processor, after the warpers: keeps ``log_softmax`` of the processed
    scores (the distribution that is sampled) of the current step, ``[B, V]`` float32."""

    last: torch.Tensor

    def __call__(self, ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.last = torch.log_softmax(scores.float(), dim=-1)
        return scores


class _SampleRows:
    """A logits processor, after the capture, when sampling: draws each row's token with
    the row's own uniforms (inverse CDF of the processed distribution) and leaves only
    that token, so that ``generate``'s greedy argmax picks it.  A row's tokens depend
    only on its seed and its prefix, not on the batch it shares.

    Args:
        uniforms: ``[B, max budget]`` float32 in ``[0, 1)``, one row per request.
        width: the padded prompt length (step ``s`` is at ``ids.shape[1] == width + s``).
    """

    def __init__(self, uniforms: torch.Tensor, width: int) -> None:
        self.uniforms = uniforms
        self.width = width

    def __call__(self, ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:  # scores: [B, V]
        step = ids.shape[1] - self.width
        probs = torch.softmax(scores.float(), dim=-1)  # [B, V]
        cdf = probs.cumsum(dim=-1)  # [B, V]
        u = self.uniforms[:, step] * cdf[:, -1]  # [B]
        pick = torch.searchsorted(cdf, u[:, None], right=True).clamp_max(cdf.shape[1] - 1)  # [B, 1]
        zero = probs.gather(1, pick) <= 0  # rounding at the top end of the CDF
        pick = torch.where(zero, probs.argmax(dim=-1, keepdim=True), pick)
        return torch.full_like(scores, -math.inf).scatter_(1, pick, 0.0)


class _RowStop:
    """The stopping criterion, called after every decoding step: records the step's
    logprobs; stops a row at its own budget or once its episode withdrew it; stops all
    rows for an abort-mode weight update; parks for an in-place one (:meth:`StepGate.at_step`)."""

    def __init__(self, group: list[GenerationJob], width: int, capture: _CaptureLogprobs, gate: StepGate,
                 boundaries: list[tuple[int, int]]) -> None:
        self.group = group
        self.budgets = [job.budget for job in group]
        self.width = width
        self.capture = capture
        self.gate = gate
        self.boundaries = boundaries
        self.step_logprobs: list[torch.Tensor] = []  # one [B] tensor per decoding step
        self.t0 = time.perf_counter()
        self.first_token_s = 0.0
        self.aborted = False

    def __call__(self, ids: torch.Tensor, scores: Any, **kwargs: Any) -> torch.Tensor:  # ids: [B, width + steps]
        self.step_logprobs.append(self.capture.last.gather(1, ids[:, -1:]).squeeze(1))  # [B]
        steps = ids.shape[1] - self.width
        if steps == 1:
            self.first_token_s = time.perf_counter() - self.t0
        if self.gate.at_step(steps, self.boundaries):
            self.aborted = True
            return torch.ones(len(self.group), dtype=torch.bool, device=ids.device)
        done = [steps >= b or job.withdrawn for b, job in zip(self.budgets, self.group)]
        return torch.tensor(done, dtype=torch.bool, device=ids.device)


class StaticBatcher(Batcher):
    """Static batching over ``lm`` (see the module docstring).

    Args:
        lm: the backend's loaded model.
        current_version: the policy version tokens are tagged with, read before each batch.
        max_batch_size: requests per ``generate`` call.
        batch_window_s: keep collecting while requests arrive within this many seconds.
        adapters: the backend's LoRA adapters, read before each batch (``None``: none):
            a batch takes a lease on the current version, with its version, and makes it
            the active adapter before it starts (:mod:`._lora`).
    """

    def __init__(self, lm: LoadedModel, current_version: Callable[[], int], *, max_batch_size: int,
                 batch_window_s: float, adapters: Callable[[], HFAdapters | None] = lambda: None) -> None:
        self.lm = lm
        self.current_version = current_version
        self.adapters = adapters
        self._leases: list[AdapterLease] = []  # the running batch's adapter, one lease per row (taken here)
        self._adapter: str | None = None  # the served adapter the running batch computes with (None: the base)
        self.max_batch_size = max_batch_size
        self.batch_window_s = batch_window_s
        self.gate = StepGate()
        self._stats: Counter[str] = Counter()
        self._waiting = 0  # requests received, not yet in a running batch

    # -- Batcher --------------------------------------------------------------------------
    async def run(self, jobs: trio.MemoryReceiveChannel[GenerationJob], *,
                  task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        async with jobs:
            while True:
                try:
                    batch = await self._collect(jobs)
                except trio.EndOfChannel:
                    return
                groups: dict[tuple, list[GenerationJob]] = defaultdict(list)
                for job in batch:
                    if job.withdrawn:
                        continue
                    problem = self.lm.unsupported(job.request) or self.lm.fit_context(job)
                    if problem:
                        job.reply(outcome.Error(InvalidRequestError(f"request {job.request.rid}: {problem}")))
                        continue
                    # seeded rows too: each has its own generator; one adapter per batch
                    groups[(_batch_key(job.request), _adapter_key(job))].append(job)
                self._waiting = sum(len(g) for g in groups.values())
                for group in groups.values():
                    await self.gate.wait_startable()  # no batch starts during a weight sync or a change
                    self._waiting -= len(group)
                    await self._run_group(group)

    async def pause(self, mode: str) -> None:
        await self.gate.pause(mode)

    def weights_loaded(self, version: int) -> None:
        self.gate.mark_boundary(version)

    def move_leases(self, move: Callable[[AdapterLease], AdapterLease]) -> None:
        self._leases = [move(lease) for lease in self._leases]
        if self._leases:
            self._adapter = self._leases[0].served_name

    def exclusive(self) -> AbstractAsyncContextManager[None]:
        return self.gate.exclusive()

    def reactivate(self) -> None:
        adapters = self.adapters()
        if adapters is not None and self.gate.running:
            adapters.activate(self._adapter)

    def idle(self) -> bool:
        """No batch runs and no change is under way: the model may be changed now, on the
        trio thread, without a checkpoint (``HFBackend`` drops drained adapters then)."""
        return not self.gate.running and self.gate.free

    async def resume(self) -> None:
        self.gate.resume()

    def counts(self) -> BatcherCounts:
        s = self._stats
        return BatcherCounts(
            requests_served=s["requests_served"], requests_running=s["requests_running"],
            tokens_generated=s["tokens_generated"], aborts=s["aborts"], requests_waiting=self._waiting,
            batches=s["batches"], batch_occupancy=s["batch_occupancy_sum"] / s["batches"] if s["batches"] else 0.0,
            decode_steps=self.gate.steps_run,
        )

    # -- batching ---------------------------------------------------------------------------
    async def _collect(self, jobs: trio.MemoryReceiveChannel[GenerationJob]) -> list[GenerationJob]:
        """The next batch.  A burst of episodes (each tokenising its prompt first)
        trickles in: keep collecting while requests keep arriving within the window.

        Raises:
            trio.EndOfChannel: the channel closed with nothing queued.
        """
        batch = [await jobs.receive()]
        while len(batch) < self.max_batch_size:
            try:
                batch.append(jobs.receive_nowait())
                continue
            except trio.EndOfChannel:
                break
            except trio.WouldBlock:
                pass
            if not self.batch_window_s:
                break
            with trio.move_on_after(self.batch_window_s):
                try:
                    batch.append(await jobs.receive())
                    continue
                except trio.EndOfChannel:
                    break
            break
        return batch

    async def _run_group(self, group: list[GenerationJob]) -> None:
        adapters = self.adapters()
        if adapters is not None:
            adapters.drop_retired()  # (no batch computes here, no change is under way)
            pinned = group[0].lease  # a named adapter the caller holds (the whole group: one key)
            try:  # else a lease on the current version, read with the version, before the batch is sent
                self._leases = [] if pinned else [
                    lease for job in group if (lease := adapters.lease_for(job.request.lora_name)) is not None]
            except InvalidRequestError as exc:  # unloaded since it was submitted
                for job in group:
                    job.reply(outcome.Error(InvalidRequestError(f"request {job.request.rid}: {exc}")))
                return
            self._adapter = pinned.served_name if pinned else self._leases[0].served_name if self._leases else None
            adapters.activate(self._adapter)
        version = self.current_version()  # read before the segment is sent (AReaL PR #1569)
        start = trio.current_time()
        self._stats["batches"] += 1
        self._stats["requests_running"] = len(group)
        self._stats["batch_occupancy_sum"] += len(group)
        boundaries: list[tuple[int, int]] = []  # (step, version) of in-place updates
        try:
            rows, first_token_s = await self.gate.run_batch(self._generate, group, boundaries)
        except Exception as exc:  # a backend failure fails this group's requests only
            logger.exception("hf backend: generate failed for %d requests", len(group))
            for job in group:
                job.reply(outcome.Error(BackendError(f"request {job.request.rid}: generate failed: {exc!r}")))
            return
        finally:
            self._stats["requests_running"] = 0
            leases, self._leases = self._leases, []
            for lease in leases:
                adapters.versions.release(lease)  # type: ignore[union-attr]
            if adapters is not None and self.gate.free:
                adapters.drop_retired()  # a version drained by this batch goes now (no batch computes)
        end = trio.current_time()
        for job, row in zip(group, rows):
            if job.withdrawn:
                continue
            if isinstance(row, BaseException):  # this request's images could not be read
                job.reply(outcome.Error(row))
                continue
            tokens, logprobs, reason = row
            self._stats["requests_served"] += 1
            self._stats["tokens_generated"] += len(tokens)
            self._stats["aborts"] += reason == "abort"
            job.reply(outcome.Value(ModelResponse(
                input_tokens=list(job.request.input_ids), output_tokens=tokens, output_logprobs=logprobs,
                output_versions=tag_versions(version, len(tokens), boundaries), stop_reason=reason,
                latency=end - start, ttft=first_token_s,
            )))

    # -- generation (runs in a worker thread) --------------------------------------------------
    def _generate(self, group: list[GenerationJob],
                  boundaries: list[tuple[int, int]]) -> tuple[list[Row | InvalidRequestError], float]:
        """Generate for ``group``; a request whose images cannot be read gets its
        :class:`InvalidRequestError` in place of its row, the others still run."""
        image_kwargs: dict[str, Any] = {}
        errors: dict[int, InvalidRequestError] = {}
        if any(job.request.image_data for job in group):
            from ._images import image_inputs

            image_kwargs, errors = image_inputs([job.request for job in group], self.lm.processor,
                                                device=self.lm.device, dtype=self.lm.model.dtype)
        live = [job for i, job in enumerate(group) if i not in errors]
        rows, first_token = self._generate_rows(live, boundaries, image_kwargs) if live else ([], 0.0)
        produced = iter(rows)
        return [errors[i] if i in errors else next(produced) for i in range(len(group))], first_token

    def _processors(self, group: list[GenerationJob], width: int, capture: _CaptureLogprobs) -> Any:
        """Warpers in transformers' order, then the capture, then (sampling) the per-row
        draw.  ``generate`` runs greedy, so it builds no warpers of its own and never
        draws from the global RNG."""
        from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

        g = group[0].request.gconfig
        processors = LogitsProcessorList()
        if not g.greedy:
            if g.temperature != 1.0:
                processors.append(TemperatureLogitsWarper(max(g.temperature, 1e-5)))
            if g.top_k < NO_TOP_K:
                processors.append(TopKLogitsWarper(g.top_k))
            if g.top_p < 1.0:
                processors.append(TopPLogitsWarper(g.top_p))
        processors.append(capture)
        if not g.greedy:  # one generator per row: its request's seed, else a fresh random one
            steps = max(job.budget for job in group)
            uniforms = torch.stack([  # [B, max budget] float32 in [0, 1)
                torch.rand(steps, generator=torch.Generator().manual_seed(
                    job.request.gconfig.seed if job.request.gconfig.seed is not None
                    else int.from_bytes(os.urandom(8), "big") >> 1))
                for job in group
            ]).to(self.lm.device)
            processors.append(_SampleRows(uniforms, width))
        return processors

    def _generate_rows(self, group: list[GenerationJob], boundaries: list[tuple[int, int]],
                       image_kwargs: dict[str, Any]) -> tuple[list[Row], float]:
        from transformers import StoppingCriteriaList

        tokenizer = self.lm.tokenizer
        stops = stop_ids(tokenizer, group[0].request)
        pad_id = tokenizer.pad_token_id
        if pad_id is None:
            pad_id = next(iter(stops), 0)
        prompts = [job.request.input_ids for job in group]
        width = max(len(p) for p in prompts)
        input_ids = torch.full((len(group), width), pad_id, dtype=torch.long)
        attention = torch.zeros((len(group), width), dtype=torch.long)
        for i, p in enumerate(prompts):  # left padding
            input_ids[i, width - len(p):] = torch.tensor(p)
            attention[i, width - len(p):] = 1
        capture = _CaptureLogprobs()
        processors = self._processors(group, width, capture)
        row_stop = _RowStop(group, width, capture, self.gate, boundaries)
        budgets = row_stop.budgets
        gen_cfg = generation_config(max_new_tokens=max(budgets), min_new_tokens=group[0].request.gconfig.min_new_tokens,
                                    eos_token_id=sorted(stops) or None, pad_token_id=pad_id)
        with torch.inference_mode():
            sequences = self.lm.model.generate(
                input_ids=input_ids.to(self.lm.device), attention_mask=attention.to(self.lm.device),
                generation_config=gen_cfg, logits_processor=processors,
                stopping_criteria=StoppingCriteriaList([row_stop]), **image_kwargs,
            )
        logprobs = torch.stack(row_stop.step_logprobs, dim=1).cpu().tolist()  # [B, steps]
        gen = sequences[:, width:].tolist()  # [B, steps]
        rows = []
        for i, job in enumerate(group):
            tokens, lps, reason = self._trim(job.request, gen[i], logprobs[i], budgets[i], stops)
            if row_stop.aborted and reason == "length" and len(tokens) < budgets[i]:
                reason = "abort"  # interrupted by a weight update: the engine resumes it
            rows.append((tokens, lps, reason))
        return rows, row_stop.first_token_s

    def _trim(self, req: ModelRequest, tokens: list[int], logprobs: list[float], budget: int,
              stops: set[int]) -> Row:
        """Cut a generated row at its first stop token (kept), stop string, or budget."""
        n = min(len(tokens), budget)
        reason: StopReason = "length"
        for k in range(n):
            if k + 1 >= req.gconfig.min_new_tokens and tokens[k] in stops:
                n, reason = k + 1, "stop"
                break
        cut = self.lm.stop_string_cut(tokens[:n], req.gconfig.stop)
        if cut is not None:
            n, reason = cut, "stop"
        return tokens[:n], logprobs[:n], reason

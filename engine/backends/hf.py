"""``hf``: a local transformers model served by a batcher inside the backend (CPU, or CUDA).

``generate`` puts the segment on the backend's own job queue (:mod:`engine.backends._jobs`)
and awaits the reply; the batcher runs inside :meth:`HFBackend.open` (loading the model
first).  Static mode: the batcher takes every request queued at the moment it becomes free
(up to ``max_batch_size``), groups them by sampling parameters, and runs one static,
left-padded ``model.generate`` per group in a worker thread.  Each row stops at its own
budget or at its first stop token; a withdrawn (cancelled) row is stopped at the next token
through a ``StoppingCriteria``.  Continuous mode: :mod:`engine.backends._hf_continuous`.

Sampling and seeds (ours): every row of a batch samples with its own
``torch.Generator``, seeded with its request's ``gconfig.seed`` (or a random
seed), by inverse CDF over the processed distribution; ``generate`` itself runs
greedy over the one token left.  So seeded requests are batched like any other,
the same seed gives the same tokens whatever the batch, and torch's global RNG
is never used (it belongs to the host, e.g. a trainer in the same process).

Context length: a prompt at or over the model's ``max_position_embeddings`` is
refused (:class:`InvalidRequestError` naming ``input_ids``) and the budget is
clamped so that prompt + output never exceeds it, as ``rollout serve`` does.

Logprobs: ``output_logprobs[i]`` is ``log_softmax`` of the *processed* scores at
the sampled token, i.e. of the distribution that was actually sampled (after
temperature, top-k and top-p), captured at each decoding step by a logits
processor placed after the warpers.  With ``temperature=1``,
no top-k/top-p, or greedy decoding this equals the model's raw next-token
log-probability (what a teacher-forced forward pass gives).  Every backend of this
package reports this kind (SGLang by default; vLLM with ``--logprobs-mode
processed_logprobs``, which the ``vllm`` backend checks).

Versions: every token of a segment carries ``self.version`` (told by the engine) read
before the segment starts (AReaL PR #1569); after an in-place weight update, tokens
decoded with the new weights carry the update's version.

Weight updates (:class:`~engine.backends.base.WeightSync`: ``pause``, ``update_weights``,
``resume``; ``engine.update_weights`` drives them), two modes:

* ``"abort"``: the running batch stops at its next decoding step; unfinished
  rows return ``stop_reason="abort"`` with their partial tokens, the weights
  load, and after ``resume`` the engine re-sends prompt + partial output
  (re-prefilled with the new weights).
* ``"in_place"``: the running batch parks between two decoding steps, the
  weights are copied into the same parameters, and decoding continues after
  ``resume`` (the KV cache of earlier tokens keeps the old weights' keys/values, as
  SGLang's in-place pause does).

No new batch starts while paused.

Images: a model with a ``vision_config`` (an image-text-to-text model such as Llava or
Qwen2-VL) is loaded with ``AutoModelForImageTextToText``, and its processor with
``AutoProcessor``.  A request's ``image_data`` (base64 image files, AReaL's field) is
decoded with PIL in the generate thread (:mod:`._hf_images`) and turned into the model's
image inputs by the request's ``processor`` (else the backend's):
``processor.image_processor(images)``,
whose outputs (``pixel_values``, ``image_grid_thw``, ...) of every image request of a
batch are concatenated in row order and passed to ``generate``; the prompt ids must
already hold the expanded image tokens (what the processor's text side produces, e.g.
:class:`workflows.vision_rlvr.VisionRLVRWorkflow`).  Text-only and image requests share
batches.
"""

from __future__ import annotations

import logging
import math
import os
import threading
from collections import Counter, defaultdict
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import outcome
import trio

from ..errors import BackendError, InvalidRequestError
from ..types import ModelRequest, ModelResponse
from ._jobs import Gate, GenerationJob, JobQueue, stop_ids
from .base import BackendStatistics, InferenceBackend, check_sync_mode

__all__ = ["HFBackend", "HFStatistics"]

logger = logging.getLogger(f"rollout.{__name__}")  # the package's one logging namespace

_NO_TOP_K = 100_000_000
#: config fields holding a model's context length, in the order they are tried
_CONTEXT_FIELDS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")


def _batch_key(req: ModelRequest) -> tuple:
    g = req.gconfig
    return (
        g.greedy,
        None if g.greedy else g.temperature,
        None if g.greedy else g.top_p,
        None if g.greedy or g.top_k >= _NO_TOP_K else g.top_k,
        g.min_new_tokens,
        tuple(g.stop_token_ids),
        g.ignore_eos,
    )


@dataclass(frozen=True, kw_only=True)
class HFStatistics(BackendStatistics):
    """:class:`~engine.backends.base.BackendStatistics` of an :class:`HFBackend`.

    Attributes:
        mode: ``"static"`` or ``"continuous"``.
        requests_waiting: received, not yet in a running batch (static).
        batches: ``generate`` calls (static).
        batch_occupancy: mean requests per ``generate`` call (static).
        aborts: segments answered ``"abort"`` (weight updates in abort mode).
        weight_updates: weight updates applied.
        paused: a weight sync holds new batches.
    """

    mode: str
    requests_waiting: int = 0
    batches: int = 0
    batch_occupancy: float = 0.0
    aborts: int = 0
    weight_updates: int = 0
    paused: bool = False


class HFBackend(InferenceBackend):
    """Serve a transformers causal LM from this process.

    Args:
        model: a local HF folder or hub id (loaded when the backend opens), or an
            already-loaded ``PreTrainedModel`` (then ``tokenizer`` is required).
        tokenizer: optional tokenizer (loaded from ``model`` when omitted).
        device: ``"cuda"`` when available else ``"cpu"`` by default.
        dtype: ``"auto"`` (bfloat16 on CUDA, float32 on CPU), or a torch dtype name.
        mode: ``"static"`` (default: one left-padded ``generate`` per batch of
            queued requests; every sampling parameter; deterministic with a seed)
            or ``"continuous"`` (transformers' continuous batching: requests join
            and leave the running batch independently; see
            :mod:`engine.backends._hf_continuous` for what it supports).
        max_batch_size: requests per ``generate`` call (static) or per step
            (continuous); also the job queue's capacity.
        batch_window_s: a batch keeps collecting requests while each arrives
            within this many seconds of the previous one, so that a burst of
            episodes lands in one batch (static mode).
        cache_tokens: KV-cache size of continuous mode, in tokens (sized
            explicitly: auto-sizing takes ~15 s on CPU).

    Raises:
        InvalidRequestError: a bad argument (naming it).  From :meth:`open`: whatever
            transformers raises when the model cannot be loaded.  Per request:
            :class:`InvalidRequestError` for an unsupported parameter
            (``frequency_penalty``; ``image_data`` on a text-only model or in
            continuous mode; an ``image_data`` entry that is not a base64 image, or
            no processor to read it with); :class:`BackendError` when the backend is
            not open.
    """

    kind = "hf"

    def __init__(
        self,
        model: Any,
        tokenizer: Any = None,
        *,
        device: str | None = None,
        dtype: str = "auto",
        mode: str = "static",
        max_batch_size: int = 64,
        batch_window_s: float = 0.02,
        cache_tokens: int = 16384,
    ) -> None:
        if mode not in ("static", "continuous"):
            raise InvalidRequestError(f"mode must be 'static' or 'continuous', got {mode!r}")
        if max_batch_size < 1:
            raise InvalidRequestError(f"max_batch_size must be >= 1, got {max_batch_size}")
        if batch_window_s < 0:
            raise InvalidRequestError(f"batch_window_s must be >= 0, got {batch_window_s}")
        self._model_spec = model
        self.model: Any = None if isinstance(model, str) else model
        self.tokenizer = tokenizer
        self._device = device
        self._dtype = dtype
        self.mode = mode
        self.max_batch_size = max_batch_size
        self.batch_window_s = batch_window_s
        self.cache_tokens = cache_tokens
        self._queue: JobQueue | None = None
        self._server: Any = None  # the ContinuousServer, in continuous mode
        self._stats: Counter[str] = Counter()
        self._waiting = 0  # requests received, not yet in a running batch
        # weight sync between the trio side and the generate thread
        self._gate = Gate()  # closed while paused: no new batch starts
        self._paused_mode: str | None = None
        self._group_running = False
        self._abort_flag = False  # read by the generate thread
        self._hold_flag = False
        self._boundary_version: int | None = None  # the version of weights loaded in place
        self._parked = threading.Event()  # set by the generate thread while held
        self._release = threading.Event()
        self.update_requested = threading.Event()  # set while a pause is on (the thread may poll it)
        self._group_changed = trio.lowlevel.ParkingLot()
        self._token: trio.lowlevel.TrioToken | None = None
        self.accepts_images = False  # set at load: the model has a vision tower
        self.processor: Any = None  # the model folder's AutoProcessor (image models only)

    # -- loading -------------------------------------------------------------
    def _load(self) -> None:
        import torch
        from transformers import AutoTokenizer

        device = self._device or ("cuda" if torch.cuda.is_available() else "cpu")
        if self._dtype == "auto":
            dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
        else:
            dtype = getattr(torch, self._dtype)
        if self.model is None:
            from transformers import AutoConfig

            is_vlm = getattr(AutoConfig.from_pretrained(self._model_spec), "vision_config", None) is not None
            self.model = _auto_model_class(is_vlm).from_pretrained(self._model_spec, dtype=dtype)
        self.accepts_images = getattr(self.model.config, "vision_config", None) is not None
        if self.accepts_images and isinstance(self._model_spec, str):
            from transformers import AutoProcessor

            try:
                self.processor = AutoProcessor.from_pretrained(self._model_spec)
            except (OSError, ValueError) as exc:  # requests may still bring their own processor
                logger.warning("hf backend: no processor in %s (%s)", self._model_spec, exc)
        self.model.to(device=device, dtype=dtype).eval()
        # Stops are ours (per request, ``ignore_eos`` honoured): without this,
        # ``generate`` falls back to the model's default eos and ends rows early.
        self.model.generation_config.eos_token_id = None
        if self.tokenizer is None:
            self.tokenizer = AutoTokenizer.from_pretrained(self._model_spec)
        self.device = device
        config = self.model.config.get_text_config()  # a VLM's language model holds these
        self.vocab_size = int(config.vocab_size)
        context = next((getattr(config, name, None) for name in _CONTEXT_FIELDS
                        if isinstance(getattr(config, name, None), int)), None)
        self.context_length: int | None = context

    # -- lifetime and requests ------------------------------------------------
    @asynccontextmanager
    async def open(self) -> AsyncIterator[HFBackend]:
        """Load the model (in a thread), then run the batcher until the scope ends;
        requests still queued then fail with :class:`BackendError`."""
        await trio.to_thread.run_sync(self._load)
        self._token = trio.lowlevel.current_trio_token()
        queue = JobQueue(self.max_batch_size)
        try:
            async with trio.open_nursery() as nursery:
                if self.mode == "continuous":
                    from ._hf_continuous import ContinuousServer

                    self._server = ContinuousServer(self, self._gate, self._stats, cache_tokens=self.cache_tokens,
                                                    page_size=32)
                    await nursery.start(self._server.run, queue.jobs)
                else:
                    nursery.start_soon(self._serve_batches, queue.jobs)
                self._queue = queue
                try:
                    yield self
                finally:
                    self._queue = None
                    queue.close()
                    nursery.cancel_scope.cancel()
        finally:
            self._server = None

    async def generate(self, request: ModelRequest, budget: int) -> ModelResponse:
        queue = self._queue
        if queue is None:
            raise BackendError(f"request {request.rid}: the hf backend is not open (use `async with backend.open()`; "
                               "open_rollout_engine does)")
        return await queue.submit(request, budget)

    async def _serve_batches(self, jobs: trio.MemoryReceiveChannel[GenerationJob]) -> None:
        """Static mode's batcher: collect a batch, run it group by group."""
        async with jobs:
            while True:
                try:
                    batch = [await jobs.receive()]
                except trio.EndOfChannel:
                    return
                # a burst of episodes (each tokenising its prompt first) trickles in:
                # keep collecting while requests keep arriving within the window
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
                groups: dict[tuple, list[GenerationJob]] = defaultdict(list)
                for job in batch:
                    if job.withdrawn:
                        continue
                    problem = self._unsupported(job.request) or self.fit_context(job)
                    if problem:
                        job.reply(outcome.Error(InvalidRequestError(f"request {job.request.rid}: {problem}")))
                        continue
                    groups[_batch_key(job.request)].append(job)  # seeded rows too: each has its own generator
                self._waiting = sum(len(g) for g in groups.values())
                for group in groups.values():
                    await self._gate.wait_open()  # no batch starts while a weight sync holds it
                    self._waiting -= len(group)
                    await self._run_group(group)

    def fit_context(self, job: GenerationJob) -> str | None:
        """Enforce the model's context length (as ``rollout serve`` does): clamp
        ``job.budget`` so that prompt + output fits, or say why nothing fits."""
        context = self.context_length
        if context is None:
            return None
        n = len(job.request.input_ids)
        if n >= context:
            return (f"input_ids has {n} tokens, at or over the model's context of {context} tokens "
                    "(max_position_embeddings): no room to generate")
        job.budget = min(job.budget, context - n)
        return None

    def _unsupported(self, req: ModelRequest) -> str | None:
        if req.gconfig.frequency_penalty:
            return "the hf backend does not support gconfig.frequency_penalty"
        if req.image_data is not None:
            if not self.accepts_images:
                return (f"image_data: the model {type(self.model).__name__} is text-only (no vision_config); "
                        "image requests need an image-text-to-text model")
            if not isinstance(req.image_data, list) or not all(isinstance(x, str) for x in req.image_data):
                return "image_data must be a list of base64 strings"
            if req.processor is None and self.processor is None:
                return ("image_data: no processor to read the images with: set ModelRequest.processor, or load "
                        "the model from a folder that has one")
        return None

    async def _run_group(self, group: list[GenerationJob]) -> None:
        version = self.version  # read before the segment is sent (AReaL PR #1569)
        start = trio.current_time()
        self._stats["batches"] += 1
        self._stats["requests_running"] = len(group)
        self._stats["batch_occupancy_sum"] += len(group)
        boundaries: list[tuple[int, int]] = []  # (step, version) of in-place updates
        self._group_running = True
        try:
            result = await trio.to_thread.run_sync(self._generate, group, boundaries)
        except Exception as exc:  # a backend failure fails this group's requests only
            logger.exception("hf backend: generate failed for %d requests", len(group))
            for job in group:
                job.reply(outcome.Error(BackendError(f"request {job.request.rid}: generate failed: {exc!r}")))
            return
        finally:
            self._group_running = False
            self._stats["requests_running"] = 0
            self._group_changed.unpark_all()
        rows, first_token_s = result
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
            versions = [version] * len(tokens)
            for step, new_version in boundaries:  # tokens at index >= step came after the update
                versions[step:] = [new_version] * max(0, len(tokens) - step)
            job.reply(
                outcome.Value(
                    ModelResponse(
                        input_tokens=list(job.request.input_ids),
                        output_tokens=tokens,
                        output_logprobs=logprobs,
                        output_versions=versions,
                        stop_reason=reason,
                        latency=end - start,
                        ttft=first_token_s,
                    )
                )
            )

    # -- weight sync (engine.backends.base.WeightSync) ----------------------------------
    @property
    def paused(self) -> bool:
        return self._paused_mode is not None

    async def pause(self, mode: str = "abort") -> None:
        """Hold new batches; ``"abort"``: stop the running batch at its next step (its
        unfinished rows answer ``"abort"`` with their partial tokens); ``"in_place"``:
        park it between two steps.  Returns once that happened.  Pausing again while
        paused does nothing.

        Raises:
            InvalidRequestError: unknown mode.
        """
        check_sync_mode("hf backend pause", mode)
        if self._paused_mode is not None:
            return
        self._paused_mode = mode
        self._gate.close()
        self._boundary_version = None
        self.update_requested.set()
        if self._server is not None:
            await self._server.pause(mode)
            return
        if mode == "abort":
            self._abort_flag = True
        else:
            self._release.clear()
            self._hold_flag = True
        try:
            while self._group_running and not (mode == "in_place" and self._parked.is_set()):
                await self._group_changed.park()
        finally:
            self._abort_flag = False

    async def resume(self) -> None:
        """Release a parked batch and let new batches start."""
        if self._paused_mode is None:
            return
        if self._server is not None:
            await self._server.resume()
        self._hold_flag = False
        self._release.set()
        self.update_requested.clear()
        self._paused_mode = None
        self._gate.open()

    async def update_weights(self, source: Any, *, version: int, mode: str = "abort") -> None:
        """Load new weights; tokens decoded with them carry ``version`` (the rows of a
        batch parked in place; later segments carry the version the engine sets).

        Args:
            source: a state dict (``{name: tensor}``) or a checkpoint folder that
                ``from_pretrained`` can load (same architecture).
            version: the version of the new weights.
            mode: ``"abort"`` or ``"in_place"`` (see the module docstring); used to
                pause when the backend is not paused already (then it resumes after).

        Raises:
            InvalidRequestError: unknown ``mode``.
            BackendError: the weights do not fit the model (missing/unexpected keys,
                shape mismatch); the old weights stay.
        """
        check_sync_mode("hf backend update_weights", mode)
        own_pause = self._paused_mode is None
        if own_pause:
            await self.pause(mode)
        try:
            state = await trio.to_thread.run_sync(self._read_state, source)
            await trio.to_thread.run_sync(self._load_state, state)
            self._stats["weight_updates"] += 1
            if self._server is not None:
                self._server.mark_boundary(version)
            else:
                self._boundary_version = version
        finally:
            if own_pause:
                await self.resume()

    def _read_state(self, source: Any) -> dict[str, Any]:
        if isinstance(source, (str, Path)):
            model_class = _auto_model_class(self.accepts_images)
            return model_class.from_pretrained(str(source), dtype=self.model.dtype).state_dict()
        return dict(source)

    def _load_state(self, state: dict[str, Any]) -> None:
        import torch

        try:
            with torch.no_grad():
                self.model.load_state_dict(state, strict=True)
        except (RuntimeError, KeyError) as exc:
            raise BackendError(f"update_weights: the new weights do not fit the model: {exc}") from exc

    def _held(self, step: int, boundaries: list[tuple[int, int]]) -> None:
        """In the generate thread: park until an in-place pause ends."""
        self._parked.set()
        if self._token is not None:
            trio.from_thread.run_sync(self._group_changed.unpark_all, trio_token=self._token)
        self._release.wait()
        self._parked.clear()
        if self._boundary_version is not None:
            boundaries.append((step, self._boundary_version))

    # -- generation (runs in a worker thread) --------------------------------
    def _generate(
        self, group: list[GenerationJob], boundaries: list[tuple[int, int]]
    ) -> tuple[list[tuple[list[int], list[float], str] | InvalidRequestError], float]:
        """Generate for ``group``; a request whose images cannot be read gets its
        :class:`InvalidRequestError` in place of its row, the others still run."""
        image_kwargs: dict[str, Any] = {}
        errors: dict[int, InvalidRequestError] = {}
        if any(job.request.image_data for job in group):
            from ._hf_images import image_inputs

            image_kwargs, errors = image_inputs([job.request for job in group], self.processor,
                                                device=self.device, dtype=self.model.dtype)
        live = [job for i, job in enumerate(group) if i not in errors]
        rows, first_token = self._generate_rows(live, boundaries, image_kwargs) if live else ([], 0.0)
        produced = iter(rows)
        return [errors[i] if i in errors else next(produced) for i in range(len(group))], first_token

    def _generate_rows(
        self, group: list[GenerationJob], boundaries: list[tuple[int, int]], image_kwargs: dict[str, Any]
    ) -> tuple[list[tuple[list[int], list[float], str]], float]:
        import time

        import torch
        from transformers import (
            GenerationConfig,
            LogitsProcessor,
            LogitsProcessorList,
            StoppingCriteria,
            StoppingCriteriaList,
            TemperatureLogitsWarper,
            TopKLogitsWarper,
            TopPLogitsWarper,
        )

        g = group[0].request.gconfig
        budgets = [job.budget for job in group]
        stops = stop_ids(self.tokenizer, group[0].request)
        pad_id = self.tokenizer.pad_token_id
        if pad_id is None:
            pad_id = next(iter(stops), 0)
        prompts = [job.request.input_ids for job in group]
        width = max(len(p) for p in prompts)
        input_ids = torch.full((len(group), width), pad_id, dtype=torch.long)
        attention = torch.zeros((len(group), width), dtype=torch.long)
        for i, p in enumerate(prompts):  # left padding
            input_ids[i, width - len(p) :] = torch.tensor(p)
            attention[i, width - len(p) :] = 1
        t0 = time.perf_counter()
        first_token = [0.0]
        aborted = [False]
        backend = self
        step_logprobs: list[torch.Tensor] = []  # one [B] tensor per decoding step

        class _Capture(LogitsProcessor):
            """Last processor: keeps log_softmax of the processed scores (the
            distribution that is sampled) of the current step, [B, V]."""

            last: torch.Tensor

            def __call__(self, ids, scores):
                self.last = torch.log_softmax(scores.float(), dim=-1)
                return scores

        capture = _Capture()

        class _Sample(LogitsProcessor):
            """After the capture, when sampling: draw each row's token with the row's
            own generator (inverse CDF of the processed distribution) and leave only
            that token, so that ``generate``'s greedy argmax picks it.  Nothing touches
            torch's global RNG; a row's tokens depend only on its seed and its prefix,
            not on the batch it shares."""

            def __call__(self, ids, scores):  # scores: [B, V]
                step = ids.shape[1] - width
                probs = torch.softmax(scores.float(), dim=-1)  # [B, V]
                cdf = probs.cumsum(dim=-1)  # [B, V]
                u = uniforms[:, step] * cdf[:, -1]  # [B]
                pick = torch.searchsorted(cdf, u[:, None], right=True).clamp_max(cdf.shape[1] - 1)  # [B, 1]
                zero = probs.gather(1, pick) <= 0  # rounding at the top end of the CDF
                pick = torch.where(zero, probs.argmax(dim=-1, keepdim=True), pick)
                return torch.full_like(scores, -math.inf).scatter_(1, pick, 0.0)

        class _RowStop(StoppingCriteria):
            """Called after every decoding step: stop a row at its own budget or
            once its episode withdrew it; stop all rows for an abort-mode weight
            update; park here for an in-place one."""

            def __call__(self, ids, scores, **kwargs):  # ids: [B, width + steps]
                step_logprobs.append(capture.last.gather(1, ids[:, -1:]).squeeze(1))  # [B]
                steps = ids.shape[1] - width
                if steps == 1:
                    first_token[0] = time.perf_counter() - t0
                if backend._hold_flag:
                    backend._held(steps, boundaries)
                if backend._abort_flag:
                    aborted[0] = True
                    return torch.ones(len(group), dtype=torch.bool, device=ids.device)
                done = [steps >= b or job.withdrawn for b, job in zip(budgets, group)]
                return torch.tensor(done, dtype=torch.bool, device=ids.device)

        # Warpers are ours, in transformers' order, so that the capture sees the
        # final distribution; ``generate`` runs greedy (do_sample=False), so it
        # builds no warpers of its own and never draws from the global RNG.
        processors = LogitsProcessorList()
        if not g.greedy:
            if g.temperature != 1.0:
                processors.append(TemperatureLogitsWarper(max(g.temperature, 1e-5)))
            if g.top_k < _NO_TOP_K:
                processors.append(TopKLogitsWarper(g.top_k))
            if g.top_p < 1.0:
                processors.append(TopPLogitsWarper(g.top_p))
        processors.append(capture)
        if not g.greedy:  # one generator per row: its request's seed, else a fresh random one
            uniforms = torch.stack([  # [B, max budget] float32 in [0, 1)
                torch.rand(max(budgets), generator=torch.Generator().manual_seed(
                    job.request.gconfig.seed if job.request.gconfig.seed is not None
                    else int.from_bytes(os.urandom(8), "big") >> 1))
                for job in group
            ]).to(self.device)
            processors.append(_Sample())
        gen_cfg = GenerationConfig(  # greedy over our one-token distribution when sampling
            max_new_tokens=max(budgets),
            min_new_tokens=g.min_new_tokens or None,
            do_sample=False,
            # neutral, explicit: unset values would be filled from the model's
            # generation_config (e.g. top_k=20), and flagged as unused on every call
            temperature=1.0,
            top_p=1.0,
            top_k=0,
            repetition_penalty=1.0,
            eos_token_id=sorted(stops) or None,
            pad_token_id=pad_id,
        )
        with torch.inference_mode():
            sequences = self.model.generate(
                input_ids=input_ids.to(self.device),
                attention_mask=attention.to(self.device),
                generation_config=gen_cfg,
                logits_processor=processors,
                stopping_criteria=StoppingCriteriaList([_RowStop()]),
                **image_kwargs,
            )
        logprobs = torch.stack(step_logprobs, dim=1).cpu().tolist()  # [B, steps]
        gen = sequences[:, width:].tolist()  # [B, steps]
        rows = []
        for i, job in enumerate(group):
            tokens, lps, reason = self._trim(job.request, gen[i], logprobs[i], budgets[i], stops)
            if aborted[0] and reason == "length" and len(tokens) < budgets[i]:
                reason = "abort"  # interrupted by a weight update: the engine resumes it
            rows.append((tokens, lps, reason))
        return rows, first_token[0]

    def _trim(
        self, req: ModelRequest, tokens: list[int], logprobs: list[float], budget: int, stop_ids: set[int]
    ) -> tuple[list[int], list[float], str]:
        """Cut a generated row at its first stop token (kept), stop string, or budget."""
        n, reason = min(len(tokens), budget), "length"
        for k in range(n):
            if k + 1 >= req.gconfig.min_new_tokens and tokens[k] in stop_ids:
                n, reason = k + 1, "stop"
                break
        if req.gconfig.stop:
            for k in range(1, n + 1):
                text = self.tokenizer.decode(tokens[:k], skip_special_tokens=False)
                if any(s in text for s in req.gconfig.stop):
                    n, reason = k, "stop"
                    break
        return tokens[:n], logprobs[:n], reason

    def statistics(self) -> HFStatistics:
        s = self._stats
        return HFStatistics(
            kind=self.kind, version=self.version, logprob_semantics=self.logprob_semantics,
            requests_served=s["requests_served"], requests_running=s["requests_running"],
            tokens_generated=s["tokens_generated"], mode=self.mode, requests_waiting=self._waiting,
            batches=s["batches"], batch_occupancy=s["batch_occupancy_sum"] / s["batches"] if s["batches"] else 0.0,
            aborts=s["aborts"], weight_updates=s["weight_updates"], paused=self.paused,
        )


def _auto_model_class(image_text_to_text: bool) -> Any:
    """``AutoModelForImageTextToText`` for a model with a vision tower, else
    ``AutoModelForCausalLM``."""
    if image_text_to_text:
        from transformers import AutoModelForImageTextToText

        return AutoModelForImageTextToText
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM

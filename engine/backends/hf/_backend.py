""":class:`HFBackend`: one loaded model (:mod:`._model`) served by one of two batchers
(:mod:`._static`, :mod:`._continuous`) behind the backend's own job queue (:mod:`._jobs`).

See the package docstring (:mod:`engine.backends.hf`) for sampling, logprobs, versions,
weight updates and images.
"""

from __future__ import annotations

import functools
import json
import os
import threading
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import trio

from ...errors import BackendError, InvalidRequestError
from ...types import ModelRequest, ModelResponse, versioned_lora_name
from ..base import BackendStatistics, InferenceBackend, check_sync_mode
from ..lora import ADAPTER_CONFIG, DEFAULT_LORA_NAME, AdapterLease, check_lora_name, is_adapter_source, read_adapter
from ._continuous import ContinuousBatcher
from ._jobs import Batcher, JobQueue
from ._lora import HFAdapters
from ._model import LoadedModel
from ._static import StaticBatcher

__all__ = ["HFBackend", "HFStatistics"]


@dataclass(frozen=True, kw_only=True)
class HFStatistics(BackendStatistics):
    """:class:`~engine.backends.base.BackendStatistics` of an :class:`HFBackend`.

    Attributes:
        mode: ``"static"`` or ``"continuous"``.
        requests_waiting: received, not yet in a running batch (static).
        batches: ``generate`` calls (static).
        batch_occupancy: mean requests per ``generate`` call (static).
        decode_steps: decoding steps run, the running batch's so far included (static; a
            live progress count).
        aborts: segments answered ``"abort"`` (weight updates in abort mode).
        weight_updates: weight updates applied.
        paused: a weight sync holds new batches.
    """

    mode: str
    requests_waiting: int = 0
    batches: int = 0
    batch_occupancy: float = 0.0
    decode_steps: int = 0
    aborts: int = 0
    weight_updates: int = 0
    paused: bool = False


class HFBackend(InferenceBackend):
    """Serve a transformers causal LM (or image-text-to-text model) from this process.

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
            :mod:`engine.backends.hf._continuous` for what it supports).
        max_batch_size: requests per ``generate`` call (static) or per step
            (continuous); also the job queue's capacity.
        batch_window_s: a batch keeps collecting requests while each arrives
            within this many seconds of the previous one, so that a burst of
            episodes lands in one batch (static mode).
        cache_tokens: KV-cache size of continuous mode, in tokens (sized
            explicitly: auto-sizing takes ~15 s on CPU).
        lora: a LoRA adapter to serve (an adapter folder, a peft model or
            :class:`~engine.backends.lora.AdapterWeights`; needs peft), loaded when the
            backend opens as ``{lora_name}-v{version}``; every request samples it (see
            "LoRA" below).  ``model`` may also be an adapter folder itself: then its
            ``base_model_name_or_path`` is the model.
        lora_name: the adapter's name (default ``"lora"``).
        check_lora_base: refuse an adapter whose ``base_model_name_or_path`` names another
            model than the one served (:func:`~engine.backends.lora.check_adapter`).

    LoRA (:mod:`engine.backends.lora`, :mod:`engine.backends.hf._lora`): peft's
    multi-adapter model in this process.  ``update_weights(adapter, version=v)`` (a peft
    model, a peft state dict, an adapter folder) injects the adapter as ``lora-v{v}`` next
    to the one in use, switches to it inside the weight sync (``"abort"``: the aborted
    segments resume on it; ``"in_place"``: the parked batch continues with it, its tokens
    tagged ``v`` from the boundary on) and deletes the old one once no segment holds it.
    Only the adapter travels.  A backend opened without ``lora`` starts serving one at its
    first adapter update.  A request's ``lora_name`` must be the adapter's name.

    Named adapters (static mode; ``rollout serve``'s ``/load_lora_adapter``):
    :meth:`add_adapter` loads an adapter under a name of its own, one immutable version
    (a new version is a new name), while the model serves: the running batch parks between
    two steps for the change and continues on its own adapter.  A request with
    ``lora_name=name`` samples it; :meth:`hold_adapter` pins it for a request admitted
    elsewhere (``generate(..., adapter=lease)``); :meth:`remove_adapter` unloads it (new
    requests fail, those in flight finish on it, it is deleted once they ended).  One
    adapter per batch: requests of different adapters (and the base model's, without a
    ``lora_name`` when the backend serves no ``lora`` of its own) take turns, batch by batch.

    Attributes:
        update_requested: a ``threading.Event`` set while a weight sync's pause is on
            (a generate thread, or a test, may wait on it).

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
        lora: Any = None,
        lora_name: str = DEFAULT_LORA_NAME,
        check_lora_base: bool = True,
    ) -> None:
        if mode not in ("static", "continuous"):
            raise InvalidRequestError(f"mode must be 'static' or 'continuous', got {mode!r}")
        if max_batch_size < 1:
            raise InvalidRequestError(f"max_batch_size must be >= 1, got {max_batch_size}")
        if batch_window_s < 0:
            raise InvalidRequestError(f"batch_window_s must be >= 0, got {batch_window_s}")
        self._lora_name = check_lora_name("HFBackend", lora_name)
        self._check_lora_base = check_lora_base
        if lora is None and isinstance(model, (str, os.PathLike)) and is_adapter_source(model):
            lora, model = os.fspath(model), _adapter_base(os.fspath(model))
        self._lora_source = lora
        self._adapters: HFAdapters | None = None
        self._named: set[str] = set()  # the named adapters loaded (add_adapter), not unloaded
        self._named_loads = 0
        self._adapter_lock = trio.Lock()  # one adapter load at a time
        self._lm = LoadedModel(model, tokenizer, device=device, dtype=dtype)
        self.mode = mode
        self.max_batch_size = max_batch_size
        self.batch_window_s = batch_window_s
        self.cache_tokens = cache_tokens
        self._batcher: Batcher = self._new_batcher()
        self._queue: JobQueue | None = None
        self._paused_mode: str | None = None
        self._weight_updates = 0
        self.update_requested = threading.Event()

    def _new_batcher(self) -> Batcher:
        def version() -> int:
            return self.version

        def adapters() -> HFAdapters | None:
            return self._adapters

        if self.mode == "continuous":
            return ContinuousBatcher(self._lm, version, max_batch_size=self.max_batch_size,
                                     cache_tokens=self.cache_tokens, adapters=adapters)
        return StaticBatcher(self._lm, version, max_batch_size=self.max_batch_size,
                             batch_window_s=self.batch_window_s, adapters=adapters)

    # -- the loaded model (public, read after open) ------------------------------------------
    @property
    def model(self) -> Any:
        """The ``PreTrainedModel`` (``None`` before :meth:`open` when given a spec)."""
        return self._lm.model

    @property
    def tokenizer(self) -> Any:
        return self._lm.tokenizer

    @property
    def processor(self) -> Any:
        """The model folder's ``AutoProcessor`` (image models only), else ``None``."""
        return self._lm.processor

    @property
    def accepts_images(self) -> bool:
        """The model has a vision tower (known once loaded)."""
        return self._lm.accepts_images

    @property
    def device(self) -> str:
        return self._lm.device

    @property
    def vocab_size(self) -> int:
        return self._lm.vocab_size

    @property
    def context_length(self) -> int | None:
        """Tokens of context (prompt + output), ``None`` when the config names none."""
        return self._lm.context_length

    # -- lifetime and requests ------------------------------------------------
    @asynccontextmanager
    async def open(self) -> AsyncIterator[HFBackend]:
        """Load the model (in a thread), then run the batcher until the scope ends;
        requests still queued then fail with :class:`BackendError`."""
        await trio.to_thread.run_sync(self._lm.load)
        if self._lora_source is not None and self._adapters is None:
            await self._load_adapter(self._lora_source, self.version)
        queue = JobQueue(self.max_batch_size)
        async with trio.open_nursery() as nursery:
            await nursery.start(self._batcher.run, queue.jobs)
            self._queue = queue
            try:
                yield self
            finally:
                self._queue = None
                queue.close()
                nursery.cancel_scope.cancel()

    async def generate(self, request: ModelRequest, budget: int, *, adapter: AdapterLease | None = None
                       ) -> ModelResponse:
        """One segment (the engine's dispatch path).  ``adapter``: a lease the caller holds
        on a named adapter (:meth:`hold_adapter`): the segment samples exactly that version,
        whatever is unloaded meanwhile (``request.lora_name`` is then not read).

        Raises:
            InvalidRequestError: ``request.lora_name`` names no adapter this backend serves.
            BackendError: the backend is not open.
        """
        queue = self._queue
        if queue is None:
            raise BackendError(f"request {request.rid}: the hf backend is not open (use `async with backend.open()`; "
                               "open_rollout_engine does)")
        adapters = self._adapters
        own = None
        if adapter is None and request.lora_name is not None and adapters is not None:
            adapters.versions.resolve(request.lora_name)  # an unknown name: InvalidRequestError
            if request.lora_name in self._named:  # immutable: pinned from now to the answer
                adapter = own = adapters.versions.acquire(request.lora_name)
        try:
            return await queue.submit(request, budget, adapter)
        finally:
            if own is not None:
                self.release_adapter(own)

    # -- named adapters (rollout serve's /load_lora_adapter) ------------------------------
    async def add_adapter(self, name: str, source: Any) -> AdapterLease:
        """Load ``source`` (an adapter folder, a peft model, :class:`~engine.backends.lora.AdapterWeights`)
        as the *named* adapter ``name``: one immutable version, next to the backend's own
        adapter and other named ones; requests with ``lora_name=name`` sample it.  A
        folder is read once, here.  The model is changed while no batch computes (the
        running one parks for it between two steps, then continues on its own adapter).
        Static mode only.

        Raises:
            InvalidRequestError: ``name`` is not a valid adapter name.
            BackendError: the backend is not open or runs ``mode="continuous"``; ``name`` is
                loaded already (the backend's own adapter's name included); peft is missing;
                the adapter cannot be read, was trained on another base model, or does not
                fit the model (the model is unchanged then).
        """
        name = check_lora_name("HFBackend.add_adapter", name)
        if self.mode != "static":
            raise BackendError("hf backend: named LoRA adapters need mode='static' (continuous mode computes every "
                               "request with one adapter)")
        if self._queue is None:
            raise BackendError("hf backend: add_adapter needs the backend open")
        adapters = self._adapters or HFAdapters(self._lm, self._lora_name, check_base=self._check_lora_base)
        if adapters.versions.current(name) is not None or (name == adapters.name and adapters.serves_default):
            raise BackendError(f"LoRA adapter {name!r} is loaded already: unload it first, or pick another name")
        weights = await trio.to_thread.run_sync(read_adapter, source)
        async with self._adapter_lock, self._batcher.exclusive():
            if adapters.versions.current(name) is not None:  # (loaded meanwhile)
                raise BackendError(f"LoRA adapter {name!r} is loaded already: unload it first, or pick another name")
            self._named_loads += 1
            served = versioned_lora_name(name, self._named_loads)  # unique: a reloaded name never reuses a slot
            await trio.to_thread.run_sync(functools.partial(adapters.load, weights, served, named=True))
            self._adapters, self.lora = adapters, adapters.versions
            self._batcher.reactivate()  # a parked batch keeps computing with its own adapter (or none)
            self._named.add(name)
            return adapters.versions.add(name, self._named_loads)

    @property
    def own_adapter(self) -> AdapterLease | None:
        """The current version of the backend's own adapter (``lora=``, ``lora_name``,
        versioned by ``update_weights``), ``None`` when it serves none (named adapters
        aside)."""
        adapters = self._adapters
        return adapters.versions.current() if adapters is not None and adapters.serves_default else None

    def hold_adapter(self, name: str) -> AdapterLease:
        """A lease on the named adapter ``name``, for a request admitted now: pass it to
        :meth:`generate` (``adapter=``) and give it back with :meth:`release_adapter`.

        Raises:
            InvalidRequestError: no named adapter ``name``.
        """
        if self._adapters is None or name not in self._named:
            loaded = ", ".join(repr(n) for n in sorted(self._named)) or "none"
            raise InvalidRequestError(f"LoRA adapter {name!r} is not loaded (loaded: {loaded})")
        return self._adapters.versions.acquire(name)

    def release_adapter(self, lease: AdapterLease) -> None:
        """Give back a lease of :meth:`hold_adapter`; an unloaded adapter's last one deletes
        it from the model now if no batch computes (else when the running batch ends)."""
        adapters = self._adapters
        assert adapters is not None
        adapters.versions.release(lease)
        self._sweep()

    def remove_adapter(self, name: str) -> None:
        """Unload the named adapter ``name``: new requests for it fail at once
        (:class:`InvalidRequestError`); requests in flight on it finish on it; it is deleted
        from the model once the last of them ended.

        Raises:
            InvalidRequestError: no named adapter ``name``.
        """
        if self._adapters is None or name not in self._named:
            raise InvalidRequestError(f"LoRA adapter {name!r} is not loaded")
        self._named.discard(name)
        self._adapters.versions.retire(name)
        self._sweep()

    def _sweep(self) -> None:
        """Delete the drained retired adapters now when no batch computes (a sync call on
        the trio thread: no batch can start meanwhile)."""
        idle = getattr(self._batcher, "idle", None)
        if self._adapters is not None and idle is not None and idle():
            self._adapters.drop_retired()

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
        self.update_requested.set()
        await self._batcher.pause(mode)

    async def resume(self) -> None:
        """Release a parked batch and let new batches start."""
        if self._paused_mode is None:
            return
        await self._batcher.resume()
        self.update_requested.clear()
        self._paused_mode = None

    async def update_weights(self, source: Any, *, version: int, mode: str = "abort") -> None:
        """Load new weights; tokens decoded with them carry ``version`` (the rows of a
        batch parked in place; later segments carry the version the engine sets).

        Args:
            source: a state dict (``{name: tensor}``) or a checkpoint folder that
                ``from_pretrained`` can load (same architecture); or a LoRA adapter (a
                peft model, a peft state dict, an adapter folder: see "LoRA" in the class
                docstring), loaded as ``{lora_name}-v{version}``.
            version: the version of the new weights.
            mode: ``"abort"`` or ``"in_place"`` (see the package docstring); used to
                pause when the backend is not paused already (then it resumes after).

        Raises:
            InvalidRequestError: unknown ``mode``.
            BackendError: the weights do not fit the model (missing/unexpected keys,
                shape mismatch), the adapter was trained on another base model, that
                adapter version is loaded already, full weights sent to a backend that
                serves an adapter; the old weights (or adapter) stay.
        """
        check_sync_mode("hf backend update_weights", mode)
        adapter = is_adapter_source(source)
        if not adapter and self._adapters is not None:
            served = (repr(self._adapters.name) if self._adapters.serves_default else
                      "adapters " + ", ".join(repr(n) for n in sorted(self._named)) + " (add_adapter)")
            raise BackendError(f"hf backend serves the LoRA {served}: update_weights takes an adapter (a peft "
                               "model, a peft state dict or an adapter folder), not full weights (peft's layers are "
                               "in the model)")
        own_pause = self._paused_mode is None
        if own_pause:
            await self.pause(mode)
        try:
            if adapter:
                async with self._adapter_lock, self._batcher.exclusive():
                    new = await self._load_adapter(source, version)
                    self._weight_updates += 1
                    self._batcher.weights_loaded(version)
                    adapters = self._adapters
                    assert adapters is not None
                    if mode == "in_place":  # the parked segments of the adapter continue on its new version
                        self._batcher.move_leases(lambda lease: adapters.versions.move(lease, new))
                    self._batcher.reactivate()  # (a parked batch of a named adapter, or none, keeps its own)
                    adapters.drop_retired()
            else:
                state = await trio.to_thread.run_sync(self._lm.read_state, source)
                async with self._batcher.exclusive():
                    await trio.to_thread.run_sync(self._lm.load_state, state)
                self._weight_updates += 1
                self._batcher.weights_loaded(version)
        finally:
            if own_pause:
                await self.resume()

    async def _load_adapter(self, source: Any, version: int) -> AdapterLease:
        """Load ``source`` as ``{lora_name}-v{version}``, make it the current version and the
        active adapter (no batch may be computing: at open, or inside a weight sync).

        Raises:
            BackendError: see :meth:`update_weights`.
        """
        adapters = self._adapters or HFAdapters(self._lm, self._lora_name, check_base=self._check_lora_base)
        if adapters.name in self._named:
            raise BackendError(f"LoRA adapter {adapters.name!r} is a named adapter (add_adapter): the backend's own "
                               "adapter needs another lora_name")
        served = versioned_lora_name(adapters.name, version)
        if served in adapters.versions.loaded():
            raise BackendError(f"LoRA adapter {served!r} is loaded already: a new adapter needs a new version")
        weights = await trio.to_thread.run_sync(lambda: read_adapter(source, config=adapters.config))
        await trio.to_thread.run_sync(adapters.load, weights, served)
        adapters.activate(served)
        lease = adapters.versions.add(adapters.name, version)
        adapters.serves_default = True
        self._adapters = adapters
        self.lora = adapters.versions
        return lease

    def running_sequence_limit(self) -> int | None:
        """``max_batch_size``: at most that many sequences run at once (a static batch, or a
        continuous batcher's step); the rest queue in the backend."""
        return self.max_batch_size

    def statistics(self) -> HFStatistics:
        c = self._batcher.counts()
        return HFStatistics(
            kind=self.kind, version=self.version, logprob_semantics=self.logprob_semantics,
            requests_served=c.requests_served, requests_running=c.requests_running,
            tokens_generated=c.tokens_generated, mode=self.mode, requests_waiting=c.requests_waiting,
            batches=c.batches, batch_occupancy=c.batch_occupancy, decode_steps=c.decode_steps, aborts=c.aborts,
            weight_updates=self._weight_updates, paused=self.paused,
            lora=None if self._adapters is None else self._adapters.versions.statistics(),
        )


def _adapter_base(folder: str) -> str:
    """The base model an adapter folder names (``base_model_name_or_path``).

    Raises:
        InvalidRequestError: it names none.
    """
    with open(os.path.join(folder, ADAPTER_CONFIG), encoding="utf-8") as f:
        base = json.load(f).get("base_model_name_or_path")
    if not base:
        raise InvalidRequestError(f"HFBackend: {folder} is a LoRA adapter that names no base model "
                                  f"(base_model_name_or_path in its {ADAPTER_CONFIG}): pass the base model as "
                                  "model= and the adapter as lora=")
    return str(base)


class HFBackendFactory:
    """A picklable recipe for an :class:`HFBackend`: calling it builds one (unopened).

    For :func:`engine.shards.open_sharded_engine`, which sends its backend to each
    shard process (an ``HFBackend`` holds threads' state and cannot be pickled): every
    shard calls the factory and loads its own copy of the model when its backend
    opens.  ``rollout run --backend hf --shards N`` uses it.

    Args:
        model: a local HF folder or hub id (a path: a loaded model cannot travel).
        devices: one device per shard, round robin by shard index
            (:func:`engine.shards.shard_index`), e.g. ``["cuda:0", "cuda:1"]``: shard
            ``i`` loads on ``devices[i % len(devices)]``; called outside a shard, the
            first.  None (default): ``device`` from ``kwargs``, else HFBackend's
            default (``"cuda"`` when available: every shard on the same GPU).
        **kwargs: :class:`HFBackend`'s keyword arguments (``device``, ``dtype``,
            ``mode``, ``max_batch_size``, ``batch_window_s``, ``cache_tokens``);
            checked when called, where :class:`HFBackend` raises
            ``InvalidRequestError`` naming a bad one.

    Raises:
        TypeError: ``model`` is not a string, or both ``devices`` and ``device`` given.
        ValueError: ``devices`` is empty.
    """

    logprob_semantics = HFBackend.logprob_semantics

    def __init__(self, model: str, *, devices: Sequence[str] | None = None, **kwargs: Any) -> None:
        if not isinstance(model, str):
            raise TypeError(f"HFBackendFactory: model must be a folder or hub id (str), got {type(model).__name__}")
        if devices is not None:
            if "device" in kwargs:
                raise TypeError("HFBackendFactory: give devices (one per shard) or device, not both")
            if isinstance(devices, str) or not devices:
                raise ValueError(f"HFBackendFactory: devices must be a non-empty list of devices, got {devices!r}")
            devices = list(devices)
        self.model = model
        self.devices = devices
        self.kwargs = kwargs

    def device_for(self, index: int | None) -> str | None:
        """The device shard ``index`` loads on (None: ``kwargs``' or HFBackend's default)."""
        if self.devices is None:
            return self.kwargs.get("device")
        return self.devices[(index or 0) % len(self.devices)]

    def __call__(self) -> HFBackend:
        from ...context import shard_index

        kwargs = dict(self.kwargs)
        if self.devices is not None:
            kwargs["device"] = self.device_for(shard_index())
        return HFBackend(self.model, **kwargs)

    def __repr__(self) -> str:
        extra = "" if self.devices is None else f", devices={self.devices!r}"
        return f"HFBackendFactory({self.model!r}{extra}{''.join(f', {k}={v!r}' for k, v in self.kwargs.items())})"

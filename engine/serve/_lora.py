"""``rollout serve``'s LoRA adapters: SGLang's ``/load_lora_adapter`` and
``/unload_lora_adapter`` over the ``hf`` backend's named adapters (:class:`ServedAdapters`).

The name -> adapter registry.  A served name is one *named adapter* of the backend
(:meth:`HFBackend.add_adapter <engine.backends.hf.HFBackend.add_adapter>`): one immutable
version per name, read from its folder once, at the load (the folder is never read again:
a client may delete it after the unload, or rewrite it for another name).  A new version is
a new name: our clients load ``{lora_name}-v{version}`` next to the one in use, move their
traffic to it and unload the old name once their requests of it are done
(:mod:`engine.backends.remote._lora`); several clients (tenants) each load their own names.
A request samples the adapter its ``lora_path`` names (SGLang's field: a loaded name), the
base model without one.  The server holds a lease on the version from the request's
admission to its answer (:meth:`HFBackend.hold_adapter <engine.backends.hf.HFBackend.hold_adapter>`),
so an unload never pulls an adapter from under a request in flight, waiting for a pause
included: the name is gone at once (new requests for it answer 404, as vLLM does), the
adapter is deleted from the model when its last request ended.

``rollout serve --lora PATH`` is the backend's *own* adapter besides: versioned with the
server's weight version (``{lora_name}-v{version}``, replaced by
``/update_weights_from_disk`` with an adapter folder), sampled by requests without
``lora_path`` (and by those naming it or its current version); its names cannot be loaded or
unloaded.

Load failures answer SGLang's shape, HTTP 400 ``{"success": false, "error_message",
"loaded_adapters"}``, one line each: LoRA not enabled (``--enable-lora``), a bad body, a
name in use, a folder that cannot be read (missing, corrupt), a rank above
``--max-lora-rank``, another base model, tensors that do not fit; the model is unchanged then.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from typing import Any

import trio

from ..backends.lora import AdapterLease, AdapterWeights, check_adapter, read_adapter
from ..errors import RolloutError
from ..types import ModelRequest, valid_lora_name
from ._http import JSONResponse, RequestRejected

__all__ = ["ServedAdapters"]

logger = logging.getLogger("rollout.engine.serve")  # the package's one logging namespace

#: SGLang's words (``tokenizer_manager.load_lora_adapter``); ``rollout serve`` has the same flag
NOT_ENABLED = "LoRA is not enabled. Please set `--enable-lora` to enable LoRA."


def _one_line(text: object) -> str:
    return " ".join(str(text).split())


@dataclass
class ServedAdapters:
    """The adapters one ``rollout serve`` serves (see the module docstring).

    Attributes:
        backend: the server's ``HFBackend``.
        enabled: LoRA routes on (``--enable-lora``; ``--lora`` implies it).
        max_rank: ``--max-lora-rank`` (``None``: no limit).
        base_model: the model folder the server loaded (the base-model check).
        own_path: the folder of the ``--lora`` adapter's current version, if any.
    """

    backend: Any
    enabled: bool = False
    max_rank: int | None = None
    base_model: str | None = None
    own_path: str | None = None
    _paths: dict[str, str] = field(default_factory=dict)  # served name -> the folder it was loaded from
    _lock: trio.Lock = field(default_factory=trio.Lock)  # one load or unload at a time (SGLang's lora_update_lock)

    # -- what is served ------------------------------------------------------------------
    def _own(self) -> AdapterLease | None:
        """The current version of the backend's own (``--lora``) adapter, if it serves one."""
        return self.backend.own_adapter

    def _own_names(self) -> set[str]:
        own = self._own()
        return set() if own is None else {own.name, own.served_name}

    def loaded(self) -> dict[str, str | None]:
        """``{name: folder}`` of every adapter requests may name (the ``--lora`` one as its
        current versioned name; its folder ``None`` when not known)."""
        own = self._own()
        mine: dict[str, str | None] = {} if own is None else {own.served_name: self.own_path}
        return {**mine, **self._paths}

    def info(self) -> dict[str, Any]:
        """The ``/get_server_info`` fields our clients read (SGLang's names)."""
        return {"enable_lora": self.enabled, "max_lora_rank": self.max_rank, "max_loras_per_batch": 1,
                "loaded_lora_adapters": self.loaded()}

    def model_cards(self, parent: str) -> list[dict[str, Any]]:
        """One ``/v1/models`` card per loaded adapter (as vLLM and SGLang list them)."""
        return [{"id": name, "object": "model", "root": path, "parent": parent} for name, path in self.loaded().items()]

    # -- requests ----------------------------------------------------------------------------
    def admit(self, request: ModelRequest) -> tuple[ModelRequest, AdapterLease | None]:
        """The request as the backend serves it, and the lease it holds until answered
        (release it with :meth:`release`): a named adapter pinned; the ``--lora`` adapter's
        names sample its current version (``lora_name`` cleared); none: the base model (or
        the ``--lora`` adapter).

        Raises:
            RequestRejected: 404, ``lora_path`` names no loaded adapter.
        """
        name = request.lora_name
        if name is None:
            return request, None
        if name in self._paths:
            return request, self.backend.hold_adapter(name)
        if name in self._own_names():
            return replace(request, lora_name=None), None
        loaded = ", ".join(repr(n) for n in self.loaded()) or "none"
        raise RequestRejected(404, f"LoRA adapter {name!r} is not loaded on this server (loaded: {loaded})")

    def release(self, lease: AdapterLease | None) -> None:
        if lease is not None:
            self.backend.release_adapter(lease)

    # -- the routes --------------------------------------------------------------------------
    def _answer(self, error: str | None = None) -> JSONResponse:
        body = {"success": error is None, "error_message": error or "", "loaded_adapters": self.loaded()}
        return JSONResponse(body, 200 if error is None else 400)

    def _name(self, body: Any, *keys: str) -> tuple[str, ...]:
        if not isinstance(body, dict):
            raise RequestRejected(400, "the body must be a JSON object")
        values = tuple(body.get(k) for k in keys)
        if not valid_lora_name(values[0]) or any(not isinstance(v, str) or not v for v in values[1:]):
            raise RequestRejected(400, "lora_name must be a non-empty string without spaces or slashes"
                                  + (" and lora_path a folder on this server" if len(keys) > 1 else ""))
        return values  # type: ignore[return-value]

    async def load(self, body: Any) -> JSONResponse:
        """``POST /load_lora_adapter {"lora_name", "lora_path"}``."""
        if not self.enabled:
            return self._answer(NOT_ENABLED)
        try:
            name, path = self._name(body, "lora_name", "lora_path")
        except RequestRejected as exc:
            return self._answer(exc.message)
        async with self._lock:
            if name in self._paths or name in self._own_names():
                return self._answer(f"LoRA adapter {name!r} is already loaded: unload it first "
                                    "(/unload_lora_adapter), or load it under another name")
            try:
                weights = await trio.to_thread.run_sync(read_adapter, path)
            except Exception as exc:  # missing, unreadable, corrupt: the server lives on
                return self._answer(f"Failed to load LoRA adapter {name!r} from {path}: {_one_line(exc)}")
            try:
                self._check(weights)
                await self.backend.add_adapter(name, weights)
            except RolloutError as exc:
                return self._answer(f"Failed to load LoRA adapter {name!r}: {_one_line(exc)}")
            self._paths[name] = path
        logger.info("rollout serve: loaded LoRA adapter %s from %s", name, path)
        return self._answer()

    def _check(self, weights: AdapterWeights) -> None:
        check_adapter(weights, where="this rollout serve server", base_model=self.base_model, max_rank=self.max_rank)

    async def unload(self, body: Any) -> JSONResponse:
        """``POST /unload_lora_adapter {"lora_name"}``: answers at once; requests in flight
        on it finish on it."""
        if not self.enabled:
            return self._answer(NOT_ENABLED)
        try:
            (name,) = self._name(body, "lora_name")
        except RequestRejected as exc:
            return self._answer(exc.message)
        async with self._lock:
            if name in self._own_names():
                return self._answer(f"LoRA adapter {name!r} is this server's --lora adapter: it is replaced "
                                    "through /update_weights_from_disk, not unloaded")
            if name not in self._paths:
                return self._answer(f"LoRA adapter {name!r} is not loaded")
            del self._paths[name]
            self.backend.remove_adapter(name)
        logger.info("rollout serve: unloaded LoRA adapter %s", name)
        return self._answer()

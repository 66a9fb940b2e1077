"""``rollout serve``'s application: SGLang's native HTTP API over an ``hf`` backend, as
Starlette routes (served by hypercorn's trio worker, :mod:`engine.serve._http`).

The request and answer bodies of ``/generate`` are :mod:`engine.backends.sglang_wire`'s, the
module the ``sglang`` client writes and reads them with.  :class:`SGLangServer` holds the
server's state: requests running (each one ``backend.generate``, cancelled on abort or
disconnect), the pause gate, the weight version it reports, counters.
"""

from __future__ import annotations

import functools
import logging
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trio
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from .._jsonable import plain
from ..backends import sglang_wire as wire
from ..backends.lora import AdapterLease, is_adapter_source
from ..errors import InvalidRequestError, RolloutError
from ..types import ModelRequest, ModelResponse
from ._http import JSONResponse, RequestRejected, RequireApiKey, parse_json, read_body, rejection
from ._lora import ServedAdapters

__all__ = ["SGLangServer"]

logger = logging.getLogger("rollout.engine.serve")  # the package's one logging namespace


async def _json(request: Request) -> Any:
    """The request body as JSON (``None`` when empty).  Raises :class:`RequestRejected`."""
    return parse_json(await read_body(request))


def _endpoint(fn: Callable[[Request], Awaitable[Any]]) -> Callable[[Request], Awaitable[Response]]:
    """A route endpoint: a dict result is a JSON answer; :class:`RequestRejected` its status
    with an SGLang-style error body; any other exception 500."""

    async def endpoint(request: Request) -> Response:
        try:
            result = await fn(request)
        except RequestRejected as exc:
            return rejection(exc)
        except Exception as exc:
            logger.exception("handler failed on %s %s", request.method, request.url.path)
            return JSONResponse({"error": {"message": f"internal error: {exc!r}"}}, 500)
        return result if isinstance(result, Response) else JSONResponse(result)

    return endpoint


async def _http_error(request: Request, exc: Exception) -> Response:
    """404 and 405 as FastAPI (SGLang's framework) answers them: ``{"detail": ...}``."""
    assert isinstance(exc, HTTPException)
    return JSONResponse({"detail": exc.detail}, exc.status_code, headers=exc.headers)


@dataclass
class _Running:
    scope: trio.CancelScope = field(default_factory=trio.CancelScope)  # around backend.generate
    dispatched: bool = False  # handed to the model (not waiting for a pause to end)
    aborted: str | None = None  # abort message, once aborted
    lease: AdapterLease | None = None  # the named LoRA adapter it samples, held until it answers


@dataclass
class SGLangServer:
    """SGLang's native API over an ``hf`` backend (see :mod:`engine.serve`).

    Serve :attr:`app` (an ASGI app) and run :meth:`run` (which opens the backend) in the
    same nursery; ``/health`` answers 503 until the model is loaded.

    Attributes:
        backend: the ``HFBackend``; ``run`` opens it (loads the model).
        model_path: reported by ``/get_model_info``.
        served_model_name: reported by ``/v1/models``.
        weight_version: reported in every answer's ``meta_info``.
        ready: the model is loaded and serving.
        api_key: when set, every route answers 401 without ``Authorization: Bearer
            <api_key>`` (:class:`~engine.serve._http.RequireApiKey`); hidden from the repr.
        enable_lora: serve ``/load_lora_adapter`` and ``/unload_lora_adapter``
            (:mod:`engine.serve._lora`); on anyway when the backend serves its own adapter.
        max_lora_rank: the largest adapter rank those load (``None``: any).
        lora: the adapters served (:class:`~engine.serve._lora.ServedAdapters`).
    """

    backend: Any
    model_path: str
    served_model_name: str = "default"
    weight_version: str = "0"
    ready: bool = False
    api_key: str | None = field(default=None, repr=False)
    enable_lora: bool = False
    max_lora_rank: int | None = None
    lora: ServedAdapters = field(init=False)
    _running: dict[str, _Running] = field(default_factory=dict)
    _paused: bool = False
    _gate: trio.lowlevel.ParkingLot = field(default_factory=trio.lowlevel.ParkingLot)  # resume or abort
    _changed: trio.lowlevel.ParkingLot = field(default_factory=trio.lowlevel.ParkingLot)
    _update_lock: trio.Lock = field(default_factory=trio.Lock)
    _counts: Counter = field(default_factory=Counter)

    def __post_init__(self) -> None:
        self.lora = ServedAdapters(self.backend, enabled=self.enable_lora, max_rank=self.max_lora_rank,
                                   base_model=self.model_path)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Open the backend (load the model) and serve until cancelled."""
        async with self.backend.open():
            self.weight_version = str(self.backend.version)
            if self.backend.own_adapter is not None:  # rollout serve --lora: LoRA is on
                self.lora.enabled = True
            self.ready = True
            task_status.started()
            try:
                await trio.sleep_forever()
            finally:
                self.ready = False

    @functools.cached_property
    def app(self) -> Starlette:
        """The ASGI app: one Starlette route per SGLang route (404 and 405 as ``{"detail"}``)."""
        routes = [
            ("/generate", ("POST", "PUT"), self._generate),
            ("/abort_request", ("POST",), self._abort_request),
            ("/pause_generation", ("POST",), self._pause_generation),
            ("/continue_generation", ("POST",), self._continue_generation),
            ("/update_weights_from_disk", ("POST",), self._update_weights_from_disk),
            ("/update_weight_version", ("POST",), self._update_weight_version),
            ("/load_lora_adapter", ("POST",), self._load_lora_adapter),
            ("/unload_lora_adapter", ("POST",), self._unload_lora_adapter),
            ("/health", ("GET",), self._health),
            ("/health_generate", ("GET",), self._health),
            ("/get_model_info", ("GET",), self._model_info),
            ("/model_info", ("GET",), self._model_info),
            ("/get_server_info", ("GET",), self._server_info),
            ("/server_info", ("GET",), self._server_info),
            ("/get_weight_version", ("GET",), self._get_weight_version),
            ("/get_load", ("GET",), self._get_load),
            ("/v1/models", ("GET",), self._models),
            ("/flush_cache", ("GET", "POST"), self._flush_cache),
        ]
        middleware = [] if self.api_key is None else [Middleware(RequireApiKey, api_key=self.api_key)]
        return Starlette(routes=[Route(path, _endpoint(fn), methods=list(methods)) for path, methods, fn in routes],
                         exception_handlers={HTTPException: _http_error}, middleware=middleware)

    def _require_ready(self) -> None:
        if not self.ready:
            raise RequestRejected(503, "the model is still loading")

    # -- /generate ---------------------------------------------------------------------
    def _parse_generate(self, body: Any) -> wire.GenerateCall:
        config = self.backend.model.config.get_text_config()
        try:
            return wire.parse_generate_request(
                body, vocab_size=int(config.vocab_size),
                context_length=int(getattr(config, "max_position_embeddings", 1 << 30)),
                tokenize=lambda text: self.backend.tokenizer(text)["input_ids"])
        except wire.WireError as exc:
            raise RequestRejected(400, str(exc)) from None

    async def _generate(self, request: Request) -> Any:
        self._require_ready()
        req, budget, return_logprob = self._parse_generate(await _json(request))
        if req.rid in self._running:
            raise RequestRejected(400, f"Duplicate request ID {req.rid}")
        req, lease = self.lora.admit(req)  # its adapter stays loaded until it answers (404: none such)
        start = trio.current_time()
        self._running[req.rid] = running = _Running(lease=lease)
        try:
            while self._paused and running.aborted is None:  # new requests wait during a pause
                await self._gate.park()
            if running.aborted is not None or budget == 0:
                resp = ModelResponse(input_tokens=req.input_ids, stop_reason="abort" if running.aborted else "length")
            else:
                resp = await self._dispatch(running, req, budget)
        except trio.Cancelled:
            self._counts["cancelled"] += 1  # the client disconnected (or shutdown): the request was withdrawn
            raise
        finally:
            del self._running[req.rid]
            self.lora.release(lease)
            self._changed.unpark_all()
        self._counts["requests"] += 1
        self._counts["aborted" if resp.stop_reason == "abort" else "completed"] += 1
        self._counts["tokens"] += resp.output_len
        return self._answer(req, resp, running.aborted, return_logprob, trio.current_time() - start)

    async def _dispatch(self, running: _Running, req: ModelRequest, budget: int) -> ModelResponse:
        """``backend.generate``; an abort (``running.scope``) answers ``abort`` with no token."""
        running.dispatched = True
        with running.scope:
            try:
                if running.lease is None:
                    return await self.backend.generate(req, budget)
                return await self.backend.generate(req, budget, adapter=running.lease)
            except InvalidRequestError as exc:
                raise RequestRejected(400, str(exc)) from None
            except RolloutError as exc:
                raise RequestRejected(500, str(exc)) from None
        return ModelResponse(input_tokens=req.input_ids, stop_reason="abort")

    def _answer(self, req: ModelRequest, resp: ModelResponse, aborted: str | None, return_logprob: bool,
                latency_s: float) -> dict[str, Any]:
        tokens, g, tokenizer = resp.output_tokens, req.gconfig, self.backend.tokenizer
        if resp.stop_reason == "abort":
            finish = wire.finish_abort(aborted or "aborted")
        elif resp.stop_reason == "length":
            finish = wire.finish_length(len(tokens))
        else:
            stop_ids = set(g.stop_token_ids)
            if not g.ignore_eos and tokenizer.eos_token_id is not None:
                stop_ids.add(int(tokenizer.eos_token_id))
            matched: Any = tokens[-1] if tokens and tokens[-1] in stop_ids else None
            if matched is None and g.stop:
                text = tokenizer.decode(tokens, skip_special_tokens=False)
                matched = next((s for s in g.stop if s in text), None)
            finish = wire.finish_stop(matched)
        return wire.generate_answer(
            rid=req.rid, prompt_len=len(req.input_ids), tokens=tokens, logprobs=resp.output_logprobs,
            finish=finish, weight_version=self.weight_version, return_logprob=return_logprob, latency_s=latency_s,
            text=tokenizer.decode(tokens, skip_special_tokens=g.skip_special_tokens))

    # -- abort / pause / weights -------------------------------------------------------
    def _abort(self, running: _Running, message: str) -> None:
        if running.aborted is not None:
            return
        running.aborted = message
        self._gate.unpark_all()  # a request waiting for the pause to end answers now
        running.scope.cancel()  # a generate that already has its answer keeps it (no checkpoint left)

    def _abort_all(self, message: str) -> int:
        entries = list(self._running.values())
        for running in entries:
            self._abort(running, message)
        return len(entries)

    async def _abort_request(self, request: Request) -> Response:
        body = await _json(request) or {}
        if body.get("abort_all"):
            self._abort_all("aborted by abort_all")
        else:
            rid = body.get("rid")
            if not isinstance(rid, str) or not rid:
                raise RequestRejected(400, "give rid (a string) or abort_all: true")
            for key, running in list(self._running.items()):
                if key == rid or key.startswith(rid):
                    self._abort(running, "aborted by abort_request")
        return Response(status_code=200, media_type="application/json")

    def _pause(self) -> None:
        self._paused = True

    def _resume(self) -> None:
        self._paused = False
        self._gate.unpark_all()

    async def _pause_generation(self, request: Request) -> Any:
        self._require_ready()
        mode = (await _json(request) or {}).get("mode", "abort")
        if mode not in ("abort", "retract", "in_place"):
            raise RequestRejected(400, f"mode must be abort, retract or in_place, got {mode!r}")
        self._pause()
        await self.backend.pause("abort" if mode == "abort" else "in_place")
        if mode == "abort":  # the running batch answered with its partial tokens; the rest with none
            self._abort_all("aborted by pause_generation")
        return {"message": "Generation paused successfully.", "status": "ok"}

    async def _continue_generation(self, request: Request) -> Any:
        self._require_ready()
        await self.backend.resume()
        self._resume()
        return {"message": "Generation continued successfully.", "status": "ok"}

    async def _update_weights_from_disk(self, request: Request) -> Any:
        self._require_ready()
        body = await _json(request) or {}
        path = body.get("model_path")
        if not isinstance(path, str) or not path:
            raise RequestRejected(400, "model_path (a string) is required")
        refusal = await trio.to_thread.run_sync(safetensors_refusal, path)
        if refusal is not None:
            return JSONResponse({"success": False, "message": refusal, "num_paused_requests": 0}, 400)
        adapter_update = await trio.to_thread.run_sync(is_adapter_source, path)  # else full weights
        weight_version = body.get("weight_version")
        backend = self.backend
        async with self._update_lock:
            was_paused = self._paused
            own_pause = not backend.paused  # else paused by /pause_generation: stays so
            self._pause()  # new requests wait
            running = sum(r.dispatched for r in self._running.values())
            try:
                version = self._next_version(weight_version)
                if own_pause:
                    if not body.get("abort_all_requests"):
                        await self._drain()  # SGLang's default: running requests finish first
                    await backend.pause("abort")  # the running batch answers with its partial tokens
                    if body.get("abort_all_requests"):
                        self._abort_all("aborted for a weight update")  # requests not yet decoding: none
                await backend.update_weights(path, version=version, mode="abort")
                backend.set_version(version)  # this server owns its backend's version
            except Exception as exc:
                logger.exception("weight update from %s failed", path)
                if own_pause:
                    await backend.resume()
                if not was_paused:
                    self._resume()
                return JSONResponse({"success": False, "message": f"failed to load {path}: {exc}",
                                      "num_paused_requests": 0}, 400)
            self.weight_version = str(weight_version) if weight_version is not None else str(version)
            if adapter_update:  # the --lora adapter's next version: the base model stays
                self.lora.own_path = path
            else:
                self.model_path = path
            if not (was_paused or body.get("keep_pause")):
                if own_pause:
                    await backend.resume()
                self._resume()
        self._counts["weight_updates"] += 1
        return {"success": True, "message": "Succeeded to update model weights.",
                "num_paused_requests": running if body.get("abort_all_requests") else 0}

    async def _drain(self) -> None:
        """Until every dispatched request has answered."""
        while any(r.dispatched for r in self._running.values()):
            await self._changed.park()

    def _next_version(self, weight_version: Any) -> int:
        """``weight_version`` when it is an integer, else the current version + 1."""
        try:
            return int(weight_version)
        except (TypeError, ValueError):
            return int(self.backend.version) + 1

    async def _update_weight_version(self, request: Request) -> Any:
        body = await _json(request) or {}
        if "new_version" not in body:
            raise RequestRejected(400, "new_version is required")
        if body.get("abort_all_requests"):
            self._abort_all("aborted for a weight version update")
        self.backend.set_version(self._next_version(body["new_version"]))
        self.weight_version = str(body["new_version"])
        return {"success": True, "message": "Succeeded to update weight version.", "new_version": self.weight_version}

    # -- info ------------------------------------------------------------------------
    async def _health(self, request: Request) -> Response:
        return Response(status_code=200 if self.ready else 503, media_type="application/json")

    async def _model_info(self, request: Request) -> Any:
        self._require_ready()
        config = self.backend.model.config
        return {"model_path": self.model_path, "tokenizer_path": self.model_path, "is_generation": True,
                "preferred_sampling_params": None, "weight_version": self.weight_version,
                "model_type": getattr(config, "model_type", None),
                "architectures": getattr(config, "architectures", None)}

    async def _server_info(self, request: Request) -> Any:
        return {"version": "trio-rollout", "model_path": self.model_path, "served_model_name": self.served_model_name,
                "weight_version": self.weight_version, "paused": self._paused, "ready": self.ready,
                "num_running_reqs": len(self._running), "counters": dict(self._counts), **self.lora.info(),
                "backend": plain(self.backend.statistics())}

    async def _get_weight_version(self, request: Request) -> Any:
        return {"weight_version": self.weight_version}

    async def _get_load(self, request: Request) -> Any:
        running = sum(r.dispatched for r in self._running.values())
        return {"num_running_reqs": running, "num_waiting_reqs": len(self._running) - running}

    async def _models(self, request: Request) -> Any:
        base = {"id": self.served_model_name, "object": "model", "root": self.model_path, "parent": None}
        return {"object": "list", "data": [base, *self.lora.model_cards(self.served_model_name)]}

    # -- LoRA adapters (engine.serve._lora) ----------------------------------------------------
    async def _load_lora_adapter(self, request: Request) -> Response:
        self._require_ready()
        return await self.lora.load(await _json(request))

    async def _unload_lora_adapter(self, request: Request) -> Response:
        self._require_ready()
        return await self.lora.unload(await _json(request))

    async def _flush_cache(self, request: Request) -> Response:
        return Response(b"Cache flushed.", 200, media_type="text/plain")


def safetensors_refusal(path: str) -> str | None:
    """Why ``/update_weights_from_disk`` refuses ``path`` (``None``: it loads it).  Only a
    folder on this machine with ``config.json`` and ``model.safetensors`` (or the
    ``model.safetensors.index.json`` of sharded ones), as ``save_pretrained`` writes them,
    loads: no hub id (nothing is downloaded), no single file, no folder whose weights are
    pickled ``*.bin``/``*.pt`` files (unpickling runs code; ``from_pretrained`` prefers the
    safetensors when both are there).  A LoRA adapter folder (``adapter_config.json`` and
    ``adapter_model.safetensors``) loads too: the backend's next adapter version.  Blocking
    (reads the folder)."""
    folder = Path(path)
    need = "config.json and model.safetensors (or model.safetensors.index.json), as save_pretrained writes them"
    if (folder / "adapter_config.json").is_file() and (folder / "adapter_model.safetensors").is_file():
        return None  # a LoRA adapter (rollout serve --lora: the next version)
    if not folder.is_dir():
        return f"model_path {path!r} is not a folder on this server: weights load only from a folder with {need}"
    weights = (folder / "model.safetensors").is_file() or (folder / "model.safetensors.index.json").is_file()
    if not weights or not (folder / "config.json").is_file():
        return (f"model_path {path!r} is not a safetensors checkpoint: weights load only from a folder with {need} "
                "(pickled .bin/.pt weights are refused)")
    return None

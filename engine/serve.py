"""``rollout serve``: a local model (the ``hf`` backend) behind SGLang's native HTTP API.

::

    rollout serve --model /path/to/hf-model --port 30000        # or: python -m engine.serve ...
    rollout run --backend sglang --server http://127.0.0.1:30000 --server http://host2:30000

Users without SGLang run N of these (one per GPU or machine) and point the ``sglang``
backend at them; tests use them as real server processes on 127.0.0.1.  ``--port 0`` picks
a free port; the process prints ``rollout serve: listening on URL`` when the socket is open
(``/health`` answers 503 while the model loads) and ``rollout serve: ready on URL`` once it
serves.  SIGTERM/SIGINT stop it cleanly.

Routes (SGLang wire format, ``SERVERS_AND_MODELS.md`` §1):

- ``POST|PUT /generate``: one prompt as ``input_ids`` (or ``text``), ``sampling_params``,
  ``rid``, ``return_logprob``; answers ``text``, ``output_ids`` and ``meta_info`` with
  ``finish_reason``, ``weight_version`` and ``output_token_logprobs``
  (``[logprob, token_id, null]``, processed semantics like the ``hf`` backend).  No streaming,
  no batches.  A client that disconnects aborts its request.  Other ``GenerateReqInput``
  fields are accepted at their neutral (falsy) value, since an sglang-router re-sends them all.
  ``image_data`` (a base64 image file or a list of them, as SGLang takes) reaches the ``hf``
  backend, which reads it with the model folder's processor (an image-text-to-text model;
  a text-only model answers 400 naming ``image_data``).
- ``POST /abort_request`` ``{"rid"}`` (exact or prefix match) or ``{"abort_all": true}``:
  the request answers at once with ``finish_reason`` ``abort`` and **no tokens** (the ``hf``
  backend does not hand back a withdrawn row's partial output; SGLang's "abort before
  prefill" looks the same).
- ``POST /pause_generation`` ``{"mode": "abort"|"retract"|"in_place"}``: new requests wait
  and the model pauses (:class:`~engine.backends.base.WeightSync`): ``abort`` (default) stops
  the running batch, whose requests answer ``abort`` *with their partial tokens*, and answers
  requests not yet decoding ``abort`` with none (a client re-sends both after the pause);
  ``retract`` and ``in_place`` park the running batch between two decoding steps.
  ``POST /continue_generation`` resumes.
- ``POST /update_weights_from_disk`` ``{"model_path", "abort_all_requests", "weight_version",
  "keep_pause"}``: holds new requests; unless already paused, aborts running ones
  (``abort_all_requests``) or lets them finish, and pauses the model; loads the
  checkpoint's state dict into the model (``HFBackend.update_weights``), sets the version
  (to ``weight_version`` when it is an integer, else +1), resumes.  ``POST
  /update_weight_version``.
- ``GET /health`` (also ``/health_generate``), ``/get_model_info`` (``/model_info``),
  ``/get_server_info`` (``/server_info``), ``/get_weight_version``, ``/get_load``,
  ``/v1/models``; ``GET|POST /flush_cache`` (a no-op).

Requests reach the model exactly as the engine sends them: one ``backend.generate`` per
request (the engine's one dispatch path), cancelled on abort or disconnect.  The server
owns its backend's policy version (``set_version``).  The HTTP layer (:func:`serve_http`) is a small HTTP/1.1 server on
``trio.serve_tcp`` and ``h11``, reused by the tests' fake servers.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import logging
import math
import signal
import sys
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qs, urlsplit

import h11
import trio

from .errors import InvalidRequestError, RolloutError, unwrap_single
from .types import GenerationHyperparameters, ModelRequest, ModelResponse

if sys.version_info < (3, 11):  # pragma: no cover
    from exceptiongroup import BaseExceptionGroup

__all__ = [
    "HTTPRequest",
    "HTTPResponse",
    "RequestRejected",
    "SGLangServer",
    "add_serve_parser",
    "json_response",
    "run_serve",
    "serve",
    "serve_http",
]

logger = logging.getLogger(f"rollout.{__name__}")  # the package's one logging namespace

_NO_TOP_K = 100_000_000
_MAX_BODY_BYTES = 64 * 1024 * 1024

# -- a small HTTP/1.1 server -------------------------------------------------------------


@dataclass(frozen=True)
class HTTPRequest:
    """One request: ``path`` without the query, ``query`` parsed, header names lower-case."""

    method: str
    path: str
    query: dict[str, list[str]]
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        """The body as JSON (``None`` when empty).  Raises :class:`RequestRejected` (400)."""
        if not self.body.strip():
            return None
        try:
            return json.loads(self.body)
        except ValueError as exc:
            raise RequestRejected(400, f"malformed JSON body: {exc}") from None


@dataclass(frozen=True)
class HTTPResponse:
    status: int = 200
    body: bytes = b""
    content_type: str = "application/json"


class RequestRejected(Exception):
    """Raised by a handler to answer ``status`` with an SGLang-style error body."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def json_response(obj: Any, status: int = 200) -> HTTPResponse:
    return HTTPResponse(status, json.dumps(obj).encode())


Handler = Callable[[HTTPRequest], Awaitable[HTTPResponse]]


async def open_listeners(host: str, port: int) -> list[trio.SocketListener]:
    """Listen on ``host:port`` (``port=0``: any free port).

    Raises:
        OSError: the address cannot be bound (in use, not ours); the message names it.
    """
    try:
        return await trio.open_tcp_listeners(port, host=host, backlog=1024)
    except OSError as exc:
        raise OSError(exc.errno, f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None


async def serve_http(handler: Handler, host: str = "127.0.0.1", port: int = 0, *,
                     listeners: list[trio.SocketListener] | None = None,
                     task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
    """Serve ``handler`` over HTTP/1.1 (keep-alive) on ``host:port`` (or on ``listeners``
    already open, see :func:`open_listeners`) until cancelled.

    ``task_status.started(port)`` reports the bound port (useful with ``port=0``).  While the
    handler runs the connection is watched: if the client disconnects the handler is
    cancelled.  A handler exception becomes a 500; :class:`RequestRejected` its status.
    """
    if listeners is None:
        listeners = await open_listeners(host, port)
    task_status.started(listeners[0].socket.getsockname()[1])
    await trio.serve_listeners(functools.partial(_serve_connection, handler), listeners)


async def _serve_connection(handler: Handler, stream: trio.SocketStream) -> None:
    conn = h11.Connection(h11.SERVER)
    try:
        while True:
            request = await _read_request(conn, stream)
            if request is None:
                return
            response = await _call_handler(handler, request, conn, stream)
            if response is None:  # the client went away
                return
            await _send_response(conn, stream, response)
            if conn.our_state is not h11.DONE or conn.their_state is not h11.DONE:
                return
            conn.start_next_cycle()
    except (trio.BrokenResourceError, trio.ClosedResourceError, h11.ProtocolError):
        return
    finally:
        with trio.CancelScope(shield=True):
            await stream.aclose()


async def _read_request(conn: h11.Connection, stream: trio.SocketStream) -> HTTPRequest | None:
    head: h11.Request | None = None
    body = bytearray()
    while True:
        event = conn.next_event()
        if event is h11.NEED_DATA:
            conn.receive_data(await stream.receive_some(65536))
        elif isinstance(event, h11.Request):
            head = event
        elif isinstance(event, h11.Data):
            body += event.data
            if len(body) > _MAX_BODY_BYTES:
                await _send_response(conn, stream, json_response({"error": {"message": "body too large"}}, 413))
                return None
        elif isinstance(event, h11.EndOfMessage):
            assert head is not None
            target = urlsplit(head.target.decode("latin-1"))
            headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in head.headers}
            return HTTPRequest(head.method.decode("ascii"), target.path, parse_qs(target.query), headers, bytes(body))
        elif isinstance(event, h11.ConnectionClosed):
            return None
        else:  # h11.PAUSED cannot happen before we answered
            return None


async def _call_handler(handler: Handler, request: HTTPRequest, conn: h11.Connection,
                        stream: trio.SocketStream) -> HTTPResponse | None:
    response: HTTPResponse | None = None
    async with trio.open_nursery() as nursery:

        async def watch_disconnect() -> None:
            while True:
                try:
                    data = await stream.receive_some(65536)
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    data = b""
                if not data:  # EOF: the client gave up; cancel the handler
                    nursery.cancel_scope.cancel()
                    return
                conn.receive_data(data)  # a pipelined request: kept for the next cycle

        nursery.start_soon(watch_disconnect)
        try:
            response = await handler(request)
        except RequestRejected as exc:
            response = json_response({"error": {"message": exc.message}, "message": exc.message,
                                      "code": exc.status}, exc.status)
        except Exception as exc:
            logger.exception("handler failed on %s %s", request.method, request.path)
            response = json_response({"error": {"message": f"internal error: {exc!r}"}}, 500)
        nursery.cancel_scope.cancel()
    return response


async def _send_response(conn: h11.Connection, stream: trio.SocketStream, response: HTTPResponse) -> None:
    headers = [("content-type", response.content_type), ("content-length", str(len(response.body))),
               ("server", "trio-rollout")]
    await stream.send_all(conn.send(h11.Response(status_code=response.status, headers=headers)))
    if response.body:
        await stream.send_all(conn.send(h11.Data(data=response.body)))
    await stream.send_all(conn.send(h11.EndOfMessage()))


# -- the SGLang-compatible application ----------------------------------------------------

_SAMPLING_KEYS = {
    "max_new_tokens", "temperature", "top_p", "top_k", "min_p", "min_new_tokens", "stop", "stop_token_ids",
    "ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim", "frequency_penalty",
    "presence_penalty", "repetition_penalty", "n", "sampling_seed", "stream_interval",
}
#: accepted only at their neutral value
_NEUTRAL = {"min_p": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0, "n": 1}
#: accepted with any value and ignored (routing and logging hints)
_IGNORED_KEYS = {"model", "log_metrics", "no_logs", "background", "priority", "routing_key", "extra_key",
                 "data_parallel_rank", "routed_dp_rank", "bootstrap_host", "bootstrap_port", "bootstrap_room"}
#: other fields are accepted only at a falsy value (a feature rollout serve does not have)
_GENERATE_KEYS = {
    "input_ids", "text", "sampling_params", "rid", "return_logprob", "stream", "logprob_start_len",
    "top_logprobs_num", "return_text_in_logprobs", "image_data",
}


@dataclass
class _Running:
    scope: trio.CancelScope = field(default_factory=trio.CancelScope)  # around backend.generate
    dispatched: bool = False  # handed to the model (not waiting for a pause to end)
    aborted: str | None = None  # abort message, once aborted


@dataclass
class SGLangServer:
    """SGLang's native API over an ``hf`` backend (see the module docstring).

    Attributes:
        backend: the ``HFBackend``; ``run`` opens it (loads the model).
        model_path: reported by ``/get_model_info``.
        served_model_name: reported by ``/v1/models``.
    """

    backend: Any
    model_path: str
    served_model_name: str = "default"
    weight_version: str = "0"
    ready: bool = False
    _running: dict[str, _Running] = field(default_factory=dict)
    _paused: bool = False
    _gate: trio.lowlevel.ParkingLot = field(default_factory=trio.lowlevel.ParkingLot)  # resume or abort
    _changed: trio.lowlevel.ParkingLot = field(default_factory=trio.lowlevel.ParkingLot)
    _update_lock: trio.Lock = field(default_factory=trio.Lock)
    _counts: Counter = field(default_factory=Counter)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Open the backend (load the model) and serve until cancelled."""
        async with self.backend.open():
            self.weight_version = str(self.backend.version)
            self.ready = True
            task_status.started()
            try:
                await trio.sleep_forever()
            finally:
                self.ready = False

    # -- dispatch ----------------------------------------------------------------------
    async def handle(self, request: HTTPRequest) -> HTTPResponse:
        routes: dict[str, tuple[tuple[str, ...], Callable[[HTTPRequest], Awaitable[Any]]]] = {
            "/generate": (("POST", "PUT"), self._generate),
            "/abort_request": (("POST",), self._abort_request),
            "/pause_generation": (("POST",), self._pause_generation),
            "/continue_generation": (("POST",), self._continue_generation),
            "/update_weights_from_disk": (("POST",), self._update_weights_from_disk),
            "/update_weight_version": (("POST",), self._update_weight_version),
            "/health": (("GET",), self._health),
            "/health_generate": (("GET",), self._health),
            "/get_model_info": (("GET",), self._model_info),
            "/model_info": (("GET",), self._model_info),
            "/get_server_info": (("GET",), self._server_info),
            "/server_info": (("GET",), self._server_info),
            "/get_weight_version": (("GET",), self._get_weight_version),
            "/get_load": (("GET",), self._get_load),
            "/v1/models": (("GET",), self._models),
            "/flush_cache": (("GET", "POST"), self._flush_cache),
        }
        route = routes.get(request.path)
        if route is None:
            return json_response({"detail": "Not Found"}, 404)
        methods, fn = route
        if request.method not in methods:
            return json_response({"detail": "Method Not Allowed"}, 405)
        result = await fn(request)
        return result if isinstance(result, HTTPResponse) else json_response(result)

    def _require_ready(self) -> None:
        if not self.ready:
            raise RequestRejected(503, "the model is still loading")

    # -- /generate ---------------------------------------------------------------------
    def _parse_generate(self, body: Any) -> tuple[ModelRequest, int, bool]:
        if not isinstance(body, dict):
            raise RequestRejected(400, "the body must be a JSON object")
        unknown = sorted(k for k in set(body) - _GENERATE_KEYS if k not in _IGNORED_KEYS and body[k])
        if unknown:  # a feature we do not have (an sglang-router re-sends every field at its default)
            raise RequestRejected(400, f"unsupported field(s) {unknown}")
        if body.get("stream"):
            raise RequestRejected(400, "rollout serve does not stream; send stream: false")
        if body.get("top_logprobs_num"):
            raise RequestRejected(400, "rollout serve does not return top logprobs (top_logprobs_num)")
        tokenizer, config = self.backend.tokenizer, self.backend.model.config.get_text_config()
        ids = body.get("input_ids")
        if ids is None:
            text = body.get("text")
            if not isinstance(text, str):
                raise RequestRejected(400, "give one prompt as input_ids (list of ints) or text (a string)")
            ids = tokenizer(text)["input_ids"]
        if not isinstance(ids, list) or not ids or any(isinstance(t, list) for t in ids):
            raise RequestRejected(400, "input_ids must be one non-empty list of token ids (no batches)")
        vocab = int(config.vocab_size)
        if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in ids):
            raise RequestRejected(400, f"input_ids must be ints in [0, {vocab})")
        sp = body.get("sampling_params") or {}
        if not isinstance(sp, dict):
            raise RequestRejected(400, "sampling_params must be an object")
        unknown = sorted(k for k in set(sp) - _SAMPLING_KEYS if sp[k] not in (None, False, [], {}, ""))
        if unknown:
            raise RequestRejected(400, f"unsupported sampling_params {unknown}")
        for key, neutral in _NEUTRAL.items():
            if sp.get(key, neutral) not in (neutral, None):
                raise RequestRejected(400, f"sampling_params.{key}={sp[key]!r} is not supported by rollout serve")
        context = int(getattr(config, "max_position_embeddings", 1 << 30))
        room = context - len(ids)
        if room <= 0:
            raise RequestRejected(400, f"the prompt has {len(ids)} tokens; the context is {context}")
        max_new = sp.get("max_new_tokens", 128)
        max_new = room if max_new is None else max_new
        if isinstance(max_new, bool) or not isinstance(max_new, int) or max_new < 0:
            raise RequestRejected(400, f"sampling_params.max_new_tokens must be an int >= 0, got {max_new!r}")
        budget = min(max_new, room)
        temperature = float(sp.get("temperature", 1.0))
        top_k = sp.get("top_k", -1)
        top_k = _NO_TOP_K if top_k in (None, -1) else top_k
        stop = sp.get("stop")
        stop = [stop] if isinstance(stop, str) else stop
        try:
            gconfig = GenerationHyperparameters(
                max_new_tokens=max(budget, 1), max_tokens=len(ids) + max(budget, 1),
                min_new_tokens=int(sp.get("min_new_tokens", 0) or 0), greedy=temperature < 1e-6,
                temperature=temperature if temperature >= 1e-6 else 1.0, top_p=float(sp.get("top_p", 1.0)),
                top_k=int(top_k), stop_token_ids=[int(t) for t in sp.get("stop_token_ids") or []],
                ignore_eos=bool(sp.get("ignore_eos", False)), skip_special_tokens=bool(sp.get("skip_special_tokens", True)),
                stop=list(stop) if stop else None, frequency_penalty=float(sp.get("frequency_penalty", 0.0)),
                seed=sp.get("sampling_seed"),
            )
            gconfig.validate()
        except (InvalidRequestError, TypeError, ValueError) as exc:
            raise RequestRejected(400, f"bad sampling_params: {exc}") from None
        rid = body.get("rid") or uuid.uuid4().hex
        if not isinstance(rid, str):
            raise RequestRejected(400, "rid must be a string (batches are not supported)")
        images = body.get("image_data") or None  # base64 image files; the hf backend reads them (or refuses)
        if isinstance(images, str):
            images = [images]
        if images is not None and (not isinstance(images, list) or not all(isinstance(x, str) for x in images)):
            raise RequestRejected(400, "image_data must be a base64 string or a list of them (no batches)")
        request = ModelRequest(rid=rid, input_ids=ids, gconfig=gconfig, image_data=images)
        return request, budget, bool(body.get("return_logprob", False))

    async def _generate(self, request: HTTPRequest) -> Any:
        self._require_ready()
        req, budget, return_logprob = self._parse_generate(request.json())
        if req.rid in self._running:
            raise RequestRejected(400, f"Duplicate request ID {req.rid}")
        start = trio.current_time()
        self._running[req.rid] = running = _Running()
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
                return await self.backend.generate(req, budget)
            except InvalidRequestError as exc:
                raise RequestRejected(400, str(exc)) from None
            except RolloutError as exc:
                raise RequestRejected(500, str(exc)) from None
        return ModelResponse(input_tokens=req.input_ids, stop_reason="abort")

    def _answer(self, req: ModelRequest, resp: ModelResponse, aborted: str | None, return_logprob: bool,
                latency_s: float) -> dict[str, Any]:
        tokens, g = resp.output_tokens, req.gconfig
        if resp.stop_reason == "abort":
            finish: dict[str, Any] = {"type": "abort", "message": aborted or "aborted", "status_code": None,
                                      "err_type": None}
        elif resp.stop_reason == "length":
            finish = {"type": "length", "length": len(tokens)}
        else:
            stop_ids = set(g.stop_token_ids)
            if not g.ignore_eos and self.backend.tokenizer.eos_token_id is not None:
                stop_ids.add(int(self.backend.tokenizer.eos_token_id))
            matched: Any = tokens[-1] if tokens and tokens[-1] in stop_ids else None
            if matched is None and g.stop:
                text = self.backend.tokenizer.decode(tokens, skip_special_tokens=False)
                matched = next((s for s in g.stop if s in text), None)
            finish = {"type": "stop", "matched": matched}
        meta: dict[str, Any] = {
            "id": req.rid,
            "finish_reason": finish,
            "prompt_tokens": len(req.input_ids),
            "completion_tokens": len(tokens),
            "cached_tokens": 0,
            "weight_version": self.weight_version,
            "e2e_latency": latency_s,
        }
        if return_logprob:
            meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(resp.output_logprobs, tokens)]
            meta["input_token_logprobs"] = []
        text = self.backend.tokenizer.decode(tokens, skip_special_tokens=g.skip_special_tokens)
        return {"text": text, "output_ids": list(tokens), "meta_info": meta}

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

    async def _abort_request(self, request: HTTPRequest) -> HTTPResponse:
        body = request.json() or {}
        if body.get("abort_all"):
            self._abort_all("aborted by abort_all")
        else:
            rid = body.get("rid")
            if not isinstance(rid, str) or not rid:
                raise RequestRejected(400, "give rid (a string) or abort_all: true")
            for key, running in list(self._running.items()):
                if key == rid or key.startswith(rid):
                    self._abort(running, "aborted by abort_request")
        return HTTPResponse(200, b"")

    def _pause(self) -> None:
        self._paused = True

    def _resume(self) -> None:
        self._paused = False
        self._gate.unpark_all()

    async def _pause_generation(self, request: HTTPRequest) -> Any:
        self._require_ready()
        mode = (request.json() or {}).get("mode", "abort")
        if mode not in ("abort", "retract", "in_place"):
            raise RequestRejected(400, f"mode must be abort, retract or in_place, got {mode!r}")
        self._pause()
        await self.backend.pause("abort" if mode == "abort" else "in_place")
        if mode == "abort":  # the running batch answered with its partial tokens; the rest with none
            self._abort_all("aborted by pause_generation")
        return {"message": "Generation paused successfully.", "status": "ok"}

    async def _continue_generation(self, request: HTTPRequest) -> Any:
        self._require_ready()
        await self.backend.resume()
        self._resume()
        return {"message": "Generation continued successfully.", "status": "ok"}

    async def _update_weights_from_disk(self, request: HTTPRequest) -> Any:
        self._require_ready()
        body = request.json() or {}
        path = body.get("model_path")
        if not isinstance(path, str) or not path:
            raise RequestRejected(400, "model_path (a string) is required")
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
                return json_response({"success": False, "message": f"failed to load {path}: {exc}",
                                      "num_paused_requests": 0}, 400)
            self.weight_version = str(weight_version) if weight_version is not None else str(version)
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

    async def _update_weight_version(self, request: HTTPRequest) -> Any:
        body = request.json() or {}
        if "new_version" not in body:
            raise RequestRejected(400, "new_version is required")
        if body.get("abort_all_requests"):
            self._abort_all("aborted for a weight version update")
        self.backend.set_version(self._next_version(body["new_version"]))
        self.weight_version = str(body["new_version"])
        return {"success": True, "message": "Succeeded to update weight version.", "new_version": self.weight_version}

    # -- info ------------------------------------------------------------------------
    async def _health(self, request: HTTPRequest) -> HTTPResponse:
        return HTTPResponse(200 if self.ready else 503, b"")

    async def _model_info(self, request: HTTPRequest) -> Any:
        self._require_ready()
        config = self.backend.model.config
        return {"model_path": self.model_path, "tokenizer_path": self.model_path, "is_generation": True,
                "preferred_sampling_params": None, "weight_version": self.weight_version,
                "model_type": getattr(config, "model_type", None),
                "architectures": getattr(config, "architectures", None)}

    async def _server_info(self, request: HTTPRequest) -> Any:
        return {"version": "trio-rollout", "model_path": self.model_path, "served_model_name": self.served_model_name,
                "weight_version": self.weight_version, "paused": self._paused, "ready": self.ready,
                "num_running_reqs": len(self._running), "counters": dict(self._counts),
                "backend": _plain(dataclasses.asdict(self.backend.statistics()))}

    async def _get_weight_version(self, request: HTTPRequest) -> Any:
        return {"weight_version": self.weight_version}

    async def _get_load(self, request: HTTPRequest) -> Any:
        running = sum(r.dispatched for r in self._running.values())
        return {"num_running_reqs": running, "num_waiting_reqs": len(self._running) - running}

    async def _models(self, request: HTTPRequest) -> Any:
        return {"object": "list", "data": [{"id": self.served_model_name, "object": "model"}]}

    async def _flush_cache(self, request: HTTPRequest) -> HTTPResponse:
        return HTTPResponse(200, b"Cache flushed.", "text/plain")


def _plain(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {str(k): _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    if obj is None or isinstance(obj, (str, int, float, bool)):
        return obj if not (isinstance(obj, float) and not math.isfinite(obj)) else None
    return repr(obj)


# -- process entry points -------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class ServeConfig:
    """Settings of one ``rollout serve`` process."""

    model: str | None = None
    host: str = "127.0.0.1"
    port: int = 30000
    device: str | None = None
    dtype: str = "auto"
    max_batch_size: int = 64
    batch_window_s: float = 0.005
    served_model_name: str | None = None
    torch_threads: int | None = None
    seed: int = 0


async def serve(config: ServeConfig, *, task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED) -> None:
    """Run one server until cancelled (or SIGTERM/SIGINT); ``task_status.started(url)`` once ready."""
    import torch

    from .backends.hf import HFBackend
    from .models import resolve_model

    if config.torch_threads:
        torch.set_num_threads(config.torch_threads)
    torch.manual_seed(config.seed)
    path = await trio.to_thread.run_sync(resolve_model, config.model)
    backend = HFBackend(path, device=config.device, dtype=config.dtype, max_batch_size=config.max_batch_size,
                        batch_window_s=config.batch_window_s)
    app = SGLangServer(backend, model_path=str(path), served_model_name=config.served_model_name or str(path))
    listeners = await open_listeners(config.host, config.port)  # a busy port: OSError here, not in a group
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async with trio.open_nursery() as nursery:

            async def stop_on_signal() -> None:
                async for signum in signals:
                    logger.warning("rollout serve: got signal %s, stopping", signum)
                    nursery.cancel_scope.cancel()

            nursery.start_soon(stop_on_signal)
            port = await nursery.start(functools.partial(serve_http, app.handle, listeners=listeners))
            url = f"http://{config.host}:{port}"
            print(f"rollout serve: listening on {url} (loading {path})", flush=True)
            await nursery.start(app.run)
            print(f"rollout serve: ready on {url}", flush=True)
            task_status.started(url)


def add_serve_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``serve`` sub-command to ``subparsers`` (``rollout serve``)."""
    p = subparsers.add_parser("serve", help="serve a local model behind SGLang's native HTTP API",
                              description="Serve a local model (the hf backend) behind SGLang's /generate API.")
    p.add_argument("--model", default=None, help="HF model folder or hub id (default: the built-in SmolLM2-135M)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=30000, help="port (default 30000; 0 = any free port, printed)")
    p.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    p.add_argument("--dtype", default="auto", help="auto (default), float32, bfloat16, float16")
    p.add_argument("--max-batch-size", type=int, default=64, help="requests per generate batch (default 64)")
    p.add_argument("--batch-window-ms", type=float, default=5.0,
                   help="wait this long for more requests before a batch starts (default 5)")
    p.add_argument("--served-model-name", default=None, help="name reported by /v1/models")
    p.add_argument("--torch-threads", type=int, default=None, help="torch intra-op threads")
    p.add_argument("--seed", type=int, default=0, help="torch seed (default 0)")
    p.set_defaults(handler=run_serve)
    return p


def run_serve(args: argparse.Namespace) -> int:
    """Run ``rollout serve`` from parsed arguments; returns the exit status."""
    if args.port < 0 or args.port > 65535:
        print(f"rollout: error: --port must be in [0, 65535], got {args.port}", file=sys.stderr)
        return 2
    if args.max_batch_size < 1 or not (args.batch_window_ms >= 0):
        print("rollout: error: --max-batch-size must be >= 1 and --batch-window-ms >= 0", file=sys.stderr)
        return 2
    config = ServeConfig(model=args.model, host=args.host, port=args.port, device=args.device, dtype=args.dtype,
                         max_batch_size=args.max_batch_size, batch_window_s=args.batch_window_ms / 1000.0,
                         served_model_name=args.served_model_name, torch_threads=args.torch_threads, seed=args.seed)
    try:
        try:
            trio.run(serve, config)
        except BaseExceptionGroup as group:  # raised inside the server's nursery (e.g. loading the model)
            raise unwrap_single(group) from None
    except (RolloutError, ValueError, OSError) as exc:
        print(f"rollout: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        pass
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rollout")
    add_serve_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["serve", *(sys.argv[1:] if argv is None else argv)])
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())

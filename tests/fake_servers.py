"""Scripted fake SGLang and vLLM servers for the remote backend tests.

A fake is an async ``handle(HTTPRequest) -> HTTPResponse`` app (the interface of
``engine.serve.serve_http``), so the same fake runs in-process behind
``httpx.MockTransport`` (:func:`mock_transport`, virtual time) or on a real socket on
127.0.0.1 (``nursery.start(serve_http, fake.handle)``).

Generation is deterministic: ``n = min(budget, fake.length)`` tokens
``(sum(input_ids) + i + offset(weights)) % 200 + 5`` (``offset`` is 0 for the initial weights
``""``); finish ``length`` when ``n == budget`` else ``stop``.  Logprobs come from a toy model
(:func:`fake_logits`, a function of the prefix and the weights) and model the semantics each
fake claims: the SGLang fake returns *processed* logprobs (``log_softmax(logits /
temperature)``, SGLang's default), the vLLM fake its ``logprobs_mode`` (``"raw_logprobs"``:
``log_softmax(logits)``, vLLM's default; ``"processed_logprobs"``, the default here, as the
``vllm`` backend requires) and reports it on ``GET /server_info?config_format=json``.  Weight
updates (SGLang ``/update_weights_from_disk``, vLLM ``/collective_rpc reload_weights``)
switch ``fake.weights`` to the given path: later tokens and logprobs change.  Each ``/generate`` call pops one step of ``fake.script``
(default ``"ok"``):

``"ok"``, ``"500"``, ``"503"``, ``"400"``, ``"401"``, ``"403"``, ``"malformed"`` (200 with a broken JSON body),
``"mismatch"`` (one logprob fewer than tokens), ``"sentinel"`` (a -9999 logprob),
``"hang"`` (until ``fake.hold`` is set, or aborted by rid: then finish ``abort`` with
``fake.partial_on_abort`` tokens), ``"drop"`` (the connection is lost: MockTransport only),
``("abort", k)`` (abort with ``k`` partial tokens; ``("abort", k, "die")`` also starts refusing),
``"abort_empty"`` (abort with none), ``("reject", code)`` (finish abort with a status code).
``fake.refuse = True`` makes MockTransport refuse connections; ``fake.health`` is the
``/health`` status.
"""

from __future__ import annotations

import json
import math
import zlib
from typing import Any
from urllib.parse import parse_qs

import httpx
import trio

from engine.serve import HTTPRequest, HTTPResponse, json_response


FAKE_VOCAB = 256


def _weights_seed(weights: str) -> int:
    return 0 if not weights else zlib.crc32(weights.encode()) % 997 + 1


def fake_logits(prefix: list[int], weights: str = "") -> list[float]:
    """The toy model: next-token logits ``[FAKE_VOCAB]`` after ``prefix``."""
    seed = _weights_seed(weights)
    shift = 0.011 * sum(prefix) + 0.7 * (prefix[-1] if prefix else 0) + 0.37 * seed
    return [3.0 * math.sin(0.37 * v + shift) for v in range(FAKE_VOCAB)]


def fake_logprob(prefix: list[int], token: int, temperature: float = 1.0, weights: str = "") -> float:
    """``log_softmax(fake_logits(prefix) / temperature)[token]``."""
    scaled = [x / temperature for x in fake_logits(prefix, weights)]
    top = max(scaled)
    return scaled[token] - top - math.log(sum(math.exp(x - top) for x in scaled))


def fake_tokens(input_ids: list[int], n: int, *, temperature: float = 1.0,
                weights: str = "") -> tuple[list[int], list[float]]:
    """The ``n`` tokens a fake generates after ``input_ids`` and their logprobs under the
    distribution at ``temperature`` (1.0: raw)."""
    base = sum(input_ids) + _weights_seed(weights)
    tokens = [(base + i) % 200 + 5 for i in range(n)]
    prefix = list(input_ids)
    logprobs = []
    for t in tokens:
        logprobs.append(fake_logprob(prefix, t, temperature, weights))
        prefix.append(t)
    return tokens, logprobs


class _Fake:
    def __init__(self, *, length: int = 4, delay_s: float = 0.0) -> None:
        self.length = length
        self.delay_s = delay_s
        self.script: list[Any] = []
        self.health = 200
        self.refuse = False
        self.generate_calls: list[dict[str, Any]] = []
        self.aborts: list[Any] = []
        self.calls: list[tuple[str, str]] = []
        self.control: list[tuple[str, Any]] = []
        self.paused = False
        self.partial_on_abort = 0
        self.running: dict[str, trio.CancelScope] = {}
        self.hold = trio.Event()  # "hang" steps wait for this (or an abort)
        self.weights = ""  # the checkpoint loaded ("" = the initial weights)
        self.weight_version = "0"

    def step(self) -> Any:
        return self.script.pop(0) if self.script else "ok"

    def _generator(self, ids: list[int], temperature: float) -> Any:
        """``n -> (tokens, logprobs)`` with the weights loaded *now* (a weight update
        while a request hangs does not change what it already generated)."""
        weights = self.weights
        return lambda n: fake_tokens(ids, n, temperature=temperature, weights=weights)

    def n_tokens(self, budget: int) -> int:
        return min(budget, self.length)

    async def _run(self, rid: str, step: Any) -> bool:
        """Wait as the step says; False if aborted meanwhile."""
        scope = trio.CancelScope()
        self.running[rid] = scope
        try:
            with scope:
                if self.delay_s:
                    await trio.sleep(self.delay_s)
                if step == "hang":
                    await self.hold.wait()
            return not scope.cancelled_caught
        finally:
            self.running.pop(rid, None)

    def abort(self, rid: str | None) -> None:
        for key, scope in list(self.running.items()):
            if rid is None or key == rid or key.startswith(rid):
                scope.cancel()


class FakeSGLang(_Fake):
    """SGLang's native routes: /generate, /abort_request, /pause_generation,
    /continue_generation, /update_weights_from_disk, /health, /get_model_info."""

    weight_version = "0"
    model_path = "fake"  # what /get_model_info reports

    async def handle(self, request: HTTPRequest) -> HTTPResponse:
        self.calls.append((request.method, request.path))
        body = request.json()
        if request.path == "/health":
            return HTTPResponse(self.health, b"OK", "text/plain")  # like an sglang-router
        if request.path == "/generate":
            return await self._generate(body)
        if request.path == "/abort_request":
            self.aborts.append(body)
            self.abort(None if body.get("abort_all") else body["rid"])
            return HTTPResponse(200, b"")
        if request.path == "/pause_generation":
            self.control.append(("pause", body))
            self.paused = True
            if (body or {}).get("mode", "abort") == "abort":
                self.abort(None)
            return json_response({"message": "paused", "status": "ok"})
        if request.path == "/continue_generation":
            self.control.append(("continue", body))
            self.paused = False
            return json_response({"message": "continued", "status": "ok"})
        if request.path == "/update_weights_from_disk":
            self.control.append(("update", body))
            self.weights = body["model_path"]
            self.weight_version = body.get("weight_version", self.weight_version)
            return json_response({"success": True, "message": "ok", "num_paused_requests": 0})
        if request.path == "/get_model_info":
            return json_response({"model_path": self.model_path, "weight_version": self.weight_version})
        return json_response({"detail": "Not Found"}, 404)

    async def _generate(self, body: dict[str, Any]) -> HTTPResponse:
        self.generate_calls.append(body)
        step = self.step()
        if step in ("500", "503", "400", "401", "403"):
            return json_response({"error": {"message": f"scripted {step}"}}, int(step))
        if step == "malformed":
            return HTTPResponse(200, b'{"text": "trunc')
        rid, ids = body["rid"], body["input_ids"]
        budget = body["sampling_params"]["max_new_tokens"]
        temperature = body["sampling_params"].get("temperature", 1.0)  # processed logprobs (SGLang's default)
        gen = self._generator(ids, temperature if temperature >= 1e-6 else 1.0)
        finished = await self._run(rid, step)
        if not finished:
            tokens, lps = gen(min(budget, self.partial_on_abort))
            return self._answer(rid, tokens, lps, {"type": "abort", "message": "aborted", "status_code": None})
        if isinstance(step, tuple) and step[0] == "abort":
            tokens, lps = gen(step[1])
            self.refuse = self.refuse or step[2:] == ("die",)
            return self._answer(rid, tokens, lps, {"type": "abort", "message": "scripted"})
        if step == "abort_empty":
            return self._answer(rid, [], [], {"type": "abort", "message": "scripted"})
        if isinstance(step, tuple) and step[0] == "reject":
            return self._answer(rid, [], [], {"type": "abort", "message": "scripted reject", "status_code": step[1]})
        n = self.n_tokens(budget)
        tokens, lps = gen(n)
        finish = {"type": "length", "length": n} if n == budget else {"type": "stop", "matched": tokens[-1]}
        if step == "mismatch":
            lps = lps[:-1]
        if step == "sentinel":
            lps[0] = -9999.0
        return self._answer(rid, tokens, lps, finish)

    def _answer(self, rid: str, tokens: list[int], lps: list[float], finish: dict[str, Any]) -> HTTPResponse:
        items = [[lp, t, None] for lp, t in zip(lps, tokens)]
        return json_response({"text": "", "output_ids": tokens, "meta_info": {
            "id": rid, "finish_reason": finish, "completion_tokens": len(tokens),
            "weight_version": self.weight_version, "output_token_logprobs": items}})


class FakeVLLM(_Fake):
    """vLLM's routes: /v1/completions, /v1/models, /abort_requests, /pause, /resume, /health,
    and (dev mode) /server_info, /collective_rpc reload_weights (or the worker extension's
    rollout_reload_weights when ``worker_extension_cls`` is set), /reset_prefix_cache,
    /update_weight_version.  ``device``: ``device_config.device`` in /server_info (None: absent)."""

    def __init__(self, *, logprobs_mode: str = "processed_logprobs", dev_mode: bool = True,
                 device: str | None = None, worker_extension_cls: str = "", **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.logprobs_mode = logprobs_mode
        self.dev_mode = dev_mode
        self.device = device
        self.worker_extension_cls = worker_extension_cls

    async def handle(self, request: HTTPRequest) -> HTTPResponse:
        self.calls.append((request.method, request.path))
        body = request.json()
        if request.path == "/health":
            return HTTPResponse(self.health, b"")
        if not self.dev_mode and request.path in ("/server_info", "/collective_rpc", "/update_weight_version",
                                                  "/pause", "/resume", "/abort_requests", "/reset_prefix_cache"):
            return json_response({"detail": "Not Found"}, 404)
        if request.path == "/server_info":
            assert request.query.get("config_format") == ["json"]
            config: dict[str, Any] = {"model_config": {"logprobs_mode": self.logprobs_mode},
                                      "parallel_config": {"worker_extension_cls": self.worker_extension_cls}}
            if self.device is not None:
                config["device_config"] = {"device": self.device}
            return json_response({"vllm_config": config})
        if request.path == "/collective_rpc":
            self.control.append(("rpc", body))
            if self.worker_extension_cls:
                assert body["method"] == "rollout_reload_weights" and set(body["kwargs"]) == {"weights_path"}
            else:
                assert body["method"] == "reload_weights" and body["kwargs"]["is_checkpoint_format"] is True
            self.weights = body["kwargs"]["weights_path"]
            return json_response({"results": [None]})
        if request.path == "/reset_prefix_cache":
            self.control.append(("reset_prefix_cache", None))
            return json_response({"success": True})
        if request.path == "/update_weight_version":
            self.control.append(("version", body))
            self.weight_version = body["new_version"]
            return json_response({"success": True, "new_version": self.weight_version})
        if request.path == "/v1/models":
            return json_response({"object": "list", "data": [{"id": "tiny", "object": "model"}]})
        if request.path == "/abort_requests":
            self.aborts.append(body)
            for engine_id in body.get("request_ids") or []:
                assert engine_id.startswith("cmpl-") and engine_id.endswith("-0")
                self.abort(engine_id[len("cmpl-"):-len("-0")])
            return json_response({"status": "aborted", "aborted": len(body.get("request_ids") or [])})
        if request.path == "/pause":
            self.control.append(("pause", request.query))
            self.paused = True
            if request.query.get("mode", ["abort"])[0] == "abort":
                self.abort(None)
            return json_response({"status": "paused"})
        if request.path == "/resume":
            self.control.append(("resume", None))
            self.paused = False
            return json_response({"status": "resumed"})
        if request.path == "/v1/completions":
            return await self._complete(body)
        return json_response({"detail": "Not Found"}, 404)

    async def _complete(self, body: dict[str, Any]) -> HTTPResponse:
        self.generate_calls.append(body)
        step = self.step()
        if step in ("500", "503", "400", "401", "403"):
            return json_response({"error": {"message": f"scripted {step}"}}, int(step))
        rid, ids, budget = body["request_id"], body["prompt"], body["max_tokens"]
        temperature = body.get("temperature", 1.0)
        processed = self.logprobs_mode == "processed_logprobs" and temperature >= 1e-6
        gen = self._generator(ids, temperature if processed else 1.0)  # raw: before the temperature
        finished = await self._run(rid, step)
        if not finished:
            tokens, lps = gen(min(budget, self.partial_on_abort))
            return self._answer(rid, tokens, lps, "abort")
        if isinstance(step, tuple) and step[0] == "abort":
            tokens, lps = gen(step[1])
            return self._answer(rid, tokens, lps, "abort")
        n = self.n_tokens(budget)
        tokens, lps = gen(n)
        return self._answer(rid, tokens, lps, "length" if n == budget else "stop")

    def _answer(self, rid: str, tokens: list[int], lps: list[float], finish: str) -> HTTPResponse:
        return json_response({"id": f"cmpl-{rid}", "object": "text_completion", "choices": [{
            "index": 0, "text": "", "finish_reason": finish, "stop_reason": None, "token_ids": tokens,
            "logprobs": {"token_logprobs": lps, "tokens": [f"token_id:{t}" for t in tokens],
                         "top_logprobs": None, "text_offset": [0] * len(tokens)}}]})


def mock_transport(fakes: dict[str, _Fake]) -> httpx.MockTransport:
    """An ``httpx.MockTransport`` that routes each base URL (``http://host:port``) to its fake."""

    async def handler(request: httpx.Request) -> httpx.Response:
        base = f"{request.url.scheme}://{request.url.host}:{request.url.port}"
        fake = fakes[base]
        if fake.refuse:
            raise httpx.ConnectError("[Errno 111] Connection refused", request=request)
        if request.url.path in ("/generate", "/v1/completions") and fake.script and fake.script[0] == "drop":
            fake.script.pop(0)
            fake.generate_calls.append(json.loads(request.content))
            raise httpx.RemoteProtocolError("Server disconnected without sending a response.", request=request)
        req = HTTPRequest(request.method, request.url.path, parse_qs(request.url.query.decode()),
                          dict(request.headers), request.content)
        resp = await fake.handle(req)
        return httpx.Response(resp.status, content=resp.body, headers={"content-type": resp.content_type})

    return httpx.MockTransport(handler)

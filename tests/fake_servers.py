"""Scripted fake SGLang and vLLM servers for the remote backend tests.

A fake is an async ``handle(HTTPRequest) -> HTTPResponse`` app (the interface of
``engine.serve.serve_http``), so the same fake runs in-process behind
``httpx.MockTransport`` (:func:`mock_transport`, virtual time) or on a real socket on
127.0.0.1 (``nursery.start(serve_http, fake.handle)``).

Generation is deterministic: ``n = min(budget, fake.length)`` tokens
``(sum(input_ids) + i) % 200 + 5`` with logprobs ``-0.1 * (i + 1)``; finish ``length`` when
``n == budget`` else ``stop``.  Each ``/generate`` call pops one step of ``fake.script``
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
from typing import Any
from urllib.parse import parse_qs

import httpx
import trio

from engine.serve import HTTPRequest, HTTPResponse, json_response


def fake_tokens(input_ids: list[int], n: int) -> tuple[list[int], list[float]]:
    base = sum(input_ids)
    return [(base + i) % 200 + 5 for i in range(n)], [-0.1 * (i + 1) for i in range(n)]


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

    def step(self) -> Any:
        return self.script.pop(0) if self.script else "ok"

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
        finished = await self._run(rid, step)
        if not finished:
            tokens, lps = fake_tokens(ids, min(budget, self.partial_on_abort))
            return self._answer(rid, tokens, lps, {"type": "abort", "message": "aborted", "status_code": None})
        if isinstance(step, tuple) and step[0] == "abort":
            tokens, lps = fake_tokens(ids, step[1])
            self.refuse = self.refuse or step[2:] == ("die",)
            return self._answer(rid, tokens, lps, {"type": "abort", "message": "scripted"})
        if step == "abort_empty":
            return self._answer(rid, [], [], {"type": "abort", "message": "scripted"})
        if isinstance(step, tuple) and step[0] == "reject":
            return self._answer(rid, [], [], {"type": "abort", "message": "scripted reject", "status_code": step[1]})
        n = self.n_tokens(budget)
        tokens, lps = fake_tokens(ids, n)
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
    """vLLM's routes: /v1/completions, /v1/models, /abort_requests, /pause, /resume, /health."""

    async def handle(self, request: HTTPRequest) -> HTTPResponse:
        self.calls.append((request.method, request.path))
        body = request.json()
        if request.path == "/health":
            return HTTPResponse(self.health, b"")
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
        finished = await self._run(rid, step)
        if not finished:
            tokens, lps = fake_tokens(ids, min(budget, self.partial_on_abort))
            return self._answer(rid, tokens, lps, "abort")
        if isinstance(step, tuple) and step[0] == "abort":
            tokens, lps = fake_tokens(ids, step[1])
            return self._answer(rid, tokens, lps, "abort")
        n = self.n_tokens(budget)
        tokens, lps = fake_tokens(ids, n)
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

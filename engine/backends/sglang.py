"""``sglang``: SGLang's native token-in/token-out ``POST /generate`` (non-streaming).

Also speaks to ``rollout serve`` (``engine/serve.py``) and, as one server, to an
sglang-router / SGLang Model Gateway URL.  Verified with ``sglang-router`` 0.3.2 in front of
``rollout serve`` (``tests/test_remote_router.py``): ``/generate`` and ``/health`` (a plain
``OK``) pass, a client disconnect stops the worker, but ``/abort_request``,
``/pause_generation`` and ``/continue_generation`` answer 404 -- send control calls to the
workers (``servers=await backend.router_workers()``, from the router's ``GET /workers``).
Wire facts: ``SERVERS_AND_MODELS.md`` §1 and §6.

Request (one segment)::

    {"input_ids": [...], "rid": "<rid>@<seq>", "return_logprob": true, "stream": false,
     "sampling_params": {"max_new_tokens": budget, "temperature": 0 if greedy else t,
                         "top_p", "top_k": -1 when disabled, "min_new_tokens",
                         "stop_token_ids", "stop" (if any), "ignore_eos",
                         "skip_special_tokens", "frequency_penalty",
                         "sampling_seed" (if gconfig.seed is set)}}

Answer: tokens and logprobs from ``meta_info.output_token_logprobs`` (``[logprob, token_id,
text]`` items; ``output_ids`` when present must agree), stop reason from
``meta_info.finish_reason.type`` (``stop``/``length``/``abort``; an ``abort`` carrying a 4xx
``status_code`` is the server rejecting the request and fails it), ``meta_info.weight_version``
recorded per server.

Logprob semantics: ``"processed"`` -- SGLang returns log-probabilities of the
temperature-scaled distribution unless the server runs with ``SGLANG_RETURN_ORIGINAL_LOGPROB=1``.

Abort: ``POST /abort_request {"rid": wire_id}``.  Pause: ``POST /pause_generation``
(``{}`` for the default abort mode, ``{"mode": "retract"|"in_place"}`` otherwise), continue:
``POST /continue_generation``.  Weights (:class:`~engine.backends.base.WeightSync`, through
``engine.update_weights``): ``POST /update_weights_from_disk {"model_path", "weight_version",
"abort_all_requests": true}`` on every server of the pool (:meth:`SGLangBackend.update_weights_from_disk`
for the raw call).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from ..errors import BackendError
from ..types import ModelRequest
from .remote import ParsedGeneration, RemoteBackend, RemoteCallError, WireCall, sampling_top_k

__all__ = ["SGLangBackend"]

logger = logging.getLogger(f"rollout.{__name__}")  # the package's one logging namespace

_FINISH = {"stop": "stop", "length": "length", "abort": "abort"}


class SGLangBackend(RemoteBackend):
    """Several SGLang servers (or ``rollout serve`` processes) behind one backend.

    Args: see :class:`~engine.backends.remote.RemoteBackend`.
    """

    kind = "sglang"
    generate_path = "/generate"
    health_path = "/health"
    pause_modes = ("abort", "retract", "in_place")

    def build_payload(self, request: ModelRequest, budget: int, wire_id: str) -> dict[str, Any]:
        g = request.gconfig
        params: dict[str, Any] = {
            "max_new_tokens": budget,
            "temperature": 0.0 if g.greedy else float(g.temperature),
            "top_p": 1.0 if g.greedy else float(g.top_p),
            "top_k": -1 if g.greedy else sampling_top_k(g.top_k),
            "min_new_tokens": min(g.min_new_tokens, budget),
            "stop_token_ids": list(g.stop_token_ids),
            "ignore_eos": bool(g.ignore_eos),
            "skip_special_tokens": bool(g.skip_special_tokens),
            "frequency_penalty": float(g.frequency_penalty),
        }
        if g.stop:
            params["stop"] = list(g.stop)
        if g.seed is not None:
            params["sampling_seed"] = int(g.seed)
        payload: dict[str, Any] = {
            "input_ids": list(request.input_ids),
            "sampling_params": params,
            "rid": wire_id,
            "return_logprob": True,
            "stream": False,
        }
        if request.image_data:
            payload["image_data"] = list(request.image_data)
        return payload

    def parse_generation(self, body: Any) -> ParsedGeneration:
        if isinstance(body, list):  # a batch answer of one
            if len(body) != 1:
                raise ValueError(f"expected one result, got a list of {len(body)}")
            body = body[0]
        meta = body["meta_info"]
        finish = meta.get("finish_reason")
        if not isinstance(finish, dict) or "type" not in finish:
            raise ValueError(f"meta_info.finish_reason is {finish!r}, expected an object with a type")
        kind = finish["type"]
        if kind not in _FINISH:
            raise ValueError(f"unknown finish_reason type {kind!r}")
        if kind == "abort":
            code = finish.get("status_code")
            if isinstance(code, int) and 400 <= code < 500:
                raise RemoteCallError(f"server rejected the request (HTTP {code}): {finish.get('message')}",
                                      server_fault=False)
        items = meta.get("output_token_logprobs")
        if items is None:
            if meta.get("completion_tokens", 0) and kind != "abort":
                raise ValueError("meta_info.output_token_logprobs is missing (return_logprob not honoured?)")
            items = []
        tokens: list[int] = []
        logprobs: list[float] = []
        for item in items:
            lp, tid = item[0], item[1]
            tokens.append(tid)
            logprobs.append(float("nan") if lp is None else lp)
        output_ids = body.get("output_ids")
        if isinstance(output_ids, list) and output_ids != tokens:
            if len(output_ids) == len(tokens):
                raise RemoteCallError("output_ids disagree with the token ids in meta_info.output_token_logprobs")
            tokens = output_ids  # count mismatch: the engine's evidence check reports it
        version = meta.get("weight_version")
        return ParsedGeneration(tokens, logprobs, _FINISH[kind], None if version is None else str(version))

    def abort_call(self, wire_id: str):
        return "POST", "/abort_request", {"rid": wire_id}, None

    def pause_call(self, mode: str):
        return "POST", "/pause_generation", ({} if mode == "abort" else {"mode": mode}), None

    def continue_call(self):
        return "POST", "/continue_generation", {}, None

    def model_info_call(self):
        return "GET", "/get_model_info"

    def parse_model_name(self, answer: Any) -> str | None:
        return answer.get("tokenizer_path") or answer.get("model_path")

    async def abort_all(self, *, servers: Sequence[str] | None = None) -> dict[str, Any]:
        """``POST /abort_request {"abort_all": true}`` on every healthy server (or ``servers``)."""
        answers, errors = await self.broadcast("POST", "/abort_request", json={"abort_all": True}, servers=servers)
        self._raise_if_any(errors, "abort_all")
        return answers

    async def get_model_info(self, url: str | None = None) -> Any:
        """``GET /get_model_info`` of one server (default: the first healthy one)."""
        url = url or _first_healthy(self)
        return await self.call(url, "GET", "/get_model_info")

    def weight_update_calls(self, folder: str, version: int) -> list[WireCall]:
        # abort_all_requests: what is still running (nothing, after pause("abort")) answers
        # abort with its partial tokens instead of holding the update
        return [("POST", "/update_weights_from_disk",
                 {"model_path": folder, "weight_version": str(version), "abort_all_requests": True}, None)]

    async def update_weights_from_disk(self, model_path: str, *, version: int | None = None,
                                       abort_all_requests: bool = False, servers: Sequence[str] | None = None,
                                       **extra: Any) -> dict[str, Any]:
        """The raw call: ``POST /update_weights_from_disk`` on every healthy server (or
        ``servers``).  ``engine.update_weights`` (pause, this, set the version, resume) is
        the usual way; this one changes no version.

        Args:
            model_path: the checkpoint folder, as the servers see it.
            version: sent as ``weight_version``.
            abort_all_requests: let the servers abort in-flight requests first.
            servers: explicit targets (e.g. :meth:`router_workers`); default the healthy servers.
            extra: more body fields (``load_format``, ``flush_cache``, ...).

        A pool server that fails, or is ejected at the time, is ejected and marked stale: when
        it answers its health probe again the same update is replayed before it is re-admitted.

        Returns ``{url: answer}`` of the servers that succeeded.

        Raises:
            BackendError: no server succeeded.
        """
        body: dict[str, Any] = {"model_path": model_path, "abort_all_requests": abort_all_requests, **extra}
        if version is not None:
            body["weight_version"] = str(version)
        return await self.apply_weight_update([("POST", "/update_weights_from_disk", body, None)], what=model_path,
                                              servers=servers)


def _first_healthy(backend: RemoteBackend) -> str:
    healthy = backend.pool.healthy
    if not healthy:
        raise BackendError(f"{backend.kind}: no healthy server")
    return healthy[0].url

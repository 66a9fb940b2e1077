"""``sglang``: SGLang's native token-in/token-out ``POST /generate`` (non-streaming).

Also speaks to ``rollout serve`` (:mod:`engine.serve`) and, as one server, to an
sglang-router / SGLang Model Gateway URL.  Verified with ``sglang-router`` 0.3.2 in front of
``rollout serve`` (``tests/contract/test_remote_router.py``): ``/generate`` and ``/health`` (a plain
``OK``) pass, a client disconnect stops the worker, but ``/abort_request``,
``/pause_generation`` and ``/continue_generation`` answer 404 -- send control calls to the
workers (``servers=await backend.router_workers()``, from the router's ``GET /workers``).
Wire facts: ``SERVERS_AND_MODELS.md`` §1 and §6.

Request and answer: :mod:`engine.backends.sglang_wire`, the module ``rollout serve`` reads
and writes them with.  Tokens and logprobs come from ``meta_info.output_token_logprobs``
(``output_ids`` when present must agree), the stop reason from
``meta_info.finish_reason.type`` (``stop``/``length``/``abort``; an ``abort`` carrying a 4xx
``status_code`` is the server rejecting the request and fails it), ``meta_info.weight_version``
is recorded per server.

Logprob semantics: ``"processed"`` -- SGLang returns log-probabilities of the
temperature-scaled distribution unless the server runs with ``SGLANG_RETURN_ORIGINAL_LOGPROB=1``.

Priority: a non-zero ``ModelRequest.priority`` (lower is served first, as in vLLM) goes out
as ``priority``, negated to SGLang's default sense (higher first; SGLang honours it only with
``--enable-priority-scheduling``); ``SGLangBackend(low_priority_values_first=True)`` for a
server started with ``--schedule-low-priority-values-first`` sends it as is
(:func:`engine.backends.sglang_wire.generate_payload`).

Abort: ``POST /abort_request {"rid": wire_id}``.  Pause: ``POST /pause_generation``
(``{}`` for the default abort mode, ``{"mode": "retract"|"in_place"}`` otherwise), continue:
``POST /continue_generation``.  Weights (:class:`~engine.backends.base.WeightSync`, through
``engine.update_weights``): ``POST /update_weights_from_disk {"model_path", "weight_version",
"abort_all_requests": true}`` on every server of the pool (:meth:`SGLangBackend.update_weights_from_disk`
for the raw call).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ...errors import BackendError
from ...types import ModelRequest
from .. import sglang_wire
from ._backend import RemoteBackend
from ._control import raise_if_any
from ._errors import RemoteCallError
from ._wire import LoraLimits, ParsedGeneration, WireCall, WireProtocol

__all__ = ["SGLangBackend", "SGLangWire"]


class SGLangWire(WireProtocol):
    """SGLang's native API as a :class:`~engine.backends.remote.WireProtocol`.

    Args:
        low_priority_values_first: the servers run ``--schedule-low-priority-values-first``
            (see the module docstring, "Priority").
    """

    generate_path = "/generate"
    health_path = "/health"
    pause_modes = ("abort", "retract", "in_place")

    def __init__(self, *, low_priority_values_first: bool = False) -> None:
        self.low_priority_values_first = low_priority_values_first

    def build_payload(self, request: ModelRequest, budget: int, wire_id: str) -> dict[str, Any]:
        return sglang_wire.generate_payload(request, budget, wire_id,
                                            low_priority_values_first=self.low_priority_values_first)

    def parse_generation(self, body: Any) -> ParsedGeneration:
        try:
            answer = sglang_wire.parse_generate_answer(body)
        except sglang_wire.AnswerRejected as exc:
            raise RemoteCallError(str(exc), server_fault=exc.server_fault) from None
        return ParsedGeneration(answer.tokens, answer.logprobs, answer.stop_reason, answer.weight_version)

    def abort_call(self, wire_id: str) -> WireCall:
        return "POST", "/abort_request", {"rid": wire_id}, None

    def pause_call(self, mode: str) -> WireCall:
        return "POST", "/pause_generation", ({} if mode == "abort" else {"mode": mode}), None

    def continue_call(self) -> WireCall:
        return "POST", "/continue_generation", {}, None

    def weight_update_calls(self, folder: str, version: int) -> list[WireCall]:
        # abort_all_requests: what is still running (nothing, after pause("abort")) answers
        # abort with its partial tokens instead of holding the update
        return [("POST", "/update_weights_from_disk",
                 {"model_path": folder, "weight_version": str(version), "abort_all_requests": True}, None)]

    def model_info_call(self) -> tuple[str, str]:
        return "GET", "/get_model_info"

    def parse_model_name(self, answer: Any) -> str | None:
        return answer.get("tokenizer_path") or answer.get("model_path")

    # -- LoRA (--enable-lora; /load_lora_adapter, /unload_lora_adapter) -------------------------
    def lora_load_call(self, name: str, folder: str) -> tuple[str, str, Any]:
        return "POST", "/load_lora_adapter", {"lora_name": name, "lora_path": folder}

    def lora_unload_call(self, name: str) -> tuple[str, str, Any]:
        return "POST", "/unload_lora_adapter", {"lora_name": name}

    def lora_info_call(self) -> tuple[str, str, dict[str, Any] | None]:
        return "GET", "/get_server_info", None

    def parse_lora_limits(self, answer: Any) -> LoraLimits:
        enabled = answer.get("enable_lora")
        if enabled is None and "lora_paths" in answer:
            enabled = bool(answer.get("lora_paths"))
        rank = answer.get("max_lora_rank")
        return LoraLimits(enabled=None if enabled is None else bool(enabled),
                          max_rank=int(rank) if rank is not None else None, base_model=answer.get("model_path"))

    def with_adapter(self, payload: dict[str, Any], name: str) -> dict[str, Any]:
        return {**payload, "lora_path": name}  # SGLang's field: a loaded adapter's name

    def lora_enable_fix(self, rank: int) -> str:
        return f"restart it with --enable-lora --max-lora-rank {max(rank, 8)}"

    def explain_lora_error(self, message: str, name: str) -> str:
        if "HTTP 404" in message:
            return f"{message} (this server has no /load_lora_adapter: an SGLang with dynamic LoRA loading is needed)"
        if "already" in message and "load" in message:
            return (f"{message} (that name is in use on the server: another run or another client of it? "
                    f"pick another lora_name than {name!r}, or unload it)")
        return message

    def lora_not_loaded(self, message: str) -> bool:
        return "not loaded" in message or "not found" in message.lower()


class SGLangBackend(RemoteBackend):
    """Several SGLang servers (or ``rollout serve`` processes) behind one backend.

    Args:
        low_priority_values_first: the servers run with
            ``--schedule-low-priority-values-first``: send ``ModelRequest.priority`` as is
            (default: negated, SGLang's default sense; see the module docstring).
        Others: see :class:`~engine.backends.remote.RemoteBackend` (the wire protocol is
            :class:`SGLangWire`).
    """

    kind = "sglang"

    def __init__(self, servers: Sequence[str] | str, *, low_priority_values_first: bool = False,
                 **kwargs: Any) -> None:
        super().__init__(servers, wire=SGLangWire(low_priority_values_first=low_priority_values_first), **kwargs)

    async def abort_all(self, *, servers: Sequence[str] | None = None) -> dict[str, Any]:
        """``POST /abort_request {"abort_all": true}`` on every healthy server (or ``servers``)."""
        answers, errors = await self.broadcast("POST", "/abort_request", json={"abort_all": True}, servers=servers)
        raise_if_any(self.kind, errors, "abort_all")
        return answers

    async def get_model_info(self, url: str | None = None) -> Any:
        """``GET /get_model_info`` of one server (default: the first healthy one).

        Raises:
            BackendError: no healthy server.
        """
        if not url:
            healthy = self.pool.healthy
            if not healthy:
                raise BackendError(f"{self.kind}: no healthy server")
            url = healthy[0].url
        return await self.call(url, "GET", "/get_model_info")

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

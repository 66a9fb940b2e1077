"""What a kind of inference server looks like on the wire: a :class:`WireProtocol`.

The request machine (``_backend``) is the same for every server; a wire protocol says how
to write one segment's request, read its answer, and spell the control calls (abort,
pause, continue, weight update, model info).  Pure: it builds and parses bodies, and never
sends anything.  Implementations: :class:`~engine.backends.remote.sglang.SGLangWire`
(SGLang's ``/generate``, also ``rollout serve``) and
:class:`~engine.backends.remote.vllm.VLLMWire` (vLLM's ``/v1/completions``).
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any, ClassVar

from ...errors import BackendError
from ...types import ModelRequest

__all__ = ["LoraLimits", "ParsedGeneration", "WireCall", "WireProtocol"]

#: one control call: ``(method, path, json body, query params)``
WireCall = tuple[str, str, Any, "dict[str, Any] | None"]


@dataclass
class ParsedGeneration:
    """What a wire protocol reads from one generate answer.

    Attributes:
        tokens: output token ids.
        logprobs: one per token (NaN where the server sent none).
        stop_reason: ``"stop"``, ``"length"``, ``"abort"`` (or ``"tool_calls"``).
        weight_version: the server's own weight version, when it reports one.
    """

    tokens: list[int]
    logprobs: list[float]
    stop_reason: str
    weight_version: str | None = None


@dataclass(frozen=True)
class LoraLimits:
    """What a server says about its LoRA support (``None``: it does not say).

    Attributes:
        enabled: the server was started with LoRA on (vLLM/SGLang ``--enable-lora``).
        max_rank: its ``--max-lora-rank``.
        base_model: the base model it serves (a path or hub id).
    """

    enabled: bool | None = None
    max_rank: int | None = None
    base_model: str | None = None


class WireProtocol(abc.ABC):
    """One kind of server's HTTP API (see the module docstring).

    Attributes:
        generate_path: the route one segment is POSTed to.
        health_path: the route probed for health (any 2xx is healthy).
        pause_modes: the modes :meth:`pause_call` takes.
        sync_pause_modes: the engine's pause modes (``"abort"``, ``"in_place"``) -> this
            server's.
        lora_answers_json: the LoRA load/unload routes answer JSON (SGLang) rather than
            text (vLLM).

    The ``lora_*`` methods spell LoRA adapter loading (:mod:`engine.backends.remote._lora`);
    a protocol without it keeps the defaults, which refuse.
    """

    generate_path: ClassVar[str] = "/generate"
    health_path: ClassVar[str] = "/health"
    pause_modes: ClassVar[tuple[str, ...]] = ("abort",)
    sync_pause_modes: ClassVar[dict[str, str]] = {"abort": "abort", "in_place": "in_place"}
    lora_answers_json: ClassVar[bool] = True

    @abc.abstractmethod
    def build_payload(self, request: ModelRequest, budget: int, wire_id: str) -> dict[str, Any]:
        """The JSON body of one segment: up to ``budget`` new tokens after
        ``request.input_ids``, sent under the unique id ``wire_id``, logprobs asked for."""

    @abc.abstractmethod
    def parse_generation(self, body: Any) -> ParsedGeneration:
        """Read a 2xx answer.

        Raises:
            RemoteCallError: the answer says the request failed.
            TypeError, ValueError, KeyError, IndexError: an answer of the wrong shape
                (reported as an unexpected answer).
        """

    @abc.abstractmethod
    def abort_call(self, wire_id: str) -> WireCall:
        """The call that aborts the segment sent as ``wire_id``."""

    @abc.abstractmethod
    def pause_call(self, mode: str) -> WireCall:
        """The call that pauses generation (``mode`` one of :attr:`pause_modes`)."""

    @abc.abstractmethod
    def continue_call(self) -> WireCall:
        """The call that resumes generation after :meth:`pause_call`."""

    @abc.abstractmethod
    def weight_update_calls(self, folder: str, version: int) -> list[WireCall]:
        """The calls, in order, that load the checkpoint ``folder`` on one server and set
        its weight version to ``version``."""

    @abc.abstractmethod
    def model_info_call(self) -> tuple[str, str]:
        """``(method, path)`` of the route that names the served model."""

    @abc.abstractmethod
    def parse_model_name(self, answer: Any) -> str | None:
        """The served model's name or path in the answer of :meth:`model_info_call`."""

    # -- LoRA adapters (optional) --------------------------------------------------------------
    def lora_load_call(self, name: str, folder: str) -> tuple[str, str, Any]:
        """``(method, path, body)`` that loads the adapter in ``folder`` as ``name``."""
        raise BackendError(f"{type(self).__name__} cannot load LoRA adapters")

    def lora_unload_call(self, name: str) -> tuple[str, str, Any]:
        """``(method, path, body)`` that unloads the adapter ``name``."""
        raise BackendError(f"{type(self).__name__} cannot unload LoRA adapters")

    def lora_info_call(self) -> tuple[str, str, dict[str, Any] | None]:
        """``(method, path, params)`` of the route that tells the server's LoRA limits."""
        raise BackendError(f"{type(self).__name__} has no LoRA limits")

    def parse_lora_limits(self, answer: Any) -> LoraLimits:
        """The :class:`LoraLimits` in the answer of :meth:`lora_info_call`."""
        return LoraLimits()

    def lora_list_call(self) -> tuple[str, str]:
        """``(method, path)`` of the route that lists the loaded adapters: the OpenAI
        ``GET /v1/models`` of vLLM and SGLang, where each loaded adapter is a model card of
        its own whose ``parent`` is the base model."""
        return "GET", "/v1/models"

    def parse_loaded_adapters(self, answer: Any) -> list[str]:
        """The loaded adapters' names in the answer of :meth:`lora_list_call`."""
        return [str(card["id"]) for card in answer["data"] if card.get("parent")]

    def with_adapter(self, payload: dict[str, Any], name: str) -> dict[str, Any]:
        """``payload`` (of :meth:`build_payload`) sampling the loaded adapter ``name``."""
        raise BackendError(f"{type(self).__name__} cannot sample a LoRA adapter")

    def lora_enable_fix(self, rank: int) -> str:
        """How to restart a server without LoRA for an adapter of ``rank``."""
        return "restart it with LoRA enabled"

    def explain_lora_error(self, message: str, name: str) -> str:
        """A load failure's message, with the fix where the cause is known."""
        return message

    def lora_not_loaded(self, message: str) -> bool:
        """Whether an unload failed because the server does not have the adapter (done)."""
        return False

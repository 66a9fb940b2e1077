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

from ...types import ModelRequest

__all__ = ["ParsedGeneration", "WireCall", "WireProtocol"]

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


class WireProtocol(abc.ABC):
    """One kind of server's HTTP API (see the module docstring).

    Attributes:
        generate_path: the route one segment is POSTed to.
        health_path: the route probed for health (any 2xx is healthy).
        pause_modes: the modes :meth:`pause_call` takes.
        sync_pause_modes: the engine's pause modes (``"abort"``, ``"in_place"``) -> this
            server's.
    """

    generate_path: ClassVar[str] = "/generate"
    health_path: ClassVar[str] = "/health"
    pause_modes: ClassVar[tuple[str, ...]] = ("abort",)
    sync_pause_modes: ClassVar[dict[str, str]] = {"abort": "abort", "in_place": "in_place"}

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

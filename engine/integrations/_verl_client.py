"""The engine as verl's ``LLMServerClient``: what verl's agent loops call to generate.

verl 0.9.1's agent loops (``SingleTurnAgentLoop``, ``ToolAgentLoop``, any ``AgentLoopBase``)
generate through ``self.server_manager.generate(request_id, *, prompt_ids,
sampling_params, image_data=None, video_data=None, audio_data=None,
mm_processor_kwargs=None, **kwargs) -> TokenOutput``
(``verl/workers/rollout/llm_server.py``); the worker hands them its ``llm_client``.
:class:`TrioLLMServerClient` is that client: each call is one engine ``agenerate``, run as
its own task in the engine's trio loop (:class:`engine.aio.AsyncioEngine`: no thread per
call, so episodes in flight are bounded by the engine's admission, not a thread pool), and
cancelled there when verl's task is cancelled or ``generate_timeout_s`` passes.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from verl.utils import normalize_token_ids
from verl.utils.rollout_trace import rollout_trace_op
from verl.workers.rollout.llm_server import LLMServerClient
from verl.workers.rollout.replica import TokenOutput

from ..errors import BackendTimeoutError, InvalidRequestError
from ..types import ModelRequest
from ._verl_sampling import Limits, TrioVerlSettings, to_gconfig, token_output_fields

__all__ = ["TrioLLMServerClient", "as_asyncio_engine"]

logger = logging.getLogger(f"rollout.{__name__}")

#: keyword arguments verl's own loops pass that change nothing for a text model here
#: (``priority``: vLLM scheduling; ``mm_processor_output``: SGLang's video payload)
_IGNORED_KWARGS = frozenset({"priority", "mm_processor_output"})


def as_asyncio_engine(engine: Any) -> Any:
    """An :class:`engine.aio.AsyncioEngine` for ``engine`` (a started
    :class:`engine.RolloutEngineThread`, or already an ``AsyncioEngine``).

    Raises:
        InvalidRequestError: any other object (named, with the fix).
    """
    from engine.aio import AsyncioEngine
    from engine.sync import RolloutEngineThread

    if isinstance(engine, AsyncioEngine):
        return engine
    if isinstance(engine, RolloutEngineThread):
        return AsyncioEngine(engine)
    raise InvalidRequestError(
        f"verl adapter: the engine is a {type(engine).__name__}; give a started engine.RolloutEngineThread "
        "(or an engine.aio.AsyncioEngine over one)")


def limits_of(config: Any) -> Limits:
    """:class:`Limits` from verl's trainer config (``actor_rollout_ref.rollout``)."""
    rollout = config.actor_rollout_ref.rollout
    max_model_len = rollout.get("max_model_len")
    return Limits(prompt_length=int(rollout.prompt_length), response_length=int(rollout.response_length),
                  max_model_len=None if max_model_len is None else int(max_model_len),
                  ignore_eos=bool(rollout.get("ignore_eos", False)))


class TrioLLMServerClient(LLMServerClient):
    """verl's ``LLMServerClient`` over a trio-rollout engine.

    Args:
        config: verl's whole trainer config (a ``DictConfig``; ``actor_rollout_ref.rollout``
            gives the length limits).
        engine: a started :class:`engine.RolloutEngineThread` or an
            :class:`engine.aio.AsyncioEngine`.
        settings: the adapter's settings (``generate_timeout_s``).

    ``generate`` returns verl's ``TokenOutput``: ``token_ids``, ``log_probs`` (the behaviour
    policy's per-token logprobs, "processed" as verl's default ``rollout.logprobs_mode``:
    after temperature / top-k / top-p; only when ``sampling_params["logprobs"]`` is true),
    ``stop_reason`` (``"completed"``), and ``extra_fields`` ``global_steps`` /
    ``min_global_steps`` / ``max_global_steps`` (the policy versions of the tokens: the
    engine's version, i.e. the ``global_steps`` of the last weight update).

    Raises (from ``generate``):
        InvalidRequestError: multimodal input, an unknown keyword or sampling key,
            ``repetition_penalty != 1``, a prompt with no room to generate.
        BackendTimeoutError: ``generate_timeout_s`` passed (the request is cancelled).
        BackendError: the backend failed the request (from the engine, type kept).
    """

    def __init__(self, config: Any, engine: Any, settings: TrioVerlSettings | None = None) -> None:
        super().__init__(config=config, load_balancer_handle=None)
        self._aio = as_asyncio_engine(engine)
        self._limits = limits_of(config)
        self._settings = settings or TrioVerlSettings()
        self.requests = 0

    @property
    def engine(self) -> Any:
        """The :class:`engine.aio.AsyncioEngine` this client generates with."""
        return self._aio

    @rollout_trace_op
    async def generate(self, request_id: Any, *, prompt_ids: list[int], sampling_params: dict[str, Any],
                       image_data: list[Any] | None = None, video_data: list[Any] | None = None,
                       audio_data: list[Any] | None = None, mm_processor_kwargs: dict[str, Any] | None = None,
                       **kwargs: Any) -> TokenOutput:
        if image_data or video_data or audio_data:
            raise InvalidRequestError(
                "verl adapter: multimodal requests (image_data/video_data/audio_data) are not supported yet; "
                "run text agent loops through trio-rollout")
        unknown = sorted(set(kwargs) - _IGNORED_KWARGS)
        if unknown:
            raise InvalidRequestError(f"verl adapter: generate() got unknown keyword(s) {unknown}")
        prompt = [int(t) for t in normalize_token_ids(prompt_ids)]
        gconfig = to_gconfig(sampling_params, len(prompt), self._limits)
        req = ModelRequest(input_ids=prompt, gconfig=gconfig, metadata={"verl_request_id": str(request_id)})
        self.requests += 1
        timeout_s = self._settings.generate_timeout_s
        try:
            resp = await asyncio.wait_for(self._aio.agenerate(req), timeout_s)
        except asyncio.TimeoutError as exc:  # the awaiting task was cancelled: so is the engine's request
            raise BackendTimeoutError(
                f"verl adapter: generate did not finish within generate_timeout_s={timeout_s} s") from exc
        return TokenOutput(**token_output_fields(resp, logprobs=bool(sampling_params.get("logprobs"))))

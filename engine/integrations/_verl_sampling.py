"""verl's request in, verl's answer out: the pure translation of the verl adapter (no verl import).

What verl 0.9.1 sends (``AgentLoopWorker.generate_sequences``,
``verl/experimental/agent_loop/agent_loop.py``) is a plain dict of sampling parameters:
``temperature``, ``top_p``, ``top_k`` (``-1`` = off), ``repetition_penalty`` (always 1.0),
``logprobs`` (bool: ``rollout.calculate_log_probs``); ``ToolAgentLoop`` adds
``stop_token_ids`` (its tool parser's); validation greedy means ``temperature=0``.  There is
no ``max_tokens``: verl's vLLM server (``vLLMHttpServer.generate``,
``verl/workers/rollout/vllm_rollout/vllm_async_server.py``) then takes
``min(response_length, prompt_length + response_length - len(prompt))``, at least 1 and at
most ``max_model_len - len(prompt)``; :func:`to_gconfig` does the same.

What verl reads back (``TokenOutput``, ``verl/workers/rollout/replica.py``): ``token_ids``,
``log_probs`` (only when ``logprobs`` was asked), ``stop_reason`` (``"completed"`` for a stop
or the length limit, ``"aborted"``), and ``extra_fields`` ``global_steps`` /
``min_global_steps`` / ``max_global_steps`` (the policy version: verl's fully-async
staleness logic and the ``min_global_steps`` / ``max_global_steps`` columns read them).
:func:`token_output_fields` maps an engine :class:`~engine.types.ModelResponse` to those.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ..errors import InvalidRequestError
from ..types import GenerationHyperparameters, ModelResponse

__all__ = ["ENGINES", "EngineEntry", "LENGTH_LIMITS", "Limits", "TrioVerlSettings", "to_gconfig", "token_output_fields"]

_NO_TOP_K = 100_000_000  # GenerationHyperparameters' "no top-k"
#: the sampling keys this adapter understands (any other key is an error, not ignored)
_KNOWN = frozenset({"temperature", "top_p", "top_k", "repetition_penalty", "logprobs", "stop_token_ids",
                    "max_tokens", "max_new_tokens", "ignore_eos", "seed", "min_tokens"})
LENGTH_LIMITS = ("prompt_length", "response_length", "max_model_len")


@dataclass(frozen=True)
class EngineEntry:
    """An engine a ``TrioAgentLoopManager`` uses, for the ``TrioCheckpointManager`` of the
    same trainer process: the :class:`engine.aio.AsyncioEngine` and verl's
    ``actor_rollout_ref.model.path`` (the files a weight folder needs besides the weights)."""

    engine: Any
    model_path: str


#: ``trio_rollout.engine_name`` -> the engine of the manager that registered it (this
#: process only; filled by ``TrioAgentLoopManager``, read by ``TrioCheckpointManager``)
ENGINES: dict[str, EngineEntry] = {}


@dataclass(frozen=True, kw_only=True)
class Limits:
    """The length settings of verl's rollout config that bound one generation (tokens).

    Attributes:
        prompt_length: ``rollout.prompt_length``.
        response_length: ``rollout.response_length``.
        max_model_len: ``rollout.max_model_len`` (None: ``prompt_length + response_length``,
            as verl's vLLM server sets it).
        ignore_eos: ``rollout.ignore_eos``.
    """

    prompt_length: int
    response_length: int
    max_model_len: int | None = None
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        for name in LENGTH_LIMITS:
            value = getattr(self, name)
            if value is None and name == "max_model_len":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"rollout.{name} must be an int >= 1, got {value!r}")

    @property
    def context(self) -> int:
        return self.max_model_len if self.max_model_len is not None else self.prompt_length + self.response_length


def to_gconfig(sampling_params: dict[str, Any], prompt_len: int, limits: Limits) -> GenerationHyperparameters:
    """The engine's sampling config for one verl request (see the module docstring).

    Args:
        sampling_params: verl's dict (not modified).
        prompt_len: tokens in the prompt.
        limits: the rollout config's lengths.

    Raises:
        InvalidRequestError: an unknown key, ``repetition_penalty != 1`` (the engine has
            none), a negative temperature, or a prompt that leaves no room to generate
            (verl's vLLM server raises ``ValueError`` there too).
    """
    unknown = sorted(set(sampling_params) - _KNOWN)
    if unknown:
        raise InvalidRequestError(
            f"verl sampling_params: unknown key(s) {unknown}; trio-rollout reads {sorted(_KNOWN)} "
            "(a custom agent loop must not rely on other vLLM/SGLang parameters)")
    rep = sampling_params.get("repetition_penalty", 1.0)
    if rep is not None and float(rep) != 1.0:
        raise InvalidRequestError(
            f"verl sampling_params: repetition_penalty={rep}; trio-rollout samples without one (and verl's "
            "actor recomputes logprobs without it): use 1.0")
    temperature = float(sampling_params.get("temperature", 1.0))
    if math.isnan(temperature) or temperature < 0:
        raise InvalidRequestError(f"verl sampling_params: temperature must be >= 0, got {temperature}")
    top_k = sampling_params.get("top_k", -1)
    top_k = _NO_TOP_K if top_k is None or int(top_k) <= 0 else int(top_k)
    room = limits.context - prompt_len
    if room < 1:
        raise InvalidRequestError(
            f"verl request: the prompt has {prompt_len} tokens and leaves no room to generate within "
            f"max_model_len={limits.context}; raise rollout.max_model_len or shorten the prompt")
    if "max_tokens" in sampling_params:
        budget = int(sampling_params["max_tokens"])
    elif "max_new_tokens" in sampling_params:
        budget = int(sampling_params["max_new_tokens"])
    else:
        budget = min(limits.response_length, limits.prompt_length + limits.response_length - prompt_len)
    budget = max(1, min(budget, room))
    seed = sampling_params.get("seed")
    return GenerationHyperparameters(
        max_new_tokens=budget,
        max_tokens=prompt_len + budget,
        min_new_tokens=int(sampling_params.get("min_tokens", 0) or 0),
        greedy=temperature == 0.0,
        temperature=temperature if temperature > 0 else 1.0,
        top_p=1.0 if sampling_params.get("top_p") is None else float(sampling_params["top_p"]),
        top_k=top_k,
        stop_token_ids=[int(t) for t in sampling_params.get("stop_token_ids") or []],
        ignore_eos=bool(sampling_params.get("ignore_eos", limits.ignore_eos)),
        seed=None if seed is None else int(seed),
    )


def token_output_fields(resp: ModelResponse, *, logprobs: bool) -> dict[str, Any]:
    """``TokenOutput(**fields)`` for an engine response: ``log_probs`` only when verl asked
    (``sampling_params["logprobs"]``), ``stop_reason`` ``"completed"`` (a stop token, a tool
    call or the length limit; the engine resumes its own aborts, so ``"aborted"`` only for a
    leftover abort), and the versions of the response's tokens as ``global_steps`` (the
    newest), ``min_global_steps`` and ``max_global_steps`` (-1 when nothing was generated)."""
    versions = list(resp.output_versions)
    newest = max(versions, default=-1)
    return {
        "token_ids": list(resp.output_tokens),
        "log_probs": [float(x) for x in resp.output_logprobs] if logprobs else None,
        "stop_reason": "aborted" if resp.stop_reason == "abort" else "completed",
        "extra_fields": {"global_steps": newest, "min_global_steps": min(versions, default=-1),
                         "max_global_steps": newest},
    }


@dataclass(frozen=True, kw_only=True)
class TrioVerlSettings:
    """The adapter's own settings: verl's ``actor_rollout_ref.rollout.custom.trio_rollout``
    (``RolloutConfig.custom`` is verl's extension point for custom rollout settings).

    Attributes:
        engine: dotted path of a factory ``fn(config) -> engine`` (``config``: verl's whole
            trainer config; ``engine``: a started :class:`engine.RolloutEngineThread` or an
            :class:`engine.aio.AsyncioEngine`), called once by
            ``TrioAgentLoopManager.create``.  None: the built-in one, the ``hf`` backend on
            ``actor_rollout_ref.model.path`` (``device`` / ``dtype`` below).
        engine_name: the name the manager registers its engine under, for
            ``TrioCheckpointManager`` (weights) in the same process.
        device, dtype: the built-in engine's ``HFBackend(device=, dtype=)``.
        max_attempts: runs of one sample's agent loop (>= 1): a sample whose loop raised
            (a backend request, a tool, a streaming reward) runs again from the start, so
            the batch keeps one row per input row, in order; after the last attempt
            ``generate_sequences`` raises, naming the row.
        generate_timeout_s: bound of one ``generate`` call (seconds, > 0); past it the
            request is cancelled in the engine and the attempt fails.
    """

    engine: str | None = None
    engine_name: str = "default"
    device: str | None = None
    dtype: str = "auto"
    max_attempts: int = 3
    generate_timeout_s: float = 3600.0

    def __post_init__(self) -> None:
        if isinstance(self.max_attempts, bool) or not isinstance(self.max_attempts, int) or self.max_attempts < 1:
            raise ValueError(f"trio_rollout.max_attempts must be an int >= 1, got {self.max_attempts!r}")
        t = self.generate_timeout_s
        if isinstance(t, bool) or not isinstance(t, (int, float)) or math.isnan(t) or t <= 0:
            raise ValueError(f"trio_rollout.generate_timeout_s must be a number of seconds > 0, got {t!r}")
        if not isinstance(self.engine_name, str) or not self.engine_name:
            raise ValueError(f"trio_rollout.engine_name must be a non-empty string, got {self.engine_name!r}")

    @classmethod
    def from_custom(cls, custom: Any) -> TrioVerlSettings:
        """Parse ``RolloutConfig.custom`` (a dict / DictConfig, or None) at key ``trio_rollout``.

        Raises:
            ValueError: an unknown key (named, with the known ones) or a bad value.
        """
        section = (custom or {}).get("trio_rollout") if custom is not None else None
        if section is None:
            return cls()
        values = {str(k): v for k, v in dict(section).items()}
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"actor_rollout_ref.rollout.custom.trio_rollout: unknown key(s) {unknown}; "
                             f"known: {sorted(known)}")
        return cls(**values)

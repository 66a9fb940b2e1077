"""vLLM's request and response shapes, as OpenRLHF's executors use them, over the engine's.

OpenRLHF 0.11.2 (``openrlhf/utils/agent.py``) calls
``await llm_engine.generate(prompt_token_ids, sampling_params, multi_modal_data=None)`` with a
``vllm.SamplingParams`` and reads back a ``vllm.RequestOutput``:
``.outputs[0].token_ids``, ``.text``, ``.finish_reason`` and, when
``sampling_params.logprobs is not None``, ``.logprobs[i][token_id].logprob``.

* :func:`to_gconfig` turns any object with ``vllm.SamplingParams``' attributes (vLLM's own,
  or :class:`SamplingParams` here when vLLM is not installed) into the engine's
  :class:`~engine.types.GenerationHyperparameters`; a setting the engine cannot honour is one
  :class:`~engine.errors.InvalidRequestError` naming it (never silently dropped).
* :func:`request_output` builds the ``RequestOutput`` from a
  :class:`~engine.types.ModelResponse` with vLLM's text rules (vLLM ``StopChecker``): the
  token ids keep the stop token; the text drops the text of a stop/EOS token and cuts before a
  stop string, unless ``include_stop_str_in_output``.
"""

from __future__ import annotations

import math
import uuid
from dataclasses import dataclass, field
from typing import Any

from ..errors import InvalidRequestError

__all__ = ["CompletionOutput", "Logprob", "RequestOutput", "SamplingParams", "request_output", "to_gconfig"]


@dataclass
class SamplingParams:
    """A stand-in for ``vllm.SamplingParams`` (the fields OpenRLHF sets and the ones
    :func:`to_gconfig` checks), with vLLM's defaults.  Mutable and deep-copyable, as
    OpenRLHF's executors need (they assign ``max_tokens`` and ``deepcopy`` it).  Use it to
    drive OpenRLHF's executors where vLLM is not installed; with vLLM installed, pass
    vLLM's own."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None


@dataclass
class Logprob:
    """``vllm.sequence.Logprob``: one token's log-probability (``rank``: None, not computed)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    """``vllm.CompletionOutput``, plus ``token_versions`` (ours: the policy version of each
    token, as :attr:`engine.types.ModelResponse.output_versions`).

    ``finish_reason``: ``"stop"`` or ``"length"``; ``stop_reason``: the stop token id or stop
    string that ended it (None for EOS or length), as vLLM sets it.  ``logprobs``: None unless
    the request asked for them, else one ``{token_id: Logprob}`` per token (the sampled token
    only: ``logprobs`` must be 0 or 1)."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str
    stop_reason: int | str | None = None
    token_versions: list[int] = field(default_factory=list)

    def finished(self) -> bool:
        return True


@dataclass
class RequestOutput:
    """``vllm.RequestOutput`` of a finished request (one completion)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: None
    outputs: list[CompletionOutput]
    finished: bool = True


#: vLLM settings the engine does not implement: (attribute, its neutral value)
_UNSUPPORTED = (("presence_penalty", 0.0), ("repetition_penalty", 1.0), ("min_p", 0.0), ("logit_bias", None),
                ("allowed_token_ids", None), ("bad_words", None), ("prompt_logprobs", None), ("best_of", None),
                ("guided_decoding", None), ("structured_outputs", None), ("logits_processors", None))


def _number(params: Any, name: str, default: float) -> float:
    value = getattr(params, name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        raise InvalidRequestError(f"sampling_params.{name}: expected a number, got {value!r}")
    return float(value)


def _stops(params: Any) -> list[str] | None:
    stop = getattr(params, "stop", None)
    if stop is None or stop == []:
        return None
    return [stop] if isinstance(stop, str) else [str(s) for s in stop]


def to_gconfig(params: Any, *, prompt_len: int, max_model_len: int) -> Any:
    """The engine's sampling config for one vLLM-style request of ``prompt_len`` tokens.

    ``max_tokens=None`` means what it means to vLLM: up to ``max_model_len`` tokens in all.
    ``temperature == 0`` is greedy; ``top_k`` of 0 or -1 is off (vLLM's two spellings).

    Raises:
        InvalidRequestError: ``n != 1`` (OpenRLHF calls ``execute`` once per sample), ``logprobs``
            above 1 (only the sampled token's is known), or a setting in ``_UNSUPPORTED`` away
            from its neutral value; the message names the field.
    """
    from ..types import GenerationHyperparameters

    n = getattr(params, "n", 1)
    if n not in (1, None):
        raise InvalidRequestError(f"sampling_params.n must be 1 (OpenRLHF runs one execute per sample), got {n!r}")
    for name, neutral in _UNSUPPORTED:
        value = getattr(params, name, neutral)
        if value is None or value == neutral or (isinstance(value, (list, dict, tuple)) and not value):
            continue
        raise InvalidRequestError(f"sampling_params.{name}={value!r} is not supported by the trio-rollout "
                                  f"engine; leave it at {neutral!r}")
    logprobs = getattr(params, "logprobs", None)
    if logprobs is not None and (isinstance(logprobs, bool) or not isinstance(logprobs, int) or not 0 <= logprobs <= 1):
        raise InvalidRequestError(f"sampling_params.logprobs must be None, 0 or 1 (the engine returns the sampled "
                                  f"token's log-probability only), got {logprobs!r}")
    temperature = _number(params, "temperature", 1.0)
    top_k = int(_number(params, "top_k", 0))
    max_tokens = getattr(params, "max_tokens", None)
    budget = max_model_len - prompt_len if max_tokens is None else int(max_tokens)
    stop_ids = [int(t) for t in (getattr(params, "stop_token_ids", None) or [])]
    seed = getattr(params, "seed", None)
    return GenerationHyperparameters(
        max_new_tokens=budget, min_new_tokens=int(_number(params, "min_tokens", 0)), max_tokens=max_model_len,
        greedy=temperature == 0.0, temperature=temperature if temperature > 0 else 1.0,
        top_p=_number(params, "top_p", 1.0), top_k=top_k if top_k > 0 else GenerationHyperparameters.top_k,
        stop_token_ids=stop_ids, ignore_eos=bool(getattr(params, "ignore_eos", False)),
        skip_special_tokens=bool(getattr(params, "skip_special_tokens", True)), stop=_stops(params),
        frequency_penalty=_number(params, "frequency_penalty", 0.0), seed=None if seed is None else int(seed))


def request_output(resp: Any, params: Any, tokenizer: Any, *, eos_token_ids: frozenset[int],
                   request_id: str | None = None) -> RequestOutput:
    """``resp`` (a :class:`~engine.types.ModelResponse`) as vLLM's ``RequestOutput``.

    ``text`` follows vLLM: decoded with ``params.skip_special_tokens``; when the last token
    is a stop token (``stop_token_ids``) or an EOS token (``eos_token_ids``, unless
    ``ignore_eos``) its text is left out, and the text is cut before the first stop string;
    ``include_stop_str_in_output`` keeps both.  ``token_ids`` always hold every token.
    """
    tokens = [int(t) for t in resp.output_tokens]
    include = bool(getattr(params, "include_stop_str_in_output", False))
    skip = bool(getattr(params, "skip_special_tokens", True))
    stop_ids = {int(t) for t in (getattr(params, "stop_token_ids", None) or [])}
    if not getattr(params, "ignore_eos", False):
        stop_ids_or_eos = stop_ids | set(eos_token_ids)
    else:
        stop_ids_or_eos = stop_ids
    stop_reason: int | str | None = None
    text_tokens = tokens
    if resp.stop_reason == "stop" and tokens and tokens[-1] in stop_ids_or_eos:
        if tokens[-1] in stop_ids:
            stop_reason = tokens[-1]
        if not include:
            text_tokens = tokens[:-1]
    text = tokenizer.decode(text_tokens, skip_special_tokens=skip)
    if resp.stop_reason == "stop" and stop_reason is None:
        found = [(text.find(s), s) for s in (_stops(params) or []) if s and s in text]
        if found:
            at, s = min(found)
            stop_reason = s
            text = text[:at + len(s)] if include else text[:at]
    logprobs = None
    if getattr(params, "logprobs", None) is not None:
        logprobs = [{t: Logprob(float(lp), rank=None)} for t, lp in zip(tokens, resp.output_logprobs)]
    completion = CompletionOutput(
        index=0, text=text, token_ids=tokens, cumulative_logprob=float(sum(resp.output_logprobs)) if logprobs else None,
        logprobs=logprobs, finish_reason="length" if resp.stop_reason == "length" else "stop", stop_reason=stop_reason,
        token_versions=[int(v) for v in resp.output_versions])
    return RequestOutput(request_id=request_id or uuid.uuid4().hex, prompt=None,
                         prompt_token_ids=[int(t) for t in resp.input_tokens], prompt_logprobs=None,
                         outputs=[completion])

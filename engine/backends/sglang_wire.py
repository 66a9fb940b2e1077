"""SGLang's native ``/generate`` wire format, both directions, in one module.

The ``sglang`` client (:mod:`engine.backends.remote`) writes requests and reads answers with
it; ``rollout serve`` (:mod:`engine.serve`) reads requests and writes answers with it, so the
two sides cannot drift apart (``tests/unit/test_sglang_wire.py`` round-trips them).  Wire facts:
``SERVERS_AND_MODELS.md`` §1.  Pure: no I/O, no HTTP client, no trio.

Request (one prompt, non-streaming)::

    {"input_ids": [...], "rid": "<rid>@<seq>", "return_logprob": true, "stream": false,
     "image_data": [base64, ...] (if any), "priority": int (if the request has one),
     "lora_path": a loaded LoRA adapter's name (if any; the client's ``SGLangWire.with_adapter``),
     "sampling_params": {"max_new_tokens": budget, "temperature": 0 if greedy else t,
                         "top_p", "top_k": -1 when disabled, "min_new_tokens",
                         "stop_token_ids", "stop" (if any), "ignore_eos",
                         "skip_special_tokens", "frequency_penalty",
                         "sampling_seed" (if gconfig.seed is set)}}

Answer::

    {"text", "output_ids": [...], "meta_info": {"id", "finish_reason": {"type": "stop"|"length"|
     "abort", ...}, "prompt_tokens", "completion_tokens", "cached_tokens", "weight_version",
     "e2e_latency", "output_token_logprobs": [[logprob, token_id, text-or-null], ...]}}

* client side: :func:`sampling_params` (also the vLLM client's mapping, under vLLM's names),
  :func:`generate_payload`, :func:`parse_generate_answer`;
* server side: :func:`parse_generate_request` (what ``rollout serve`` accepts),
  :func:`finish_abort` / :func:`finish_length` / :func:`finish_stop`, :func:`generate_answer`.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from ..errors import InvalidRequestError
from ..types import GenerationHyperparameters, ModelRequest, valid_lora_name

__all__ = [
    "AnswerRejected",
    "GenerateAnswer",
    "GenerateCall",
    "NO_TOP_K",
    "WireError",
    "finish_abort",
    "finish_length",
    "finish_stop",
    "generate_answer",
    "generate_payload",
    "parse_generate_answer",
    "parse_generate_request",
    "sampling_params",
    "sampling_top_k",
]

#: ``GenerationHyperparameters.top_k`` at or above this means "no top-k filter" (``-1`` on the wire).
NO_TOP_K = 100_000_000

#: ``finish_reason.type`` -> the engine's stop reason
_FINISH = {"stop": "stop", "length": "length", "abort": "abort"}

#: ``sampling_params`` keys a server reading this format knows
SAMPLING_KEYS = frozenset({
    "max_new_tokens", "temperature", "top_p", "top_k", "min_p", "min_new_tokens", "stop", "stop_token_ids",
    "ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim", "frequency_penalty",
    "presence_penalty", "repetition_penalty", "n", "sampling_seed", "stream_interval",
})
#: accepted only at their neutral value
NEUTRAL_SAMPLING = {"min_p": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0, "n": 1}
#: accepted with any value and ignored (routing and logging hints)
IGNORED_KEYS = frozenset({"model", "log_metrics", "no_logs", "background", "priority", "routing_key", "extra_key",
                          "data_parallel_rank", "routed_dp_rank", "bootstrap_host", "bootstrap_port",
                          "bootstrap_room"})
#: the ``GenerateReqInput`` fields read; others are accepted only at a falsy value
GENERATE_KEYS = frozenset({
    "input_ids", "text", "sampling_params", "rid", "return_logprob", "stream", "logprob_start_len",
    "top_logprobs_num", "return_text_in_logprobs", "image_data", "lora_path",
})


class WireError(ValueError):
    """A request body this server cannot serve (the server answers HTTP 400 with the message)."""


class AnswerRejected(Exception):
    """An answer that is well-formed but says the request failed, or contradicts itself.

    Attributes:
        server_fault: whether it counts against the server's health (``False``: the server
            rejected *this request*, e.g. ``finish_reason.status_code`` 400).
    """

    def __init__(self, message: str, *, server_fault: bool = True) -> None:
        super().__init__(message)
        self.server_fault = server_fault


# -- client side: request ----------------------------------------------------------------


def sampling_top_k(top_k: int) -> int:
    """``GenerationHyperparameters.top_k`` on the wire: ``-1`` when disabled."""
    return -1 if top_k >= NO_TOP_K else int(top_k)


def sampling_params(g: GenerationHyperparameters, budget: int) -> dict[str, Any]:
    """``sampling_params`` of one segment of at most ``budget`` new tokens.

    Greedy is ``temperature 0, top_p 1, top_k -1``; ``min_new_tokens`` is capped at the
    budget; ``stop`` and ``sampling_seed`` only when set.  The vLLM client sends the same
    values under vLLM's names (``max_tokens``, ``min_tokens``, ``seed``).
    """
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
    return params


def generate_payload(request: ModelRequest, budget: int, rid: str, *, low_priority_values_first: bool = False
                     ) -> dict[str, Any]:
    """The ``/generate`` body of one segment of ``request`` sent under the wire id ``rid``
    (logprobs asked for, no streaming).

    A non-zero ``request.priority`` (vLLM's sense: lower is served first) is sent as
    ``priority`` in SGLang's sense: SGLang's scheduler (``--enable-priority-scheduling``)
    serves *higher* values first unless the server runs with
    ``--schedule-low-priority-values-first`` (then say ``low_priority_values_first``), so
    the value is negated by default.  ``0`` is never sent: a server started with
    ``--abort-on-priority-when-disabled`` aborts any request that carries one."""
    payload: dict[str, Any] = {
        "input_ids": list(request.input_ids),
        "sampling_params": sampling_params(request.gconfig, budget),
        "rid": rid,
        "return_logprob": True,
        "stream": False,
    }
    if request.image_data:
        payload["image_data"] = list(request.image_data)
    if request.priority:
        payload["priority"] = int(request.priority) if low_priority_values_first else -int(request.priority)
    return payload


# -- client side: answer -----------------------------------------------------------------


@dataclass
class GenerateAnswer:
    """What :func:`parse_generate_answer` reads from one answer.

    Attributes:
        tokens: output token ids.
        logprobs: one per token (NaN where the server sent ``null``).
        stop_reason: ``"stop"``, ``"length"`` or ``"abort"``.
        weight_version: ``meta_info.weight_version`` as a string, or ``None``.
    """

    tokens: list[int]
    logprobs: list[float]
    stop_reason: str
    weight_version: str | None = None


def parse_generate_answer(body: Any) -> GenerateAnswer:
    """Read a 2xx ``/generate`` answer (or a batch answer of one).

    Raises:
        AnswerRejected: ``finish_reason`` ``abort`` with a 4xx ``status_code`` (the server
            rejected the request: not its fault), or ``output_ids`` that disagree with the
            ids in ``meta_info.output_token_logprobs`` (a count mismatch is left to the
            engine's evidence check).
        ValueError, KeyError, TypeError, IndexError: an answer of the wrong shape.
    """
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
            raise AnswerRejected(f"server rejected the request (HTTP {code}): {finish.get('message')}",
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
            raise AnswerRejected("output_ids disagree with the token ids in meta_info.output_token_logprobs")
        tokens = output_ids  # count mismatch: the engine's evidence check reports it
    version = meta.get("weight_version")
    return GenerateAnswer(tokens, logprobs, _FINISH[kind], None if version is None else str(version))


# -- server side: request ----------------------------------------------------------------


class GenerateCall(NamedTuple):
    """A ``/generate`` body read by :func:`parse_generate_request`."""

    request: ModelRequest
    budget: int  #: new tokens to generate, clamped to the context (may be 0)
    return_logprob: bool


def parse_generate_request(body: Any, *, vocab_size: int, context_length: int,
                           tokenize: Callable[[str], Sequence[int]]) -> GenerateCall:
    """Read a ``/generate`` body the way ``rollout serve`` serves it: one prompt
    (``input_ids``, or ``text`` run through ``tokenize``), no streaming, no top logprobs;
    other ``GenerateReqInput`` fields only at a falsy value (an sglang-router re-sends them
    all at their defaults), routing hints ignored; ``lora_path`` (a loaded adapter's name)
    becomes ``ModelRequest.lora_name``.  The budget is ``max_new_tokens``
    (default 128; ``null``: the rest of the context) clamped to ``context_length`` less
    the prompt.  No ``rid``: a fresh one.

    Raises:
        WireError: naming the field that cannot be served.
    """
    if not isinstance(body, dict):
        raise WireError("the body must be a JSON object")
    unknown = sorted(k for k in set(body) - GENERATE_KEYS if k not in IGNORED_KEYS and body[k])
    if unknown:  # a feature we do not have (an sglang-router re-sends every field at its default)
        raise WireError(f"unsupported field(s) {unknown}")
    if body.get("stream"):
        raise WireError("rollout serve does not stream; send stream: false")
    if body.get("top_logprobs_num"):
        raise WireError("rollout serve does not return top logprobs (top_logprobs_num)")
    ids = body.get("input_ids")
    if ids is None:
        text = body.get("text")
        if not isinstance(text, str):
            raise WireError("give one prompt as input_ids (list of ints) or text (a string)")
        ids = list(tokenize(text))
    if not isinstance(ids, list) or not ids or any(isinstance(t, list) for t in ids):
        raise WireError("input_ids must be one non-empty list of token ids (no batches)")
    if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab_size for t in ids):
        raise WireError(f"input_ids must be ints in [0, {vocab_size})")
    sp = body.get("sampling_params") or {}
    if not isinstance(sp, dict):
        raise WireError("sampling_params must be an object")
    unknown = sorted(k for k in set(sp) - SAMPLING_KEYS if sp[k] not in (None, False, [], {}, ""))
    if unknown:
        raise WireError(f"unsupported sampling_params {unknown}")
    for key, neutral in NEUTRAL_SAMPLING.items():
        if sp.get(key, neutral) not in (neutral, None):
            raise WireError(f"sampling_params.{key}={sp[key]!r} is not supported by rollout serve")
    room = context_length - len(ids)
    if room <= 0:
        raise WireError(f"the prompt has {len(ids)} tokens; the context is {context_length}")
    max_new = sp.get("max_new_tokens", 128)
    max_new = room if max_new is None else max_new
    if isinstance(max_new, bool) or not isinstance(max_new, int) or max_new < 0:
        raise WireError(f"sampling_params.max_new_tokens must be an int >= 0, got {max_new!r}")
    budget = min(max_new, room)
    try:
        gconfig = _gconfig(sp, budget, len(ids))
    except (InvalidRequestError, TypeError, ValueError) as exc:
        raise WireError(f"bad sampling_params: {exc}") from None
    rid = body.get("rid") or uuid.uuid4().hex
    if not isinstance(rid, str):
        raise WireError("rid must be a string (batches are not supported)")
    images = body.get("image_data") or None  # base64 image files; the model reads them (or refuses)
    if isinstance(images, str):
        images = [images]
    if images is not None and (not isinstance(images, list) or not all(isinstance(x, str) for x in images)):
        raise WireError("image_data must be a base64 string or a list of them (no batches)")
    lora = body.get("lora_path") or None  # SGLang's field: the name of a loaded adapter
    if lora is not None and not valid_lora_name(lora):
        raise WireError("lora_path must be the name of a loaded LoRA adapter (one string, no batches)")
    request = ModelRequest(rid=rid, input_ids=ids, gconfig=gconfig, image_data=images, lora_name=lora)
    return GenerateCall(request, budget, bool(body.get("return_logprob", False)))


def _gconfig(sp: dict[str, Any], budget: int, prompt_len: int) -> GenerationHyperparameters:
    """``sampling_params`` -> :class:`GenerationHyperparameters` (the inverse of
    :func:`sampling_params`: temperature below 1e-6 is greedy, top_k ``-1`` is none)."""
    temperature = float(sp.get("temperature", 1.0))
    top_k = sp.get("top_k", -1)
    top_k = NO_TOP_K if top_k in (None, -1) else top_k
    stop = sp.get("stop")
    stop = [stop] if isinstance(stop, str) else stop
    gconfig = GenerationHyperparameters(
        max_new_tokens=max(budget, 1), max_tokens=prompt_len + max(budget, 1),
        min_new_tokens=int(sp.get("min_new_tokens", 0) or 0), greedy=temperature < 1e-6,
        temperature=temperature if temperature >= 1e-6 else 1.0, top_p=float(sp.get("top_p", 1.0)),
        top_k=int(top_k), stop_token_ids=[int(t) for t in sp.get("stop_token_ids") or []],
        ignore_eos=bool(sp.get("ignore_eos", False)), skip_special_tokens=bool(sp.get("skip_special_tokens", True)),
        stop=list(stop) if stop else None, frequency_penalty=float(sp.get("frequency_penalty", 0.0)),
        seed=sp.get("sampling_seed"),
    )
    gconfig.validate()
    return gconfig


# -- server side: answer -----------------------------------------------------------------


def finish_abort(message: str) -> dict[str, Any]:
    """``finish_reason`` of a request aborted (pause, abort call, weight update)."""
    return {"type": "abort", "message": message, "status_code": None, "err_type": None}


def finish_length(n_tokens: int) -> dict[str, Any]:
    """``finish_reason`` of a request that used its whole budget."""
    return {"type": "length", "length": n_tokens}


def finish_stop(matched: int | str | None) -> dict[str, Any]:
    """``finish_reason`` of a request that stopped on ``matched`` (a stop token id, a stop
    string, or ``None`` when unknown)."""
    return {"type": "stop", "matched": matched}


def generate_answer(*, rid: str, prompt_len: int, tokens: Sequence[int], logprobs: Sequence[float],
                    finish: dict[str, Any], weight_version: str, text: str, return_logprob: bool,
                    latency_s: float) -> dict[str, Any]:
    """The body answering one ``/generate`` request (``output_token_logprobs`` only with
    ``return_logprob``; no input logprobs)."""
    meta: dict[str, Any] = {
        "id": rid,
        "finish_reason": finish,
        "prompt_tokens": prompt_len,
        "completion_tokens": len(tokens),
        "cached_tokens": 0,
        "weight_version": weight_version,
        "e2e_latency": latency_s,
    }
    if return_logprob:
        meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(logprobs, tokens)]
        meta["input_token_logprobs"] = []
    return {"text": text, "output_ids": list(tokens), "meta_info": meta}

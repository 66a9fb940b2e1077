"""Request/response contracts between workflows and inference backends.

Names, fields and defaults follow AReaL (``areal/api/cli_args.py`` for
:class:`GenerationHyperparameters`, ``areal/api/io_struct.py`` for
:class:`ModelRequest` / :class:`ModelResponse`) so that AReaL workflows port by
changing imports.  Where we differ it is written down ("ours").

This module imports nothing heavy (no torch, no transformers).
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import os
from dataclasses import dataclass, field
from typing import Any, Literal

from .errors import InvalidRequestError

__all__ = [
    "GenerationHyperparameters",
    "ModelRequest",
    "ModelResponse",
    "StopReason",
    "derive_seed",
    "versioned_lora_name",
]

StopReason = Literal["stop", "length", "tool_calls", "abort"]
STOP_REASONS: frozenset[str] = frozenset({"stop", "length", "tool_calls", "abort"})


def versioned_lora_name(lora_name: str, version: int) -> str:
    """The name a LoRA adapter's ``version`` is served under: ``f"{lora_name}-v{version}"``
    (AReaL 1.0.4 ``areal/api/io_struct.py`` ``get_versioned_lora_name``), e.g. ``lora-v3``."""
    return f"{lora_name}-v{version}"


def derive_seed(seed: int, *parts: int | str | None) -> int:
    """A per-request sampling seed derived from a run ``seed`` and the request's
    identity, e.g. ``derive_seed(run_seed, task_id, group_sample, sample)`` (ours).

    Stable across processes and runs (BLAKE2b of the values, not the salted
    ``hash()``), distinct for distinct inputs; in ``[0, 2**63)``.
    """
    digest = hashlib.blake2b(repr((int(seed), *parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1


def valid_lora_name(name: object) -> bool:
    """Whether ``name`` can name a LoRA adapter: a non-empty ``str`` without whitespace,
    ``/`` or ``\\`` (it becomes a server-side model name and part of a folder name)."""
    return (isinstance(name, str) and bool(name) and not any(c.isspace() for c in name)
            and "/" not in name and "\\" not in name)


@dataclass
class GenerationHyperparameters:
    """Sampling parameters of one generation request (AReaL ``cli_args.py``).

    Attributes:
        n_samples: samples per prompt.  :meth:`engine.RolloutEngine.agenerate`
            accepts only ``1``: grouping is the workflow's or executor's job.
        max_new_tokens: cap on generated tokens.
        min_new_tokens: EOS/stop tokens are suppressed until this many tokens exist.
        max_tokens: cap on prompt + generated tokens.  The effective budget of a
            request is ``min(max_tokens - prompt_len, max_new_tokens)``
            (see :meth:`token_budget`).
        greedy: argmax decoding (temperature is ignored).
        top_p, top_k, temperature: the usual sampling filters; ``top_k`` at its
            default (1e8) means "no top-k filter".
        stop_token_ids: generation stops after emitting any of these ids (the
            stop token is kept in the output, as SGLang and vLLM do).
        ignore_eos: do not stop on the tokenizer's EOS.
        skip_special_tokens: decode option for completion text.
        stop: stop strings (checked on decoded text).
        frequency_penalty: OpenAI-style frequency penalty.
        seed: per-request sampling seed; ``None`` = nondeterministic.  On a
            workflow's gconfig it is the *run* seed: :class:`workflows.rlvr.RLVRWorkflow`
            derives each request's own seed from it (:func:`derive_seed`).
    """

    n_samples: int = 1
    max_new_tokens: int = 16384
    min_new_tokens: int = 0
    max_tokens: int = 32768
    greedy: bool = False
    top_p: float = 1.0
    top_k: int = 100_000_000
    temperature: float = 1.0
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    stop: list[str] | None = None
    frequency_penalty: float = 0.0
    seed: int | None = None

    def new(self, **overrides: Any) -> GenerationHyperparameters:
        """Return a fresh copy with ``overrides`` applied (lists are copied).

        Raises:
            TypeError: an override names a field that does not exist.
        """
        names = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(overrides) - names)
        if unknown:
            raise TypeError(f"GenerationHyperparameters has no field(s) {unknown}")
        copied = dataclasses.replace(
            self,
            stop_token_ids=list(self.stop_token_ids),
            stop=None if self.stop is None else list(self.stop),
        )
        return dataclasses.replace(copied, **overrides)

    def new_with_stop_and_pad_token_ids(self, tokenizer: Any) -> GenerationHyperparameters:
        """Return a copy whose ``stop_token_ids`` also hold the tokenizer's pad
        id, then its eos id, each appended only if present and missing (AReaL)."""
        stop = list(self.stop_token_ids)
        for tid in (getattr(tokenizer, "pad_token_id", None), getattr(tokenizer, "eos_token_id", None)):
            if tid is not None and tid not in stop:
                stop.append(int(tid))
        return self.new(stop_token_ids=stop)

    def token_budget(self, prompt_len: int) -> int:
        """New-token budget for a prompt of ``prompt_len`` tokens:
        ``min(max_tokens - prompt_len, max_new_tokens)`` (AReaL ``remote_inf_engine.py``).

        Raises:
            InvalidRequestError: the budget is <= 0 (prompt too long), so nothing
                may be sent.
        """
        budget = min(self.max_tokens - prompt_len, self.max_new_tokens)
        if budget <= 0:
            raise InvalidRequestError(
                f"token budget is {budget}: prompt_len={prompt_len}, "
                f"max_tokens={self.max_tokens}, max_new_tokens={self.max_new_tokens}"
            )
        return budget

    def validate(self) -> None:
        """Check ranges; raise :class:`InvalidRequestError` naming the field."""
        if self.n_samples < 1:
            raise InvalidRequestError(f"n_samples must be >= 1, got {self.n_samples}")
        if self.max_new_tokens < 1:
            raise InvalidRequestError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.min_new_tokens < 0:
            raise InvalidRequestError(f"min_new_tokens must be >= 0, got {self.min_new_tokens}")
        if not (isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature)) or self.temperature < 0:
            raise InvalidRequestError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not (0.0 < self.top_p <= 1.0):
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 1:
            raise InvalidRequestError(f"top_k must be >= 1, got {self.top_k}")


@dataclass
class ModelRequest:
    """One generation request (AReaL ``io_struct.py``).

    Attributes:
        rid: request id, unique per request; default 32 random hex digits (the
            shape of ``uuid4().hex``, without ``uuid.UUID``'s per-call overhead).
        input_ids: prompt token ids (``list[int]``, length = prompt_len).
        gconfig: sampling parameters; ``gconfig.n_samples`` must be 1.
        metadata: free-form, passed through to the backend.
        tokenizer: optional, used by backends that check stop strings.
        image_data: base64-encoded image files for vision models (``list[str]``, one
            per image placeholder of the prompt, in order), or ``None``.
        processor: optional multimodal processor (the ``hf`` backend reads
            ``image_data`` with its ``image_processor``).
        priority: the server-side scheduling priority (ours; vLLM's semantics: a
            *lower* value is served first, ``0`` = none).  Sent as ``priority`` by the
            ``vllm`` backend (the server needs ``--scheduling-policy priority``) and,
            negated to SGLang's default sense, by the ``sglang`` backend (the server needs
            ``--enable-priority-scheduling``); never sent while ``0``.  The ``hf`` backend
            ignores it; the sim honours it with ``SimConfig(scheduling_policy="priority")``.
            The engine's scheduling policies set it per segment
            (:mod:`engine._scheduling`); with ``EngineConfig(scheduling="fcfs")`` a request
            keeps its own.
        lora_name: the LoRA adapter to sample with, by its base name (``"lora"``, not a
            versioned ``"lora-v3"``: the backend serves the adapter's latest version, and
            the tokens carry that version); ``None``: the backend's default adapter when
            it serves one, else the base model.  AReaL's field name (its
            ``WeightUpdateMeta.lora_name``); :mod:`engine.backends.lora` has the story.
    """

    rid: str = field(default_factory=lambda: os.urandom(16).hex())
    input_ids: list[int] = field(default_factory=list)
    gconfig: GenerationHyperparameters = field(default_factory=GenerationHyperparameters)
    metadata: dict[str, Any] = field(default_factory=dict)
    tokenizer: Any = None
    image_data: list[str] | None = None
    processor: Any = None
    priority: int = 0
    lora_name: str | None = None

    def validate(self) -> int:
        """Check the request and return its new-token budget.

        Raises:
            InvalidRequestError: empty or non-int ``input_ids``, ``n_samples != 1``,
                ``image_data`` that is not a list of strings, a ``priority`` that is not
                an int, a ``lora_name`` that is not a non-empty string without spaces or
                slashes, an out-of-range sampling parameter, or a budget <= 0.
        """
        if not self.input_ids:
            raise InvalidRequestError(f"request {self.rid}: input_ids is empty")
        ids = self.input_ids
        plain = type(ids) is list and list(map(type, ids)).count(int) == len(ids) and min(ids) >= 0  # C-level
        if not plain and not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
            raise InvalidRequestError(f"request {self.rid}: input_ids must be non-negative ints")
        if self.image_data is not None and (
                type(self.image_data) is not list or not all(isinstance(x, str) for x in self.image_data)):
            raise InvalidRequestError(f"request {self.rid}: image_data must be a list of base64 strings, "
                                      f"got {type(self.image_data).__name__}")
        if isinstance(self.priority, bool) or not isinstance(self.priority, int):
            raise InvalidRequestError(f"request {self.rid}: priority must be an int (lower is served first), "
                                      f"got {self.priority!r}")
        if self.lora_name is not None and not valid_lora_name(self.lora_name):
            raise InvalidRequestError(f"request {self.rid}: lora_name must be a non-empty string without spaces "
                                      f"or slashes (an adapter's name, e.g. 'lora'), got {self.lora_name!r}")
        self.gconfig.validate()
        if self.gconfig.n_samples != 1:
            raise InvalidRequestError(
                f"request {self.rid}: agenerate accepts only gconfig.n_samples == 1, got "
                f"{self.gconfig.n_samples} (submit with group_size=n to sample a prompt n times)"
            )
        return self.gconfig.token_budget(len(self.input_ids))


@dataclass
class ModelResponse:
    """The result of one request (AReaL ``io_struct.py``).

    Attributes:
        input_tokens: prompt token ids.
        output_tokens: generated token ids (a stop/EOS token, if hit, is included).
        output_logprobs: one float per output token: log-probability of the
            sampled token under the backend's sampling distribution (the ``hf``
            backend: after temperature/top-k/top-p, i.e. the distribution that was
            sampled; see the backend's ``logprob_semantics``).
        output_versions: one int per output token: the policy version whose
            weights produced it.
        stop_reason: ``"stop"`` (EOS/stop token/stop string), ``"length"`` (budget
            reached), ``"tool_calls"``, or ``"abort"`` (never seen by workflows).
        latency: seconds from dispatch to the last token.
        ttft: seconds from dispatch to the first token.
    """

    input_tokens: list[int] = field(default_factory=list)
    output_tokens: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    output_versions: list[int] = field(default_factory=list)
    stop_reason: StopReason = "stop"
    latency: float = float("inf")
    ttft: float = float("inf")
    tokenizer: Any = None
    processor: Any = None

    @property
    def input_len(self) -> int:
        return len(self.input_tokens)

    @property
    def output_len(self) -> int:
        return len(self.output_tokens)

"""``EngineWrapper``: torchrl's ``TransformersWrapper`` whose generation step is the engine's.

Imports torchrl (0.14.1); reached through :mod:`engine.integrations.torchrl`.

The seam (torchrl 0.14.1, ``torchrl/modules/llm/policies/transformers_wrapper.py``):
``TransformersWrapper.forward`` turns the input (a ``ChatHistory``, text or tokens) into
left-padded prompt tokens, then calls ``_generate_from_tokens`` (history and tokens modes)
or ``_generate_from_text`` (text mode), which call ``model.generate`` and build the
``Text`` / ``Tokens`` / ``Masks`` / ``LogProbs`` outputs; back in ``forward``, history mode
decodes the full text and parses it into the response ``History`` with the chat template.
Only those two generation methods are replaced here: one engine call per row, all rows of
the batch at once, and the outputs built field by field as torchrl builds them.  Everything
else (chat templates, ``ChatHistory`` bookkeeping, ``inplace``, ``get_dist``) is torchrl's.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch
from tensordict import MetaData, TensorDict
from torch.nn.utils.rnn import pad_sequence
from torchrl.modules.llm.policies.common import LogProbs, Masks, Text, Tokens
from torchrl.modules.llm.policies.transformers_wrapper import TransformersWrapper
from torchrl.modules.utils.utils import _unpad_tensors

from ..errors import InvalidRequestError
from ..types import GenerationHyperparameters, ModelResponse
from ._torchrl_bridge import Bridge, CallCounters, TorchRLConfig, gconfig_from_generate_kwargs, generate_rows
from ._torchrl_weights import install_weight_updater

__all__ = ["EngineWrapper", "EngineWrapperStatistics"]

#: constructor arguments that carry over in :meth:`EngineWrapper.get_new_version`
_CARRIED = ("input_mode", "input_key", "attention_mask_key", "tokenizer_kwargs", "pad_output", "inplace", "device",
            "layout", "chat_template_name", "chat_template", "return_log_probs", "history_key", "text_key",
            "tokens_key", "masks_key", "log_probs_key", "prefer_tokens")


@dataclass(frozen=True)
class EngineWrapperStatistics:
    """A snapshot of an :class:`EngineWrapper`.

    Attributes:
        calls: policy calls (each one env step of the whole env batch).
        rows: completions returned; ``rows_retried``: rows sent again after a backend failure.
        generated_tokens: tokens the engine generated for them.
        wait_s: seconds the caller spent inside the policy calls.
        last_versions: the distinct token versions of the last call, ascending.
    """

    calls: int
    rows: int
    rows_retried: int
    generated_tokens: int
    wait_s: float
    last_versions: tuple[int, ...]


class EngineWrapper(TransformersWrapper):
    """A torchrl LLM policy (``LLMWrapperBase``) that generates with a trio-rollout engine.

    Use it wherever torchrl takes its ``TransformersWrapper`` / ``vLLMWrapper`` with
    ``generate=True``: ``LLMCollector(env, policy=EngineWrapper(engine, tokenizer=tok))``
    over a ``ChatEnv``.  The output is torchrl's (``input_mode`` ``"history"``, ``"text"`` or
    ``"tokens"``; ``pad_output`` True or False), built as ``TransformersWrapper`` builds it:
    ``history.{prompt,response,full}``, ``text.*``, ``tokens.{prompt,response,full}``
    (int64), ``masks.all_attention_mask`` (bool), ``log_probs.response`` (float32, one per
    response token: the behaviour policy's, as the engine sampled them), plus, under
    ``engine_key`` (default ``"engine"``), ``versions`` (int64, one per response token: the
    policy version whose weights produced it; -1 on padding) and ``stop_reason`` (str).

    Differences from ``TransformersWrapper``, on purpose: the first response log-prob is the
    real one (torchrl's sets it to 0); sampling follows the engine's
    :class:`~engine.GenerationHyperparameters` (stops at the tokenizer's pad and eos ids, as
    AReaL's ``new_with_stop_and_pad_token_ids``).  As in torchrl, pad-id tokens are left out
    of ``tokens.response`` (and of its log-probs and versions).

    Args:
        engine: a started :class:`engine.RolloutEngineThread`, or a trio-native engine from
            ``open_rollout_engine`` (then run the collector in a worker thread of its loop).
        tokenizer: the tokenizer of the engine's model (required).
        model: optional: the trainer's model, only used by torchrl's scoring paths
            (:meth:`get_new_version` with ``generate=False``, ``get_dist``); never for generation.
        gconfig: the engine's sampling parameters; ``generate_kwargs``: torchrl's names for
            them (see :func:`~engine.integrations._torchrl_bridge.gconfig_from_generate_kwargs`),
            applied over ``gconfig``.
        config: :class:`~engine.integrations.torchrl.TorchRLConfig` (attempts per row, call timeout).
        engine_key: where ``versions`` and ``stop_reason`` go.
        Other keyword arguments: as for torchrl's ``TransformersWrapper``.

    Raises:
        ValueError: ``generate=False`` (score with torchrl's ``TransformersWrapper``), no
            tokenizer, ``num_samples`` / batching set (repeat prompts in the env instead).
        InvalidRequestError: a generation argument the engine cannot honour (names it).
        BackendError: (from a call) a row failed ``config.max_attempts`` times; names the row.
        TimeoutError: (from a call) ``config.call_timeout_s`` passed.
    """

    def __init__(self, engine: Any, *, tokenizer: Any, model: Any = None,
                 gconfig: GenerationHyperparameters | None = None, generate_kwargs: dict[str, Any] | None = None,
                 config: TorchRLConfig | None = None, engine_key: Any = "engine", generate: bool = True,
                 input_mode: str = "history", return_log_probs: bool | None = True, **kwargs: Any) -> None:
        if not generate:
            raise ValueError("EngineWrapper(generate=False): the engine generates; score with torchrl's own "
                             "TransformersWrapper(model, generate=False, return_log_probs=True), e.g. "
                             "wrapper.get_new_version(generate=False)")
        if tokenizer is None:
            raise ValueError("EngineWrapper: pass tokenizer= (the tokenizer of the engine's model)")
        for name in ("num_samples", "batching", "min_batch_size", "max_batch_size"):
            if kwargs.get(name) not in (None, False):
                raise ValueError(f"EngineWrapper({name}=...): not supported; every row of the env batch is one "
                                 "completion and all rows run at once (repeat prompts with "
                                 "ChatEnv.from_dataloader(repeats=n, group_repeats=True))")
            kwargs.pop(name, None)
        kwargs.pop("generate_kwargs", None)
        super().__init__(model, tokenizer=tokenizer, generate=True, input_mode=input_mode,
                         return_log_probs=return_log_probs, **kwargs)
        self.engine = engine
        self.config = config or TorchRLConfig()
        self.engine_key = engine_key
        self.out_keys.append(engine_key)
        base = gconfig_from_generate_kwargs(generate_kwargs, gconfig)
        self._gconfig_args = (gconfig, generate_kwargs)
        self.gconfig = base if base.ignore_eos else base.new_with_stop_and_pad_token_ids(self.tokenizer)
        self._ctor = {"input_mode": input_mode, "return_log_probs": return_log_probs, **kwargs}
        self._bridge = Bridge(engine)
        self._counters = CallCounters()

    # -- torchrl's generation steps -------------------------------------------------------
    def _generate_from_tokens(self, tokens_prompt_padded: torch.Tensor, attention_mask_prompt_padded: torch.Tensor,
                              cfg: Any, out: Any) -> Any:
        """History and tokens modes (``TransformersWrapper._generate_from_tokens``)."""
        mask = attention_mask_prompt_padded.bool()
        prompts = [row[m].tolist() for row, m in zip(tokens_prompt_padded, mask)]
        rows = self._rows(prompts, cfg)
        pad = self._pad_id()
        resp_padded = _pad_right([r[0] for r in rows], pad)
        full_padded = torch.cat([tokens_prompt_padded.to(torch.int64), resp_padded], -1)  # [B, P + R]

        text = Text._from_tensordict(out.empty())
        text.prompt = None  # tokens mode has no text (history mode fills it afterwards)
        with text.view(-1) as flat:
            flat.response = self.tokenizer.batch_decode([r[0] for r in rows], skip_special_tokens=False)
        text.full = None
        out.set(self.text_key, text)

        tokens = Tokens._from_tensordict(out.empty())
        if self.pad_output:
            tokens.prompt = tokens_prompt_padded
            with tokens.view(-1) as flat:
                flat.response, flat.full = resp_padded, full_padded
        else:
            tokens.prompt = _unpad_tensors(tokens_prompt_padded, attention_mask_prompt_padded, as_nested=False)
            with tokens.view(-1) as flat:
                flat.response = [r[0] for r in rows]
                flat.full = _unpad_tensors(full_padded, full_padded != pad, as_nested=False)
        tokens.padded = MetaData(self.pad_output)
        out.set(self.tokens_key, tokens)

        masks = Masks._from_tensordict(out.empty())
        if self.pad_output:
            masks.all_attention_mask = full_padded != pad
        else:
            masks.all_attention_mask = [torch.ones_like(f, dtype=torch.bool) for f in out.get(
                (self.tokens_key, "full"), as_list=True)]
        masks.all_assistant_mask = None
        masks.padded = MetaData(self.pad_output)
        out.set(self.masks_key, masks)

        if self.return_log_probs:
            lp = LogProbs._from_tensordict(out.empty())
            lp.response = _pad_right([r[1] for r in rows], 0.0) if self.pad_output else [r[1] for r in rows]
            lp.padded = MetaData(self.pad_output)
            out.set(self.log_probs_key, lp)
        self._set_engine_fields(out, rows)
        return out

    def _generate_from_text(self, text: Any, cfg: Any, out: Any) -> Any:
        """Text mode (``TransformersWrapper._generate_from_text``)."""
        if isinstance(text, str):
            text = [text]
        elif not isinstance(text, list):
            text = text.tolist()
        kwargs = dict(self.tokenizer_kwargs)
        kwargs.setdefault("padding", True)
        enc = self.tokenizer(text, **kwargs)
        ids = torch.as_tensor(enc["input_ids"]).to(torch.int64)  # [B, P], left-padded
        attn = torch.as_tensor(enc["attention_mask"])
        prompts = [row[m.bool()].tolist() for row, m in zip(ids, attn)]
        rows = self._rows(prompts, cfg)
        pad = self._pad_id()
        resp_padded = _pad_right([r[0] for r in rows], pad)
        full_padded = torch.cat([ids, resp_padded], -1)  # [B, P + R]
        full_mask = torch.cat([attn.bool(), resp_padded != pad], -1)
        response_text = self.tokenizer.batch_decode([r[0] for r in rows], skip_special_tokens=False)

        text_obj = Text._from_tensordict(out.empty())
        with text_obj.view(-1) as flat:
            flat.prompt = text
            flat.response = response_text
            flat.full = [t + r for t, r in zip(text, response_text)]
        out.set(self.text_key, text_obj)

        tokens = Tokens._from_tensordict(out.empty())
        if self.pad_output:
            tokens.prompt = ids
            with tokens.view(-1) as flat:
                flat.response, flat.full = resp_padded, full_padded
        else:
            tokens.prompt = _unpad_tensors(ids, attn, as_nested=False)
            with tokens.view(-1) as flat:
                flat.response = [r[0] for r in rows]
                flat.full = _unpad_tensors(full_padded, full_mask, as_nested=False)
        tokens.padded = MetaData(self.pad_output)
        out.set(self.tokens_key, tokens)

        masks = Masks._from_tensordict(out.empty())
        if self.pad_output:
            masks.all_attention_mask = full_mask
        else:
            masks.all_attention_mask = _unpad_tensors(full_mask, full_mask, as_nested=False)
        masks.all_assistant_mask = None
        masks.padded = MetaData(self.pad_output)
        out.set(self.masks_key, masks)

        if self.return_log_probs:
            lp = LogProbs._from_tensordict(out.empty())
            with lp.view(-1) as flat:
                flat.prompt = None
                flat.response = _pad_right([r[1] for r in rows], 0.0) if self.pad_output else [r[1] for r in rows]
                flat.full = None
            lp.padded = MetaData(self.pad_output)
            out.set(self.log_probs_key, lp)
        self._set_engine_fields(out, rows)
        return out

    # -- the engine call ------------------------------------------------------------------
    def _rows(self, prompts: list[list[int]], cfg: Any) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, str]]:
        """``(tokens int64, logprobs float32, versions int64, stop_reason)`` per row, pad ids left out."""
        if cfg is not None:
            raise InvalidRequestError("EngineWrapper: per-call generation arguments (policy(td, **kwargs)) are not "
                                      "supported; set gconfig= or generate_kwargs= when building the wrapper")
        start = time.perf_counter()
        c = self._counters
        try:
            responses = self._bridge.run(generate_rows, prompts, self.gconfig, self.tokenizer,
                                         max_attempts=self.config.max_attempts,
                                         timeout_s=self.config.call_timeout_s, counters=c)
        finally:
            c.calls += 1
            c.wait_s += time.perf_counter() - start
        pad = self._pad_id()
        rows = [_row(r, pad) for r in responses]
        c.last_versions = sorted({v for r in responses for v in r.output_versions})
        return rows

    def _set_engine_fields(self, out: Any, rows: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, str]]) -> None:
        fields: Any = TensorDict(batch_size=out.batch_size).to_lazystack(0)  # ragged rows: set() takes lists
        if self.pad_output:
            fields.set("versions", _pad_right([r[2] for r in rows], -1))
        else:
            fields.set("versions", [r[2] for r in rows])
        fields.set("stop_reason", [r[3] for r in rows])
        out.set(self.engine_key, fields)

    def _pad_id(self) -> int:
        pad = getattr(self.tokenizer, "pad_token_id", None)
        return int(self.padding_value if pad is None else pad)

    # -- torchrl's hooks ------------------------------------------------------------------
    def get_new_version(self, **kwargs: Any) -> Any:
        """A copy with some arguments changed (torchrl's ``LLMWrapperBase.get_new_version``).

        With ``generate=False`` this is torchrl's own ``TransformersWrapper`` over
        ``model`` (the trainer's; the engine does not score), with this wrapper's
        tokenizer, input mode and keys; otherwise another :class:`EngineWrapper` on the
        same engine.

        Raises:
            ValueError: ``generate=False`` and no ``model`` (given here or at construction).
        """
        args = {**self._ctor, **kwargs}
        model = args.pop("model", self.model)
        tokenizer = args.pop("tokenizer", self.tokenizer)
        if not args.pop("generate", True):
            if model is None:
                raise ValueError("EngineWrapper.get_new_version(generate=False): no model to score with; pass "
                                 "model= (the trainer's model) here or when building the EngineWrapper")
            args.pop("input_key", None)  # the scorer reads the full sequence, not the prompt
            for name in ("engine", "gconfig", "generate_kwargs", "config", "engine_key"):
                args.pop(name, None)
            return TransformersWrapper(model, tokenizer=tokenizer, generate=False, **args)
        gconfig, generate_kwargs = self._gconfig_args
        args.setdefault("gconfig", gconfig)
        args.setdefault("generate_kwargs", generate_kwargs)
        args.setdefault("config", self.config)
        args.setdefault("engine_key", self.engine_key)
        return type(self)(args.pop("engine", self.engine), tokenizer=tokenizer, model=model, **args)

    def register_collector(self, collector: Any) -> None:
        """Called by torchrl's ``LLMCollector``: keeps a weak reference to it (torchrl) and,
        when the collector has no weight updater of its own, installs an
        :class:`~engine.integrations.torchrl.EngineWeightUpdater` on this wrapper's engine,
        so that ``collector.update_policy_weights_(weights)`` reaches the engine."""
        super().register_collector(collector)
        install_weight_updater(collector, self.engine, source=self.model)

    def statistics(self) -> EngineWrapperStatistics:
        """A frozen snapshot (sync, cheap)."""
        c = self._counters
        return EngineWrapperStatistics(calls=c.calls, rows=c.rows, rows_retried=c.rows_retried,
                                       generated_tokens=c.generated_tokens, wait_s=c.wait_s,
                                       last_versions=tuple(c.last_versions))


def _row(resp: ModelResponse, pad: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, str]:
    keep = [i for i, t in enumerate(resp.output_tokens) if t != pad]  # torchrl's rule: no pad ids in a response
    tokens = torch.tensor([resp.output_tokens[i] for i in keep], dtype=torch.int64)
    logprobs = torch.tensor([resp.output_logprobs[i] for i in keep], dtype=torch.float32)
    versions = torch.tensor([resp.output_versions[i] for i in keep], dtype=torch.int64)
    return tokens, logprobs, versions, resp.stop_reason


def _pad_right(rows: list[torch.Tensor], value: float) -> torch.Tensor:
    """``[B, max len]``, right-padded with ``value`` (dtype of the rows)."""
    return pad_sequence(rows, batch_first=True, padding_value=value, padding_side="right")

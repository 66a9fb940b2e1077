"""An ``openai.AsyncOpenAI`` whose chat completions run on ``engine.agenerate``.

::

    client = EngineOpenAI(engine, tokenizer, gconfig=GenerationHyperparameters(max_new_tokens=256))
    c = await client.chat.completions.create(messages=msgs, tools=[calculator], temperature=1.0)
    c.choices[0].message.tool_calls          # openai's own types, parsed from <tool_call> blocks
    msgs += [c.choices[0].message, {"role": "tool", "tool_call_id": ..., "content": "5"}]
    c2 = await client.chat.completions.create(messages=msgs, tools=[calculator])
    client.set_last_reward(1.0)
    client.apply_reward_discount(0.9)
    return client.export_interactions("concat")  # from arun_episode: the executor makes rows

What a call does (AReaL's ``ArealOpenAI``, ``areal/experimental/openai/client.py``,
with the token-exact rule of :mod:`engine.chat`):

1. The prompt ids.  When the request's messages extend a cached completion's
   conversation (:meth:`InteractionCache.find_parent`), they are that
   completion's prompt ids + its sampled ids + the ids of only the new
   messages (:func:`engine.chat.message_delta`; the earlier turns are rendered
   from their raw sampled text, so the template reproduces the ids sent).
   Otherwise the messages are rendered with the chat template (``tools``
   included) and tokenized.  Two cases are *retokenization drift*, counted in
   ``EngineStatistics.retokenization_drifts`` and flagged on the interaction:
   the template renders the cached history differently from the ids sent
   (``message_delta`` says so), or the messages hold an assistant turn that no
   cached completion produced (the history is tokenized again).
2. ``engine.agenerate`` with the request's sampling parameters over the
   client's ``gconfig`` (stop and pad ids of the tokenizer added):
   ``max_completion_tokens`` or ``max_tokens`` (not both) -> ``max_new_tokens``;
   ``temperature=0`` -> greedy; ``top_p``, ``stop``, ``seed``, ``frequency_penalty``.
3. The output decoded without special tokens (a stop string removed from its
   end); with ``tools`` given (and ``tool_choice`` not ``"none"``) the
   tool-call parser (:mod:`engine.openai.tool_calls`) turns its calls into
   ``tool_calls``, ``finish_reason`` ``"tool_calls"`` (``ModelResponse.stop_reason``
   too; a turn cut by the budget stays ``"length"``).
4. An :class:`~engine.openai.interaction.Interaction` in the client's cache,
   keyed by the completion id.

Refused with a clear error: ``n != 1`` and ``stream=True`` (``NotImplementedError``),
both ``max_tokens`` and ``max_completion_tokens``, ``response_format`` other
than text, ``logit_bias`` (:class:`~engine.errors.InvalidRequestError`).  Other
OpenAI parameters (``user``, ``metadata``, ``parallel_tool_calls``, ...) do not
change generation and are ignored.  Only ``chat.completions`` and
``completions`` go to the engine; any other endpoint of this client would try
the network and fail.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import replace
from functools import cached_property
from typing import Any, Literal

import openai
from openai.types import Completion, CompletionChoice, CompletionUsage
from openai.types.chat import (ChatCompletion, ChatCompletionMessage, ChatCompletionMessageToolCallUnion,
                               ChatCompletionTokenLogprob)
from openai.types.chat.chat_completion import Choice, ChoiceLogprobs
from openai.types.chat.chat_completion_message_function_tool_call import ChatCompletionMessageFunctionToolCall, Function

from ..chat import assistant_message, decode_text, encode_text, message_delta, record_drift, render_messages
from ..errors import InvalidRequestError
from ..types import GenerationHyperparameters, ModelRequest, ModelResponse
from .cache import InteractionCache
from .interaction import Interaction, to_plain_message
from .tool_calls import resolve_tool_parser

__all__ = ["EngineOpenAI"]

_HTTP_CLIENT: Any = None  # one idle httpx client shared by every EngineOpenAI (the base class wants one)

#: Parameters that do not change what is generated; accepted and ignored.
_IGNORED = frozenset({"model", "user", "metadata", "store", "parallel_tool_calls", "service_tier", "extra_headers",
                      "extra_query", "extra_body", "timeout", "stream_options", "reasoning_effort", "modalities",
                      "prediction", "audio", "web_search_options", "safety_identifier", "prompt_cache_key",
                      "verbosity", "top_logprobs", "prompt_cache_retention", "moderation"})


def _given(value: Any) -> Any:
    """``None`` for the SDK's "not given" sentinels."""
    return None if isinstance(value, (openai.NotGiven, openai.Omit)) else value


def _shared_http_client() -> Any:
    global _HTTP_CLIENT
    if _HTTP_CLIENT is None:
        _HTTP_CLIENT = openai.DefaultAsyncHttpxClient()
    return _HTTP_CLIENT


def _new_id(prefix: str) -> str:
    return f"{prefix}{os.urandom(12).hex()}"


class EngineOpenAI(openai.AsyncOpenAI):
    """``openai.AsyncOpenAI`` over a rollout engine (in-process; see the module docstring).

    Args:
        engine: anything with ``await agenerate(ModelRequest) -> ModelResponse``
            (a :class:`~engine.executor.RolloutEngine`).
        tokenizer: a transformers tokenizer with a chat template.
        gconfig: base sampling parameters (default ``max_new_tokens=512``);
            the tokenizer's pad and eos ids are added to ``stop_token_ids``.
        tool_parser: a name (``"hermes"``, ``"qwen"``), an object with
            ``parse(text)``, or ``None`` (:func:`~engine.openai.tool_calls.resolve_tool_parser`).
        chat_template_kwargs: passed to every ``apply_chat_template`` call
            (e.g. ``enable_thinking``).
        cache: the :class:`InteractionCache` to record into (a new one by default).
        model: the model name put in the returned objects.
        metadata: ``ModelRequest.metadata`` of every request (e.g. a routing key).

    Raises:
        ValueError: an unknown ``tool_parser``.
    """

    def __init__(self, engine: Any, tokenizer: Any, *, gconfig: GenerationHyperparameters | None = None,
                 tool_parser: Any = "hermes", chat_template_kwargs: Mapping[str, Any] | None = None,
                 cache: InteractionCache | None = None, model: str = "default",
                 metadata: Mapping[str, Any] | None = None) -> None:
        super().__init__(api_key="trio-rollout", base_url="http://trio-rollout.invalid/v1", max_retries=0,
                         http_client=_shared_http_client())
        self.engine = engine
        self.tokenizer = tokenizer
        base = gconfig if gconfig is not None else GenerationHyperparameters(max_new_tokens=512)
        self.gconfig = base.new_with_stop_and_pad_token_ids(tokenizer).new(n_samples=1)
        self.tool_parser = resolve_tool_parser(tool_parser)
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        self.cache = cache if cache is not None else InteractionCache()
        self.model = model
        self.metadata = dict(metadata or {})

    # -- the OpenAI surface ----------------------------------------------------------
    @cached_property
    def chat(self) -> Any:
        return _Chat(self)

    @cached_property
    def completions(self) -> Any:
        return _Completions(self)

    def copy(self, **_: Any) -> EngineOpenAI:
        """This client: connection options mean nothing in-process."""
        return self

    with_options = copy

    # -- rewards and export (the cache's, for convenience) ----------------------------
    def set_reward(self, interaction_id: str, reward: float) -> None:
        """:meth:`InteractionCache.set_reward`."""
        self.cache.set_reward(interaction_id, reward)

    def set_last_reward(self, reward: float) -> None:
        """:meth:`InteractionCache.set_last_reward`."""
        self.cache.set_last_reward(reward)

    def apply_reward_discount(self, turn_discount: float = 1.0) -> dict[str, float]:
        """:meth:`InteractionCache.apply_reward_discount`."""
        return self.cache.apply_reward_discount(turn_discount)

    def export_interactions(self, style: str = "individual", *,
                            drop_retry_orphans: bool = False) -> dict[str, Interaction]:
        """:meth:`InteractionCache.export_interactions`."""
        return self.cache.export_interactions(style, drop_retry_orphans=drop_retry_orphans)

    # -- implementation ------------------------------------------------------------------
    def _sampling(self, *, max_tokens: Any, max_completion_tokens: Any, temperature: Any, top_p: Any,
                  stop: Any, seed: Any, frequency_penalty: Any) -> GenerationHyperparameters:
        max_tokens, max_completion_tokens = _given(max_tokens), _given(max_completion_tokens)
        if max_tokens is not None and max_completion_tokens is not None:
            raise InvalidRequestError("give max_completion_tokens or max_tokens (deprecated), not both")
        overrides: dict[str, Any] = {}
        limit = max_completion_tokens if max_completion_tokens is not None else max_tokens
        if limit is not None:
            if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
                raise InvalidRequestError(f"max_completion_tokens/max_tokens must be an int >= 1, got {limit!r}")
            overrides["max_new_tokens"] = limit
        temperature = _given(temperature)
        if temperature is not None:
            overrides["temperature"] = float(temperature)
            overrides["greedy"] = float(temperature) == 0.0
        if _given(top_p) is not None:
            overrides["top_p"] = float(top_p)
        stop = _given(stop)
        if stop is not None:
            stops = [stop] if isinstance(stop, str) else list(stop)
            if not all(isinstance(s, str) and s for s in stops):
                raise InvalidRequestError(f"stop must be a string or a list of non-empty strings, got {stop!r}")
            overrides["stop"] = stops or None
        if _given(seed) is not None:
            overrides["seed"] = int(seed)
        if _given(frequency_penalty) is not None:
            overrides["frequency_penalty"] = float(frequency_penalty)
        return self.gconfig.new(**overrides)

    async def _generate(self, ids: list[int], gconfig: GenerationHyperparameters) -> ModelResponse:
        return await self.engine.agenerate(ModelRequest(input_ids=ids, gconfig=gconfig, tokenizer=self.tokenizer,
                                                        metadata=dict(self.metadata)))

    def _visible_text(self, resp: ModelResponse, gconfig: GenerationHyperparameters) -> str:
        text = self.tokenizer.decode(resp.output_tokens, skip_special_tokens=True)
        for s in gconfig.stop or ():
            if text.endswith(s):
                return text[:-len(s)]
        return text

    def _prompt(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
                ) -> tuple[list[int], list[dict[str, Any]], Interaction | None, bool]:
        """``(prompt ids, template messages, parent, drift)`` (step 1 of the module docstring)."""
        kwargs = dict(self.chat_template_kwargs)
        if tools is not None:
            kwargs["tools"] = tools
        parent = self.cache.find_parent(messages)
        if parent is not None:
            sent = parent.input_ids + parent.output_ids
            history = [*parent.template_messages, parent.raw_assistant]
            new = messages[len(parent.messages) + 1:]
            delta = message_delta(self.tokenizer, sent, history, new, chat_template_kwargs=kwargs)
            return sent + delta.ids, [*history, *new], parent, delta.drift
        drift = any(m.get("role") == "assistant" for m in messages)
        if drift:
            record_drift(f"no cached completion matches the assistant turns of a {len(messages)}-message request: "
                         "its history is tokenized again")
        text = render_messages(self.tokenizer, messages, add_generation_prompt=True, chat_template_kwargs=kwargs)
        return encode_text(self.tokenizer, text), list(messages), None, drift

    async def create_chat_completion(self, *, messages: Sequence[Any], tools: Sequence[Any] | None = None,
                                     tool_choice: Any = None, temperature: Any = None, top_p: Any = None,
                                     max_tokens: Any = None, max_completion_tokens: Any = None, stop: Any = None,
                                     n: Any = None, seed: Any = None, frequency_penalty: Any = None,
                                     logprobs: Any = None, stream: Any = None, response_format: Any = None,
                                     logit_bias: Any = None, **ignored: Any) -> ChatCompletion:
        """``client.chat.completions.create``: see the module docstring.

        Raises:
            NotImplementedError: ``n != 1`` or ``stream=True``.
            InvalidRequestError: bad ``messages``, both token limits, a
                non-text ``response_format``, ``logit_bias``, an unknown
                parameter, or no token budget left (the prompt is too long).
            WorkflowError: the chat template failed on the messages.
            BackendError: the backend failed.
        """
        n, stream = _given(n), _given(stream)
        if n not in (None, 1):
            raise NotImplementedError(f"n={n!r}: one choice per call (call create n times, or submit the episode "
                                      "with group_size=n)")
        if stream:
            raise NotImplementedError("stream=True: streaming is not supported; call without stream")
        response_format, logit_bias = _given(response_format), _given(logit_bias)
        if response_format is not None and dict(response_format).get("type") != "text":
            raise InvalidRequestError(f"response_format {response_format!r} is not supported (only text)")
        if logit_bias:
            raise InvalidRequestError("logit_bias is not supported")
        unknown = sorted(k for k, v in ignored.items() if k not in _IGNORED and _given(v) is not None)
        if unknown:
            raise InvalidRequestError(f"chat.completions.create: unsupported parameter(s) {unknown}")
        messages = _given(messages)
        if isinstance(messages, (str, bytes, Mapping)) or not isinstance(messages, Sequence) or not messages:
            raise InvalidRequestError("messages must be a non-empty list of chat messages")
        try:
            msgs = [to_plain_message(m) for m in messages]
        except TypeError as exc:
            raise InvalidRequestError(f"messages: {exc}") from None
        for i, m in enumerate(msgs):
            if not isinstance(m.get("role"), str):
                raise InvalidRequestError(f"messages[{i}] has no 'role'")
        tools = _given(tools)
        tool_list = [to_plain_message(t) for t in tools] if tools else None
        gconfig = self._sampling(max_tokens=max_tokens, max_completion_tokens=max_completion_tokens,
                                 temperature=temperature, top_p=top_p, stop=stop, seed=seed,
                                 frequency_penalty=frequency_penalty)
        ids, template_messages, parent, drift = self._prompt(msgs, tool_list)
        resp = await self._generate(ids, gconfig)

        text = self._visible_text(resp, gconfig)
        content: str | None = text
        calls: list[Any] = []
        if tool_list and _given(tool_choice) != "none" and self.tool_parser is not None:
            content, calls = self.tool_parser.parse(text)
        raw = assistant_message(self.tokenizer, resp.output_tokens, stopped=resp.stop_reason == "stop",
                                stop_token_ids=gconfig.stop_token_ids)
        finish: Literal["length", "tool_calls", "stop"] = (
            "length" if resp.stop_reason == "length" else ("tool_calls" if calls else "stop"))
        if finish == "tool_calls":
            resp = replace(resp, stop_reason="tool_calls")
        tool_calls: list[ChatCompletionMessageToolCallUnion] | None = [ChatCompletionMessageFunctionToolCall(id=_new_id("call_"), type="function",
                                                            function=Function(name=c.name, arguments=c.arguments))
                      for c in calls] or None
        message = ChatCompletionMessage(role="assistant", content=content, tool_calls=tool_calls)
        choice_logprobs = None
        if _given(logprobs):
            choice_logprobs = ChoiceLogprobs(content=[
                ChatCompletionTokenLogprob(token=decode_text(self.tokenizer, [t]), logprob=lp,
                                           bytes=list(decode_text(self.tokenizer, [t]).encode()), top_logprobs=[])
                for t, lp in zip(resp.output_tokens, resp.output_logprobs)])
        completion = ChatCompletion(
            id=_new_id("chatcmpl-"), object="chat.completion", created=int(time.time()), model=self.model,
            choices=[Choice(index=0, finish_reason=finish, message=message, logprobs=choice_logprobs)],
            usage=CompletionUsage(prompt_tokens=resp.input_len, completion_tokens=resp.output_len,
                                  total_tokens=resp.input_len + resp.output_len))
        output_message: dict[str, Any] = {"role": "assistant", "content": content}
        if tool_calls:
            output_message["tool_calls"] = [c.model_dump(mode="json") for c in tool_calls]
        self.cache.add(Interaction(
            id=completion.id, response=resp, messages=msgs, output_message=output_message,
            template_messages=template_messages, raw_assistant=raw, completion=completion, tools=tool_list,
            parent=parent, drift=drift))
        return completion

    async def create_completion(self, *, prompt: Any, max_tokens: Any = None, temperature: Any = None,
                                top_p: Any = None, stop: Any = None, n: Any = None, seed: Any = None,
                                frequency_penalty: Any = None, stream: Any = None, logprobs: Any = None,
                                logit_bias: Any = None, **ignored: Any) -> Completion:
        """``client.completions.create``: ``prompt`` (a string, tokenized as it
        is, or a list of token ids) -> ``openai.types.Completion``, recorded as an
        interaction of kind ``"completion"`` (never a parent of a chat completion).

        Raises:
            NotImplementedError: ``n != 1`` or ``stream=True``.
            InvalidRequestError: a bad ``prompt``, ``logit_bias``, an unknown
                parameter, or no token budget left.
        """
        n, stream = _given(n), _given(stream)
        if n not in (None, 1):
            raise NotImplementedError(f"n={n!r}: one choice per call (call create n times)")
        if stream:
            raise NotImplementedError("stream=True: streaming is not supported; call without stream")
        if _given(logit_bias):
            raise InvalidRequestError("logit_bias is not supported")
        unknown = sorted(k for k, v in ignored.items() if k not in _IGNORED and _given(v) is not None)
        if unknown:
            raise InvalidRequestError(f"completions.create: unsupported parameter(s) {unknown}")
        prompt = _given(prompt)
        if isinstance(prompt, str) and prompt:
            ids = encode_text(self.tokenizer, prompt)
        elif (isinstance(prompt, list) and prompt and
              all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt)):
            ids = list(prompt)
        else:
            raise InvalidRequestError("prompt must be a non-empty string or a non-empty list of token ids")
        gconfig = self._sampling(max_tokens=max_tokens, max_completion_tokens=None, temperature=temperature,
                                 top_p=top_p, stop=stop, seed=seed, frequency_penalty=frequency_penalty)
        resp = await self._generate(ids, gconfig)
        finish: Literal["length", "stop"] = "length" if resp.stop_reason == "length" else "stop"
        completion = Completion(
            id=_new_id("cmpl-"), object="text_completion", created=int(time.time()), model=self.model,
            choices=[CompletionChoice(index=0, text=self._visible_text(resp, gconfig), finish_reason=finish,
                                      logprobs=None)],
            usage=CompletionUsage(prompt_tokens=resp.input_len, completion_tokens=resp.output_len,
                                  total_tokens=resp.input_len + resp.output_len))
        self.cache.add(Interaction(id=completion.id, response=resp, completion=completion, kind="completion"))
        return completion


class _ChatCompletions:
    def __init__(self, client: EngineOpenAI) -> None:
        self._client = client

    async def create(self, **kwargs: Any) -> ChatCompletion:
        """:meth:`EngineOpenAI.create_chat_completion`."""
        return await self._client.create_chat_completion(**kwargs)


class _Chat:
    def __init__(self, client: EngineOpenAI) -> None:
        self.completions = _ChatCompletions(client)


class _Completions:
    def __init__(self, client: EngineOpenAI) -> None:
        self._client = client

    async def create(self, **kwargs: Any) -> Completion:
        """:meth:`EngineOpenAI.create_completion`."""
        return await self._client.create_completion(**kwargs)

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

``n`` (1 to 128) choices are ``n`` samples of the same prompt ids, generated
concurrently, each recorded as its own interaction (its own row), with id
``<completion id>-<index>`` (the completion id itself when ``n`` is 1).  With
``seed=s``, choice 0 samples with ``s`` (as ``n=1`` would) and choice ``i``
with ``engine.types.derive_seed(s, "choice", i)``: reproducible choices that
differ from each other; without a seed every choice is sampled independently.

``stream=True`` returns a :class:`~engine.openai._streaming.ChunkStream` of the
chunks an OpenAI server streams (``stream_options.include_usage`` adds the usage
chunk): the completion is generated and recorded first, exactly as without
``stream`` (:mod:`engine.openai._streaming`).

Refused with a clear error (:class:`~engine.errors.InvalidRequestError`): both
``max_tokens`` and ``max_completion_tokens``, ``response_format`` other than
text, ``logit_bias``, a bad ``n``.  Other OpenAI parameters (``user``,
``metadata``, ``parallel_tool_calls``, ...) do not change generation and are
ignored.  ``chat.completions``, ``completions`` and ``responses``
(:mod:`engine.openai._responses`) go to the engine; any other endpoint of this
client would try the network and fail.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import replace
from functools import cached_property
from typing import Any, Literal

import openai
import trio
from openai.types import Completion, CompletionChoice, CompletionUsage
from openai.types.chat import (ChatCompletion, ChatCompletionChunk, ChatCompletionMessage,
                               ChatCompletionMessageToolCallUnion, ChatCompletionTokenLogprob)
from openai.types.chat.chat_completion import Choice, ChoiceLogprobs
from openai.types.responses import Response
from openai.types.chat.chat_completion_message_function_tool_call import ChatCompletionMessageFunctionToolCall, Function

from ..chat import assistant_message, decode_text, encode_text, message_delta, record_drift, render_messages
from ..errors import InvalidRequestError
from ..types import GenerationHyperparameters, ModelRequest, ModelResponse, derive_seed
from ._streaming import ChunkStream, chat_completion_chunks, completion_chunks, include_usage
from .cache import InteractionCache
from .interaction import Interaction, to_plain_message
from .tool_calls import resolve_tool_parser

__all__ = ["EngineOpenAI"]

_HTTP_CLIENT: Any = None  # one idle httpx client shared by every EngineOpenAI (the base class wants one)

#: Parameters that do not change what is generated; accepted and ignored.
_IGNORED = frozenset({"model", "user", "metadata", "store", "parallel_tool_calls", "service_tier", "extra_headers",
                      "extra_query", "extra_body", "timeout", "reasoning_effort", "modalities",
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


#: The most choices one request may ask for (OpenAI's own limit).
MAX_CHOICES = 128


def _choice_count(n: Any) -> int:
    n = _given(n)
    if n is None:
        return 1
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_CHOICES:
        raise InvalidRequestError(f"n must be an int in [1, {MAX_CHOICES}], got {n!r}")
    return n


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
        self._stored_responses: dict[str, Any] = {}  # response id -> StoredResponse (previous_response_id)

    # -- the OpenAI surface ----------------------------------------------------------
    @cached_property
    def chat(self) -> Any:
        return _Chat(self)

    @cached_property
    def completions(self) -> Any:
        return _Completions(self)

    @cached_property
    def responses(self) -> Any:
        return _Responses(self)

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

    async def _generate_n(self, ids: list[int], gconfig: GenerationHyperparameters, n: int) -> list[ModelResponse]:
        """``n`` samples of one prompt, concurrently (the first error cancels the others).
        With a seed ``s``, sample 0 uses ``s`` (as ``n=1`` would) and sample ``i > 0``
        ``derive_seed(s, "choice", i)``: reproducible, and not ``n`` copies of one sample."""
        if n == 1:
            return [await self._generate(ids, gconfig)]
        out: list[Any] = [None] * n

        async def one(i: int) -> None:
            g = gconfig if gconfig.seed is None or i == 0 else gconfig.new(seed=derive_seed(gconfig.seed, "choice", i))
            out[i] = await self._generate(ids, g)

        async with trio.open_nursery() as nursery:
            for i in range(n):
                nursery.start_soon(one, i)
        return out

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
                                     logprobs: Any = None, stream: Any = None, stream_options: Any = None,
                                     response_format: Any = None, logit_bias: Any = None,
                                     **ignored: Any) -> ChatCompletion | ChunkStream[ChatCompletionChunk]:
        """``client.chat.completions.create``: see the module docstring.

        Returns:
            The ``ChatCompletion``; with ``stream=True`` a :class:`~engine.openai._streaming.ChunkStream`
            of its ``ChatCompletionChunk`` objects (generated and recorded first).

        Raises:
            InvalidRequestError: bad ``messages`` or ``n``, both token limits, a
                non-text ``response_format``, ``logit_bias``, ``stream_options``
                without ``stream``, an unknown parameter, or no token budget left
                (the prompt is too long).
            WorkflowError: the chat template failed on the messages.
            BackendError: the backend failed.
        """
        stream = bool(_given(stream))
        usage = include_usage(_given(stream_options), stream)
        completion, _ = await self._chat(
            messages=messages, tools=tools, tool_choice=tool_choice, n=n, logprobs=logprobs,
            response_format=response_format, logit_bias=logit_bias, ignored=ignored,
            sampling=dict(max_tokens=max_tokens, max_completion_tokens=max_completion_tokens, temperature=temperature,
                          top_p=top_p, stop=stop, seed=seed, frequency_penalty=frequency_penalty))
        if stream:
            return ChunkStream(chat_completion_chunks(completion, usage=usage), usage=usage)
        return completion

    def _chat_request(self, messages: Any, tools: Any, response_format: Any, logit_bias: Any,
                      ignored: Mapping[str, Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
        """The request's messages and tools as plain dicts, checked."""
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
        return msgs, ([to_plain_message(t) for t in tools] if tools else None)

    async def _chat(self, *, messages: Any, tools: Any, tool_choice: Any, n: Any, logprobs: Any,
                    response_format: Any, logit_bias: Any, ignored: Mapping[str, Any], sampling: Mapping[str, Any],
                    completion_id: str | None = None) -> tuple[ChatCompletion, list[Interaction]]:
        """Generate, record and return a chat completion with its interactions (one per choice)."""
        msgs, tool_list = self._chat_request(messages, tools, response_format, logit_bias, ignored)
        count = _choice_count(n)
        gconfig = self._sampling(**sampling)
        ids, template_messages, parent, drift = self._prompt(msgs, tool_list)
        resps = await self._generate_n(ids, gconfig, count)
        completion_id = completion_id or _new_id("chatcmpl-")
        choices, interactions = [], []
        for index, resp in enumerate(resps):
            choice, resp, output_message, raw = self._choice(index, resp, gconfig, tool_list, tool_choice, logprobs)
            choices.append(choice)
            interactions.append(Interaction(
                id=completion_id if count == 1 else f"{completion_id}-{index}", response=resp, messages=msgs,
                output_message=output_message, template_messages=template_messages, raw_assistant=raw,
                tools=tool_list, parent=parent, drift=drift))
        completion = ChatCompletion(
            id=completion_id, object="chat.completion", created=int(time.time()), model=self.model, choices=choices,
            usage=CompletionUsage(prompt_tokens=len(ids), completion_tokens=sum(r.output_len for r in resps),
                                  total_tokens=len(ids) + sum(r.output_len for r in resps)))
        for interaction in interactions:
            interaction.completion = completion
            self.cache.add(interaction)
        return completion, interactions

    def _choice(self, index: int, resp: ModelResponse, gconfig: GenerationHyperparameters,
                tool_list: list[dict[str, Any]] | None, tool_choice: Any, logprobs: Any
                ) -> tuple[Choice, ModelResponse, dict[str, Any], dict[str, Any]]:
        """``(choice, response with its stop reason, output message, raw assistant message)`` of one sample."""
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
        tool_calls: list[ChatCompletionMessageToolCallUnion] | None = [
            ChatCompletionMessageFunctionToolCall(id=_new_id("call_"), type="function",
                                                  function=Function(name=c.name, arguments=c.arguments))
            for c in calls] or None
        message = ChatCompletionMessage(role="assistant", content=content, tool_calls=tool_calls)
        choice_logprobs = None
        if _given(logprobs):
            choice_logprobs = ChoiceLogprobs(content=[
                ChatCompletionTokenLogprob(token=decode_text(self.tokenizer, [t]), logprob=lp,
                                           bytes=list(decode_text(self.tokenizer, [t]).encode()), top_logprobs=[])
                for t, lp in zip(resp.output_tokens, resp.output_logprobs)])
        output_message: dict[str, Any] = {"role": "assistant", "content": content}
        if tool_calls:
            output_message["tool_calls"] = [c.model_dump(mode="json") for c in tool_calls]
        choice = Choice(index=index, finish_reason=finish, message=message, logprobs=choice_logprobs)
        return choice, resp, output_message, raw

    async def create_completion(self, *, prompt: Any, max_tokens: Any = None, temperature: Any = None,
                                top_p: Any = None, stop: Any = None, n: Any = None, seed: Any = None,
                                frequency_penalty: Any = None, stream: Any = None, stream_options: Any = None,
                                logprobs: Any = None, logit_bias: Any = None,
                                **ignored: Any) -> Completion | ChunkStream[Completion]:
        """``client.completions.create``: ``prompt`` (a string, tokenized as it
        is, or a list of token ids) -> ``openai.types.Completion`` (``n`` choices),
        each choice recorded as an interaction of kind ``"completion"`` (never a
        parent of a chat completion); with ``stream=True`` a ``ChunkStream`` of its chunks.

        Raises:
            InvalidRequestError: a bad ``prompt`` or ``n``, ``logit_bias``, an unknown
                parameter, or no token budget left.
        """
        stream = bool(_given(stream))
        usage = include_usage(_given(stream_options), stream)
        if _given(logit_bias):
            raise InvalidRequestError("logit_bias is not supported")
        unknown = sorted(k for k, v in ignored.items() if k not in _IGNORED and _given(v) is not None)
        if unknown:
            raise InvalidRequestError(f"completions.create: unsupported parameter(s) {unknown}")
        count = _choice_count(n)
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
        resps = await self._generate_n(ids, gconfig, count)
        completion = Completion(
            id=_new_id("cmpl-"), object="text_completion", created=int(time.time()), model=self.model,
            choices=[CompletionChoice(index=i, text=self._visible_text(r, gconfig), logprobs=None,
                                      finish_reason="length" if r.stop_reason == "length" else "stop")
                     for i, r in enumerate(resps)],
            usage=CompletionUsage(prompt_tokens=len(ids), completion_tokens=sum(r.output_len for r in resps),
                                  total_tokens=len(ids) + sum(r.output_len for r in resps)))
        for i, resp in enumerate(resps):
            self.cache.add(Interaction(id=completion.id if count == 1 else f"{completion.id}-{i}", response=resp,
                                       completion=completion, kind="completion"))
        if stream:
            return ChunkStream(completion_chunks(completion, usage=usage), usage=usage)
        return completion


    async def create_response(self, *, input: Any, instructions: Any = None, tools: Any = None,
                              tool_choice: Any = None, temperature: Any = None, top_p: Any = None,
                              max_output_tokens: Any = None, previous_response_id: Any = None, store: Any = None,
                              stream: Any = None, include: Any = None, top_logprobs: Any = None, text: Any = None,
                              seed: Any = None, **other: Any) -> Response | ChunkStream[Any]:
        """``client.responses.create``: the Responses API on the chat path
        (:mod:`engine.openai._responses`); recorded as one interaction whose id is
        the response id.

        Returns:
            The ``Response``; with ``stream=True`` a ``ChunkStream`` of its events.

        Raises:
            InvalidRequestError: an unsupported parameter, item or tool, or no token budget left.
            ResponseNotFoundError: ``previous_response_id`` names no stored response of this client.
        """
        from ._response_events import response_events
        from ._responses import (RESPONSE_IGNORED, ResponseNotFoundError, StoredResponse, build_response, chat_tools,
                                 check_options, input_messages)

        given = {k: _given(v) for k, v in other.items() if _given(v) is not None}
        unknown = sorted(k for k in given if k not in RESPONSE_IGNORED and k not in ("background", "conversation",
                                                                                      "prompt", "background_options"))
        if unknown:
            raise InvalidRequestError(f"responses.create: unsupported parameter(s) {unknown}")
        params = {**given, "instructions": _given(instructions), "temperature": _given(temperature),
                  "top_p": _given(top_p), "tool_choice": _given(tool_choice), "text": _given(text),
                  "max_output_tokens": _given(max_output_tokens), "include": _given(include),
                  "top_logprobs": _given(top_logprobs)}
        logprobs = check_options(params)
        previous_id, previous = _given(previous_response_id), None
        if previous_id is not None:
            previous = self._stored_responses.get(previous_id)
            if previous is None:
                raise ResponseNotFoundError(f"previous_response_id {previous_id!r}: no stored response of this "
                                            "session has that id (responses made with store=false are not kept)")
        messages, instructions = input_messages(_given(input), instructions=params["instructions"], previous=previous)
        tools = _given(tools)
        completion, (interaction,) = await self._chat(
            messages=messages, tools=chat_tools(tools), tool_choice=params["tool_choice"], n=None, logprobs=logprobs,
            response_format=None, logit_bias=None, ignored={}, completion_id=_new_id("resp_"),
            sampling=dict(max_tokens=None, max_completion_tokens=params["max_output_tokens"],
                          temperature=params["temperature"], top_p=params["top_p"], stop=None, seed=seed,
                          frequency_penalty=None))
        response = build_response(completion, interaction, params=params, tools=tools, logprobs=logprobs,
                                  previous_response_id=previous_id, new_id=_new_id)
        interaction.completion = response
        if _given(store) is not False:
            self._stored_responses[response.id] = StoredResponse(
                response, messages[1:] if instructions else messages, interaction.output_message, instructions)
        if _given(stream):
            return ChunkStream(response_events(response), kind="event")
        return response

    def retrieve_response(self, response_id: str) -> Response:
        """A stored response (``client.responses.retrieve``).

        Raises:
            ResponseNotFoundError: none of that id (or it was made with ``store=false``).
        """
        from ._responses import ResponseNotFoundError

        stored = self._stored_responses.get(response_id)
        if stored is None:
            raise ResponseNotFoundError(f"no stored response {response_id!r} in this session")
        return stored.response


class _Responses:
    def __init__(self, client: EngineOpenAI) -> None:
        self._client = client

    async def create(self, **kwargs: Any) -> Response | ChunkStream[Any]:
        """:meth:`EngineOpenAI.create_response`."""
        return await self._client.create_response(**kwargs)

    async def retrieve(self, response_id: str, **_: Any) -> Response:
        """:meth:`EngineOpenAI.retrieve_response`."""
        return self._client.retrieve_response(response_id)


class _ChatCompletions:
    def __init__(self, client: EngineOpenAI) -> None:
        self._client = client

    async def create(self, **kwargs: Any) -> ChatCompletion | ChunkStream[ChatCompletionChunk]:
        """:meth:`EngineOpenAI.create_chat_completion`."""
        return await self._client.create_chat_completion(**kwargs)


class _Chat:
    def __init__(self, client: EngineOpenAI) -> None:
        self.completions = _ChatCompletions(client)


class _Completions:
    def __init__(self, client: EngineOpenAI) -> None:
        self._client = client

    async def create(self, **kwargs: Any) -> Completion | ChunkStream[Completion]:
        """:meth:`EngineOpenAI.create_completion`."""
        return await self._client.create_completion(**kwargs)

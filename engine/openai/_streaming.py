"""``stream=True``: a finished completion as the OpenAI streaming format.

The engine's ``agenerate`` returns a whole completion (prompt ids, sampled ids,
logprobs, versions); a streamed request is generated and recorded exactly as a
non-streamed one (:class:`~engine.openai.interaction.Interaction`), then sent as
the chunks an OpenAI server sends (the ``openai`` package's own types):

* chat completions (``chat.completion.chunk``, the format of
  ``client.chat.completions.create(stream=True)`` and ``.stream(...)``), per choice:
  a role delta (``{"role": "assistant", "content": ""}``), a content delta
  holding the visible text (with its ``logprobs`` when asked), one delta per tool
  call (index, id, type, function name) followed by its arguments delta, then an
  empty delta with ``finish_reason``; with ``stream_options.include_usage`` every
  chunk carries ``usage: null`` and a last chunk with no choices carries the
  usage (OpenAI's rule);
* completions (``text_completion``): one chunk per choice with its text and
  ``finish_reason``, then the usage chunk when asked.

All chunks carry the completion's id (the interaction id).  Over HTTP each chunk
is one server-sent event ``data: {json}`` and the stream ends with
``data: [DONE]`` (:func:`sse_data`).  In-process,
:class:`~engine.openai.EngineOpenAI` returns a :class:`ChunkStream`.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, Generic, TypeVar

from openai.types import Completion, CompletionChoice
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from openai.types.chat.chat_completion_chunk import (Choice as ChunkChoice, ChoiceDelta, ChoiceDeltaToolCall,
                                                     ChoiceDeltaToolCallFunction, ChoiceLogprobs)

from ..errors import InvalidRequestError

__all__ = ["ChunkStream", "chat_completion_chunks", "completion_chunks", "include_usage", "sse_data", "sse_events"]

T = TypeVar("T")


def include_usage(stream_options: Any, stream: bool) -> bool:
    """``stream_options.include_usage`` (``False`` when not given).

    Raises:
        InvalidRequestError: ``stream_options`` without ``stream=True`` (OpenAI's
            rule), not an object, or an ``include_usage`` that is not a bool.
    """
    if stream_options is None:
        return False
    if not stream:
        raise InvalidRequestError("stream_options is only allowed with stream=True")
    if not isinstance(stream_options, Mapping):
        raise InvalidRequestError(f"stream_options must be an object, got {type(stream_options).__name__}")
    value = stream_options.get("include_usage", False)
    if not isinstance(value, bool):
        raise InvalidRequestError(f"stream_options.include_usage must be a bool, got {value!r}")
    return value


def chat_completion_chunks(completion: ChatCompletion, *, usage: bool = False) -> list[ChatCompletionChunk]:
    """The chunks of a streamed ``completion`` (see the module docstring)."""
    def chunk(choices: list[ChunkChoice]) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=completion.id, object="chat.completion.chunk", created=completion.created,
                                   model=completion.model, choices=choices)

    out = []
    for choice in completion.choices:
        i, message = choice.index, choice.message
        out.append(chunk([ChunkChoice(index=i, delta=ChoiceDelta(role="assistant", content=""))]))
        if message.content:
            logprobs = None
            if choice.logprobs is not None:
                logprobs = ChoiceLogprobs(content=choice.logprobs.content, refusal=None)
            out.append(chunk([ChunkChoice(index=i, delta=ChoiceDelta(content=message.content), logprobs=logprobs)]))
        for k, call in enumerate(message.tool_calls or ()):
            fn = getattr(call, "function", None)
            if fn is None:  # a custom tool call: not made by this client
                continue
            out.append(chunk([ChunkChoice(index=i, delta=ChoiceDelta(tool_calls=[ChoiceDeltaToolCall(
                index=k, id=call.id, type="function", function=ChoiceDeltaToolCallFunction(name=fn.name, arguments="")
            )]))]))
            out.append(chunk([ChunkChoice(index=i, delta=ChoiceDelta(tool_calls=[ChoiceDeltaToolCall(
                index=k, function=ChoiceDeltaToolCallFunction(arguments=fn.arguments))]))]))
        out.append(chunk([ChunkChoice(index=i, delta=ChoiceDelta(), finish_reason=choice.finish_reason)]))
    if usage:
        out.append(chunk([]).model_copy(update={"usage": completion.usage}))
    return out


def completion_chunks(completion: Completion, *, usage: bool = False) -> list[Completion]:
    """The chunks of a streamed ``/v1/completions`` answer (see the module docstring)."""
    out = [completion.model_copy(update={"choices": [CompletionChoice(index=c.index, text=c.text,
                                                                      finish_reason=c.finish_reason,
                                                                      logprobs=c.logprobs)],
                                         "usage": None})
           for c in completion.choices]
    if usage:
        out.append(completion.model_copy(update={"choices": [], "usage": completion.usage}))
    return out


def _dump(chunk: Any, usage: bool) -> dict[str, Any]:
    data = chunk.model_dump(mode="json", exclude_none=True)
    if usage:  # OpenAI: with include_usage, every chunk has a "usage" key (null but on the last one)
        data.setdefault("usage", None)
    if isinstance(chunk, ChatCompletionChunk):
        for choice in data["choices"]:  # a chunk's choice always names these two, null or not
            choice.setdefault("finish_reason", None)
            choice.setdefault("logprobs", None)
    return data


def sse_data(chunks: Iterable[Any], *, usage: bool = False) -> Iterator[bytes]:
    """Server-sent events of chat/completion chunks: ``data: {json}`` each, then ``data: [DONE]``."""
    for chunk in chunks:
        yield b"data: " + json.dumps(_dump(chunk, usage), separators=(",", ":")).encode() + b"\n\n"
    yield b"data: [DONE]\n\n"


def sse_events(events: Iterable[Any]) -> Iterator[bytes]:
    """Server-sent events of Responses API events: ``event: TYPE`` + ``data: {json}`` each."""
    for event in events:
        data = json.dumps(event.model_dump(mode="json", exclude_none=True), separators=(",", ":"))
        yield f"event: {event.type}\ndata: {data}\n\n".encode()


class ChunkStream(Generic[T]):
    """What an in-process ``create(stream=True)`` returns: an async iterator of
    chunks (or Responses events) that also works as ``async with`` (like the SDK's
    ``AsyncStream``).  The completion was generated and recorded before it is returned.

    Attributes:
        items: the chunks, in order.
        usage: the request asked for ``stream_options.include_usage``.
    """

    def __init__(self, items: list[T], *, usage: bool = False, kind: str = "data") -> None:
        self.items, self.usage, self.kind = items, usage, kind
        self._next = 0

    def __aiter__(self) -> ChunkStream[T]:
        return self

    async def __anext__(self) -> T:  # not an async generator: nothing to finalize when left early
        if self._next >= len(self.items):
            raise StopAsyncIteration
        self._next += 1
        return self.items[self._next - 1]

    async def __aenter__(self) -> ChunkStream[T]:
        return self

    async def __aexit__(self, *exc: object) -> None:
        return None

    async def close(self) -> None:
        """Nothing to release (the chunks are in memory); for the SDK's interface."""

    def sse(self) -> Iterator[bytes]:
        """The server-sent events of the items (``data:`` or ``event:`` framing)."""
        return sse_events(self.items) if self.kind == "event" else sse_data(self.items, usage=self.usage)

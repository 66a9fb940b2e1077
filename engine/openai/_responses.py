"""The Responses API (``client.responses.create``) on the engine's chat completions.

A Responses request is turned into the chat request it stands for, which runs
through :class:`~engine.openai.EngineOpenAI`'s chat path (so it is token-exact
across calls, recorded as an :class:`~engine.openai.interaction.Interaction`
whose id is the response id, tool calls parsed), and the completion is given
back as an ``openai.types.responses.Response`` (and, with ``stream=True``, as the
server events an OpenAI server streams, :mod:`engine.openai._response_events`).

Request -> chat messages (OpenAI's semantics; the SDKs send these):

==================================  =================================================
``instructions``                    a leading system message (not carried over by
                                    ``previous_response_id``, as OpenAI)
``input`` (a string)                one user message
``{"role": r, "content": c}``       a message (``developer`` -> ``system``); content
(``type`` ``"message"`` or none)    parts (``input_text``, ``output_text``) joined
``{"type": "function_call"}``       a tool call (``call_id``, ``name``,
                                    ``arguments``) of the assistant turn it follows
                                    (an assistant message item, or a new turn)
``{"type": "function_call_output"}``  a ``tool`` message for ``call_id``
``{"type": "reasoning"}``           skipped (this engine emits none)
``tools`` ``{"type": "function"}``  chat tools (``name``, ``description``, ``parameters``)
``previous_response_id``            that stored response's conversation + its output
                                    first (404 ``response_not_found`` when unknown)
==================================  =================================================

``max_output_tokens`` -> ``max_completion_tokens``; ``temperature``, ``top_p``,
``tool_choice`` and ``seed`` (an extension, in ``extra_body``) as in chat;
``include=["message.output_text.logprobs"]`` (or ``top_logprobs``) puts each
output token's logprob in the output text.  ``store`` (default true) keeps the
response for ``previous_response_id`` and ``GET /v1/responses/{id}`` while its
session lives.  Refused (:class:`~engine.errors.InvalidRequestError`):
``background``, ``conversation``, ``prompt``, tools other than functions, a
``text.format`` other than text, item types not listed above.  Parameters that do
not change generation (``metadata``, ``user``, ``parallel_tool_calls``,
``truncation``, ``reasoning``, ...) are accepted and ignored.

Output: a ``message`` item (``msg_...``) with one ``output_text`` part when the
completion has text, then one ``function_call`` item (``fc_...``; ``call_id`` the
chat tool call's id) per call; ``status`` ``"incomplete"``
(``incomplete_details.reason = "max_output_tokens"``) when the token budget cut
it, else ``"completed"``; usage in input/output tokens.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from openai.types.chat import ChatCompletion
from openai.types.responses import (Response, ResponseFunctionToolCall, ResponseOutputMessage, ResponseOutputText,
                                    ResponseUsage)
from openai.types.responses.response import IncompleteDetails
from openai.types.responses.response_output_text import Logprob
from openai.types.responses.response_usage import InputTokensDetails, OutputTokensDetails

from ..errors import InvalidRequestError
from .interaction import Interaction

__all__ = ["ResponseNotFoundError", "StoredResponse", "build_response", "chat_tools", "input_messages",
           "LOGPROBS_INCLUDE", "RESPONSE_IGNORED"]

#: The ``include`` value that asks for the output text's logprobs.
LOGPROBS_INCLUDE = "message.output_text.logprobs"

#: ``responses.create`` parameters that do not change what is generated; accepted and ignored.
RESPONSE_IGNORED = frozenset({
    "model", "metadata", "user", "parallel_tool_calls", "truncation", "reasoning", "service_tier",
    "safety_identifier", "prompt_cache_key", "prompt_cache_retention", "prompt_cache_options", "max_tool_calls",
    "stream_options", "context_management", "moderation", "access_programs", "image", "extra_headers",
    "extra_query", "extra_body", "timeout"})

_REFUSED = {"background": "background responses", "conversation": "conversations (send input items instead)",
            "prompt": "prompt templates", "background_options": "background responses"}


class ResponseNotFoundError(KeyError):
    """``previous_response_id`` (or a retrieved id) names no stored response of this client."""


@dataclass(frozen=True)
class StoredResponse:
    """A response kept for ``previous_response_id``: the chat conversation it stands
    for (without its ``instructions``) and its output message."""

    response: Response
    messages: list[dict[str, Any]]
    output_message: dict[str, Any]
    instructions: str | None


def _text_of(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, Sequence):
        parts = []
        for k, part in enumerate(content):
            kind = part.get("type") if isinstance(part, Mapping) else None
            if kind in ("input_text", "output_text", "text", "refusal"):
                parts.append(part.get("text", part.get("refusal", "")) or "")
            else:
                raise InvalidRequestError(f"{where}.content[{k}]: content type {kind!r} is not supported "
                                          "(only input_text and output_text)")
        return "".join(parts)
    raise InvalidRequestError(f"{where}.content must be a string or a list of content parts")


def input_messages(input: Any, *, instructions: Any = None, previous: StoredResponse | None = None
                   ) -> tuple[list[dict[str, Any]], str | None]:
    """The chat messages of a Responses request (the table of the module docstring).

    Returns:
        ``(messages, instructions)``.

    Raises:
        InvalidRequestError: a malformed or unsupported input item (its index named).
    """
    if instructions is not None and not isinstance(instructions, str):
        raise InvalidRequestError("instructions must be a string")
    messages: list[dict[str, Any]] = [{"role": "system", "content": instructions}] if instructions else []
    if previous is not None:
        messages += [*previous.messages, dict(previous.output_message)]
    if isinstance(input, str):
        return [*messages, {"role": "user", "content": input}], instructions
    if isinstance(input, Mapping) or not isinstance(input, Sequence):
        raise InvalidRequestError("input must be a string or a list of input items")
    open_turn = False  # the last message is an assistant turn that a function_call item may join
    for i, item in enumerate(input):
        where = f"input[{i}]"
        if hasattr(item, "model_dump"):
            item = item.model_dump(exclude_none=True, mode="json")
        if not isinstance(item, Mapping):
            raise InvalidRequestError(f"{where} must be an object, got {type(item).__name__}")
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise InvalidRequestError(f"{where}.role must be user, assistant, system or developer, got {role!r}")
            messages.append({"role": "system" if role == "developer" else role,
                             "content": _text_of(item.get("content"), where)})
            open_turn = role == "assistant"
        elif kind == "function_call":
            call = _function_call(item, where)
            if not open_turn:
                messages.append({"role": "assistant", "content": None})
                open_turn = True
            messages[-1].setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            call_id = item.get("call_id")
            if not isinstance(call_id, str) or not call_id:
                raise InvalidRequestError(f"{where}: a function_call_output needs its call_id")
            messages.append({"role": "tool", "tool_call_id": call_id, "content": _text_of(item.get("output"), where)})
            open_turn = False
        elif kind == "reasoning":
            continue
        else:
            raise InvalidRequestError(f"{where}: input items of type {kind!r} are not supported (message, "
                                      "function_call, function_call_output, reasoning)")
    return messages, instructions


def _function_call(item: Mapping[str, Any], where: str) -> dict[str, Any]:
    call_id, name, arguments = item.get("call_id"), item.get("name"), item.get("arguments", "")
    if not isinstance(call_id, str) or not isinstance(name, str) or not isinstance(arguments, str):
        raise InvalidRequestError(f"{where}: a function_call needs call_id, name and arguments (strings)")
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def chat_tools(tools: Any) -> list[dict[str, Any]] | None:
    """Responses function tools as chat tools.

    Raises:
        InvalidRequestError: a tool that is not ``{"type": "function", "name": ...}``.
    """
    if not tools:
        return None
    out = []
    for i, tool in enumerate(tools):
        if hasattr(tool, "model_dump"):
            tool = tool.model_dump(exclude_none=True, mode="json")
        if not isinstance(tool, Mapping) or tool.get("type") != "function" or not isinstance(tool.get("name"), str):
            kind = tool.get("type") if isinstance(tool, Mapping) else type(tool).__name__
            raise InvalidRequestError(f"tools[{i}]: only function tools are supported, got {kind!r}")
        fn = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
        out.append({"type": "function", "function": fn})
    return out


def check_options(params: Mapping[str, Any]) -> bool:
    """Refuse what cannot be served; the ``include`` logprobs flag.

    Raises:
        InvalidRequestError: a refused or unknown parameter, or a non-text ``text.format``.
    """
    for name, what in _REFUSED.items():
        if params.get(name):
            raise InvalidRequestError(f"{name}: {what} are not supported")
    text = params.get("text")
    if text:
        fmt = (text.get("format") or {}) if isinstance(text, Mapping) else None
        if fmt is None or fmt.get("type", "text") != "text":
            raise InvalidRequestError(f"text.format {fmt!r} is not supported (only text)")
    include = params.get("include") or ()
    if isinstance(include, str) or not isinstance(include, Sequence):
        raise InvalidRequestError("include must be a list of strings")
    return LOGPROBS_INCLUDE in include or params.get("top_logprobs") is not None


def build_response(completion: ChatCompletion, interaction: Interaction, *, params: Mapping[str, Any],
                   tools: Any, previous_response_id: str | None, logprobs: bool, new_id: Any) -> Response:
    """The ``Response`` of a chat completion made for a Responses request."""
    choice = completion.choices[0]
    incomplete = choice.finish_reason == "length"
    status: Literal["incomplete", "completed"] = "incomplete" if incomplete else "completed"
    output: list[Any] = []
    content = choice.message.content
    if content:
        lps = None
        if logprobs and choice.logprobs is not None:
            lps = [Logprob(token=t.token, logprob=t.logprob, bytes=t.bytes or [], top_logprobs=[])
                   for t in choice.logprobs.content or ()]
        output.append(ResponseOutputMessage(
            id=new_id("msg_"), type="message", role="assistant", status=status,
            content=[ResponseOutputText(type="output_text", text=content, annotations=[], logprobs=lps)]))
    for call in choice.message.tool_calls or ():
        fn = getattr(call, "function", None)
        if fn is not None:
            output.append(ResponseFunctionToolCall(id=new_id("fc_"), type="function_call", call_id=call.id,
                                                   name=fn.name, arguments=fn.arguments, status="completed"))
    usage = completion.usage
    assert usage is not None  # the client always sets it
    return Response(
        id=completion.id, object="response", created_at=float(completion.created), completed_at=time.time(),
        model=completion.model, status=status, output=output, error=None,
        incomplete_details=IncompleteDetails(reason="max_output_tokens") if incomplete else None,
        instructions=params.get("instructions"), metadata=params.get("metadata"),
        parallel_tool_calls=params.get("parallel_tool_calls", True) is not False,
        temperature=params.get("temperature"), top_p=params.get("top_p"),
        tool_choice=params.get("tool_choice") or "auto", tools=list(tools or ()),
        max_output_tokens=params.get("max_output_tokens"), previous_response_id=previous_response_id,
        usage=ResponseUsage(input_tokens=usage.prompt_tokens, output_tokens=usage.completion_tokens,
                            total_tokens=usage.total_tokens,
                            input_tokens_details=InputTokensDetails(cached_tokens=0, cache_write_tokens=0),
                            output_tokens_details=OutputTokensDetails(reasoning_tokens=0)))

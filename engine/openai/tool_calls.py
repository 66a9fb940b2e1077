"""Tool-call parsers: the model's tool-call syntax -> OpenAI ``tool_calls``.

A parser turns the decoded text of one completion into ``(content, calls)``:
the text left once the calls are taken out (``None`` when nothing but
whitespace is left) and the calls in order.  Only complete, well-formed calls
are taken; anything else stays in ``content`` (a call cut by the token budget,
a block whose JSON does not parse), so nothing the model wrote is lost.

Built in: :class:`JsonInTagsToolCallParser`, the common "JSON in tags" format
of Hermes-style and Qwen (2.5, 3) chat templates::

    <tool_call>
    {"name": "calculator", "arguments": {"expression": "2+3"}}
    </tool_call>

``arguments`` may be an object (written back as a JSON string, as the OpenAI
API carries it) or already a string.  ``"hermes"`` and ``"qwen"`` name it in
:func:`resolve_tool_parser`; any object with a ``parse(text)`` method of the
same contract plugs in.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Protocol

__all__ = ["JsonInTagsToolCallParser", "ParsedToolCall", "TOOL_CALL_PARSERS", "ToolCallParser",
           "resolve_tool_parser"]


@dataclass(frozen=True)
class ParsedToolCall:
    """One call: the function's ``name`` and its ``arguments`` as a JSON string."""

    name: str
    arguments: str


class ToolCallParser(Protocol):
    """``parse(text) -> (content | None, [ParsedToolCall, ...])``."""

    def parse(self, text: str) -> tuple[str | None, list[ParsedToolCall]]: ...


class JsonInTagsToolCallParser:
    """``<tool_call>{"name": ..., "arguments": ...}</tool_call>`` blocks (Hermes/Qwen).

    Args:
        open_tag, close_tag: the tags around one call's JSON.
    """

    def __init__(self, open_tag: str = "<tool_call>", close_tag: str = "</tool_call>") -> None:
        if not open_tag or not close_tag:
            raise ValueError("open_tag and close_tag must be non-empty strings")
        self.open_tag, self.close_tag = open_tag, close_tag
        self._block = re.compile(re.escape(open_tag) + r"(.*?)" + re.escape(close_tag), re.DOTALL)

    def parse(self, text: str) -> tuple[str | None, list[ParsedToolCall]]:
        calls: list[ParsedToolCall] = []
        kept: list[str] = []
        pos = 0
        for match in self._block.finditer(text):
            call = _json_call(match.group(1))
            if call is None:  # not a call: keep the block as text
                continue
            kept.append(text[pos:match.start()])
            pos = match.end()
            calls.append(call)
        kept.append(text[pos:])
        content = "".join(kept).strip() if calls else text
        return (content or None), calls

    def __repr__(self) -> str:
        return f"JsonInTagsToolCallParser({self.open_tag!r}, {self.close_tag!r})"


def _json_call(body: str) -> ParsedToolCall | None:
    try:
        value = json.loads(body.strip())
    except json.JSONDecodeError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        return None
    args = value.get("arguments", value.get("parameters", {}))
    if isinstance(args, str):
        arguments = args
    else:
        try:
            arguments = json.dumps(args, ensure_ascii=False)
        except (TypeError, ValueError):
            return None
    return ParsedToolCall(value["name"], arguments)


#: Built-in parsers by name.
TOOL_CALL_PARSERS: dict[str, type] = {"hermes": JsonInTagsToolCallParser, "qwen": JsonInTagsToolCallParser}


def resolve_tool_parser(spec: Any) -> ToolCallParser | None:
    """A parser from a name of :data:`TOOL_CALL_PARSERS`, an object with
    ``parse(text)``, or ``None`` (no parsing: tool calls stay in ``content``).

    Raises:
        ValueError: an unknown name, or an object without a ``parse`` method.
    """
    if spec is None:
        return None
    if isinstance(spec, str):
        try:
            return TOOL_CALL_PARSERS[spec]()
        except KeyError:
            raise ValueError(f"tool_parser: unknown parser {spec!r}; built-ins are "
                             f"{', '.join(sorted(TOOL_CALL_PARSERS))}") from None
    if not callable(getattr(spec, "parse", None)):
        raise ValueError(f"tool_parser: {type(spec).__name__} has no parse(text) method")
    return spec

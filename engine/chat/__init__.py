"""Chat rendering, token-exact: the ids a workflow or the OpenAI-compatible client sends.

- :mod:`engine.chat._delta`: what to append after a sampled turn as a token delta
  (:func:`message_delta`, :class:`TokenConversation`, :class:`MessageDelta`),
  retokenization-drift events (:func:`collect_drift_events`, :func:`record_drift`), and
  the text helpers (:func:`render_messages`, :func:`encode_text`, :func:`decode_text`,
  :func:`assistant_message`);
- :mod:`engine.chat._splice`: a chat template rendered once per chat structure, contents
  spliced in (:func:`render_chat`);
- :mod:`engine.chat._encode`: a rendered prompt encoded piece by piece between special
  tokens, repeated pieces cached (:func:`encode_prompt`).

May import: the standard library and :mod:`engine.errors` (tokenizers are passed in);
not torch, trio, the executor, the backends or the application.  Names resolve on first
access."""

from __future__ import annotations

from typing import TYPE_CHECKING

__all__ = [
    "MessageDelta",
    "TokenConversation",
    "assistant_message",
    "check_messages",
    "collect_drift_events",
    "decode_text",
    "encode_prompt",
    "encode_text",
    "message_delta",
    "record_drift",
    "render_chat",
    "render_messages",
]

_LAZY = {
    "MessageDelta": "engine.chat._delta",
    "TokenConversation": "engine.chat._delta",
    "assistant_message": "engine.chat._delta",
    "check_messages": "engine.chat._delta",
    "collect_drift_events": "engine.chat._delta",
    "decode_text": "engine.chat._delta",
    "encode_prompt": "engine.chat._encode",
    "encode_text": "engine.chat._delta",
    "message_delta": "engine.chat._delta",
    "record_drift": "engine.chat._delta",
    "render_chat": "engine.chat._splice",
    "render_messages": "engine.chat._delta",
}

if TYPE_CHECKING:
    from ._delta import (
        MessageDelta,
        TokenConversation,
        assistant_message,
        check_messages,
        collect_drift_events,
        decode_text,
        encode_text,
        message_delta,
        record_drift,
        render_messages,
    )
    from ._encode import encode_prompt
    from ._splice import render_chat

from engine.lazy import lazy_exports  # noqa: E402

__getattr__, __dir__ = lazy_exports(globals(), _LAZY)

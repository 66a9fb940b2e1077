"""Token-exact chat: append new messages to a conversation as a token delta.

Re-rendering a conversation with the chat template and tokenizing it again does
not give back the ids the model was sent and sampled: BPE may merge across the
boundary between turns, a cut turn gains an end-of-turn token, special tokens
disappear from decoded content, and some templates rewrite earlier turns (Qwen3
strips the reasoning of earlier assistant turns).  A workflow that re-tokenizes
the history then trains on tokens the model never produced.  Here the ids sent
so far are never touched; only the new messages are tokenized:

1. render the conversation *with* the new messages (and the generation prompt)
   as text, and decode the ids sent so far (prompt + sampled turns + injected
   deltas) as text;
2. when the rendering starts with the sent text, the delta is the rest of the
   rendering, tokenized alone.  It holds exactly what the template puts after
   the last sampled token: the end-of-turn token when the turn was cut by the
   budget (the template needs it; the model did not sample it), the glue
   between turns, the new messages and the generation prompt;
3. otherwise the template renders the history differently from what was sent:
   a *retokenization drift* event.  It is never silent: the returned
   :class:`MessageDelta` says so (``drift``, ``detail``), the event is logged and
   recorded in every active :func:`collect_drift_events` block (the rollout
   engine opens one per episode and counts them in ``statistics()``), and
   :class:`workflows.multi_turn.MultiTurnWorkflow` flags the trajectory.  The
   ids stay exact (what the model saw); the delta is then what the template
   puts after an assistant turn's content, taken from a probe conversation.

:func:`message_delta` is the reusable piece (an OpenAI-compatible client that
receives whole message lists can call it with the parent interaction's ids and
messages); :class:`TokenConversation` keeps ids and messages together for a
workflow.

Text comparison uses ``decode(ids, skip_special_tokens=False)``: a tokenizer
whose decode does not reproduce the template's text (some SentencePiece
tokenizers drop or add a leading space) reports drift although its ids are
exact; the report is then conservative, never wrong in the other direction.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .._collated import check_messages
from ..errors import WorkflowError

__all__ = [
    "MessageDelta",
    "TokenConversation",
    "assistant_message",
    "check_messages",
    "collect_drift_events",
    "decode_text",
    "encode_text",
    "message_delta",
    "record_drift",
    "render_messages",
]

logger = logging.getLogger(f"rollout.{__name__}")  # the package's one logging namespace

Message = Mapping[str, Any]

#: The event lists of the active ``collect_drift_events`` blocks, outermost first.
_DRIFT_EVENTS: contextvars.ContextVar[tuple[list[str], ...]] = contextvars.ContextVar("drift_events", default=())
_warned = False

_PROBE_USER = "probe question"
_PROBE_ANSWER = "probe answer 7f3a9c"
_CONTEXT = 40  # characters shown on each side of a mismatch


def render_messages(tokenizer: Any, messages: Sequence[Message], *, add_generation_prompt: bool,
                    chat_template_kwargs: Mapping[str, Any] | None = None) -> str:
    """``messages`` rendered with the tokenizer's chat template, as text.

    Raises:
        DatasetError: a message's role or content is not a string (a default-collated
            batch; :func:`engine._collated.check_messages`).
        WorkflowError: the template raised (e.g. it rejects the message order).
    """
    check_messages(messages, "render_messages")
    try:
        return tokenizer.apply_chat_template(list(messages), tokenize=False,
                                             add_generation_prompt=add_generation_prompt,
                                             **dict(chat_template_kwargs or {}))
    except Exception as exc:
        raise WorkflowError(f"the chat template failed on {len(messages)} messages: {type(exc).__name__}: {exc}") from exc


def encode_text(tokenizer: Any, text: str) -> list[int]:
    """Token ids of ``text`` with no special tokens added (special tokens written
    in the text, such as ``<|im_start|>``, are recognised): what
    ``apply_chat_template(tokenize=True)`` does to a rendered template."""
    return list(tokenizer.encode(text, add_special_tokens=False))


def decode_text(tokenizer: Any, ids: Sequence[int]) -> str:
    """``ids`` as text, special tokens kept and no clean-up of spaces."""
    return tokenizer.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)


def assistant_message(tokenizer: Any, output_ids: Sequence[int], *, stopped: bool = True,
                      stop_token_ids: Sequence[int] = ()) -> dict[str, str]:
    """The assistant message that stands for a sampled turn in the history:
    ``{"role": "assistant", "content": text}``.

    ``text`` decodes ``output_ids`` keeping special tokens (so that the
    rendering can reproduce the sampled ids), minus the final token when the
    turn ``stopped`` on it (a token of ``stop_token_ids`` or a special token):
    the template writes its own end-of-turn token after the content.
    """
    ids = list(output_ids)
    if stopped and ids and (ids[-1] in stop_token_ids or ids[-1] in set(getattr(tokenizer, "all_special_ids", ()))):
        ids = ids[:-1]
    return {"role": "assistant", "content": decode_text(tokenizer, ids)}


@dataclass(frozen=True)
class MessageDelta:
    """What to append after the ids sent so far.

    Attributes:
        ids: token ids to append (all injected: ``loss_mask`` 0): the end-of-turn
            token of a cut turn when the template needs one, the glue between
            turns, the new messages, the generation prompt.
        added_end_of_turn: the last sent token was not a special token (the
            turn was cut by the budget) and ``ids`` starts with the template's
            end-of-turn token.
        drift: the template renders the history differently from the ids sent
            (a retokenization drift event).
        detail: where the rendering and the sent text part, when ``drift``.
    """

    ids: list[int]
    added_end_of_turn: bool = False
    drift: bool = False
    detail: str | None = None


@contextlib.contextmanager
def collect_drift_events() -> Iterator[list[str]]:
    """Collect the drift events (their ``detail`` strings) of
    :func:`message_delta` calls made in this block, including in child tasks
    started inside it.  Blocks nest; an event is recorded in every enclosing block."""
    events: list[str] = []
    token = _DRIFT_EVENTS.set((*_DRIFT_EVENTS.get(), events))
    try:
        yield events
    finally:
        _DRIFT_EVENTS.reset(token)


def open_drift_sink(events: list[str]) -> tuple[list[str], ...]:
    """:func:`collect_drift_events` without the context manager: from here on, drift
    events are also appended to ``events``; returns what to give
    :func:`close_drift_sink` to undo it (the engine's per-episode path, where a
    context manager's objects would live for the whole episode)."""
    outer = _DRIFT_EVENTS.get()
    _DRIFT_EVENTS.set((*outer, events))
    return outer


def close_drift_sink(outer: tuple[list[str], ...]) -> None:
    """Undo the :func:`open_drift_sink` that returned ``outer``."""
    _DRIFT_EVENTS.set(outer)


def record_drift(detail: str) -> None:
    """Record a retokenization drift event found outside :func:`message_delta`
    (e.g. an OpenAI-compatible client asked to continue a conversation whose
    assistant turns match no completion it made, so the history must be
    tokenized again), or found in another task and reported again inside an
    episode: appended to every active :func:`collect_drift_events` block and
    logged like the events of :func:`message_delta`."""
    _record_drift(detail)


def _record_drift(detail: str) -> None:
    global _warned
    for sink in _DRIFT_EVENTS.get():
        sink.append(detail)
    if not _warned:  # once per process at warning level: a template that drifts does so on every turn
        _warned = True
        logger.warning("retokenization drift (the chat template renders the history differently from the "
                       "token ids sent; the ids are kept, the event is counted): %s", detail)
    else:
        logger.debug("retokenization drift: %s", detail)


def _mismatch(sent: str, rendered: str) -> str:
    k = 0
    limit = min(len(sent), len(rendered))
    while k < limit and sent[k] == rendered[k]:
        k += 1
    lo = max(0, k - _CONTEXT)
    return (f"at character {k} of {len(sent)} sent: sent ...{sent[lo:k + _CONTEXT]!r}, "
            f"rendered ...{rendered[lo:k + _CONTEXT]!r}")


def _probe_tail(tokenizer: Any, new_messages: Sequence[Message], kwargs: Mapping[str, Any] | None) -> str:
    """What the template puts after an assistant turn's content when
    ``new_messages`` follow it (end-of-turn, glue, new messages, generation
    prompt), read off probe conversations that do not depend on the history.

    First a probe ``[user, assistant] + new_messages``; when the template
    rewrites that assistant turn too, the end of a (last, unrewritten) assistant
    turn from ``[user, assistant]`` followed by what ``new_messages`` add after a
    user turn."""
    user = {"role": "user", "content": _PROBE_USER}
    probe = [user, {"role": "assistant", "content": _PROBE_ANSWER}]
    text = render_messages(tokenizer, [*probe, *new_messages], add_generation_prompt=True, chat_template_kwargs=kwargs)
    at = text.rfind(_PROBE_ANSWER)
    if at >= 0:
        return text[at + len(_PROBE_ANSWER):]
    closed = render_messages(tokenizer, probe, add_generation_prompt=False, chat_template_kwargs=kwargs)
    alone = render_messages(tokenizer, [user], add_generation_prompt=False, chat_template_kwargs=kwargs)
    extended = render_messages(tokenizer, [user, *new_messages], add_generation_prompt=True,
                               chat_template_kwargs=kwargs)
    at = closed.rfind(_PROBE_ANSWER)
    if at < 0 or not extended.startswith(alone):
        raise WorkflowError("cannot compute the token delta of the new messages: the chat template does not "
                            "render an assistant message's content verbatim, nor append messages to a user turn")
    return closed[at + len(_PROBE_ANSWER):] + extended[len(alone):]


def message_delta(tokenizer: Any, sent_ids: Sequence[int], messages: Sequence[Message],
                  new_messages: Sequence[Message], *,
                  chat_template_kwargs: Mapping[str, Any] | None = None) -> MessageDelta:
    """The token ids that append ``new_messages`` to a conversation, token-exact.

    Args:
        tokenizer: a transformers tokenizer with a chat template.
        sent_ids: every id of the conversation so far, exactly as the model saw
            and produced them (the last request's ``input_ids`` + its
            ``output_tokens``); never re-tokenized.
        messages: the conversation that ``sent_ids`` stands for, its last
            message normally the assistant turn just sampled (see
            :func:`assistant_message`).
        new_messages: the messages to append (a feedback or tool message...).
        chat_template_kwargs: passed to ``apply_chat_template`` (e.g.
            ``enable_thinking``).

    Returns:
        A :class:`MessageDelta`; ``sent_ids + delta.ids`` is the next request.
        On drift the event is also recorded (see the module docstring).

    Raises:
        WorkflowError: the chat template fails, or (on drift) it does not render
            an assistant message's content verbatim, so no delta can be found.
    """
    sent_text = decode_text(tokenizer, sent_ids)
    rendered = render_messages(tokenizer, [*messages, *new_messages], add_generation_prompt=True,
                               chat_template_kwargs=chat_template_kwargs)
    special = set(getattr(tokenizer, "all_special_ids", ()))
    cut = bool(sent_ids) and sent_ids[-1] not in special
    if rendered.startswith(sent_text):
        ids = encode_text(tokenizer, rendered[len(sent_text):])
        return MessageDelta(ids, added_end_of_turn=cut and bool(ids) and ids[0] in special)
    detail = _mismatch(sent_text, rendered)
    _record_drift(detail)
    tail = _probe_tail(tokenizer, new_messages, chat_template_kwargs)
    ids = encode_text(tokenizer, tail)
    ends_turn = bool(ids) and ids[0] in special  # the template's end-of-turn token
    if ends_turn and not cut:  # the model's own stop token stands for it
        ids = ids[1:]
    return MessageDelta(ids, added_end_of_turn=cut and ends_turn, drift=True, detail=detail)


class TokenConversation:
    """A conversation kept both as messages and as the exact ids the model saw.

    ::

        conv = TokenConversation(tokenizer, data["messages"])
        resp = await engine.agenerate(ModelRequest(input_ids=conv.ids, ...))
        conv.add_response(resp)                       # ids += sampled tokens
        delta = conv.append([{"role": "user", "content": "try again"}])
        # conv.ids == resp.input_tokens + resp.output_tokens + delta.ids

    Args:
        tokenizer: a transformers tokenizer with a chat template.
        messages: the opening chat; rendered with the generation prompt and
            tokenized once (the first request's ids).
        chat_template_kwargs: passed to every ``apply_chat_template`` call.
        stop_token_ids: the token a turn stopped on is left out of its
            assistant message's content when it is one of these or a special
            token (:func:`assistant_message`).

    Attributes:
        ids: the token ids so far (prompt, sampled turns, deltas); read-only use.
        messages: the messages so far.
        drift_events: drift events of this conversation.
    """

    def __init__(self, tokenizer: Any, messages: Sequence[Message], *,
                 chat_template_kwargs: Mapping[str, Any] | None = None, stop_token_ids: Sequence[int] = ()) -> None:
        self.tokenizer = tokenizer
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        self.stop_token_ids = tuple(stop_token_ids)
        self.messages: list[Message] = list(messages)
        text = render_messages(tokenizer, self.messages, add_generation_prompt=True,
                               chat_template_kwargs=self.chat_template_kwargs)
        self.ids: list[int] = encode_text(tokenizer, text)
        self.drift_events = 0

    def add_response(self, response: Any) -> None:
        """Append a sampled turn: its ``output_tokens`` and the assistant
        message that stands for it.

        Raises:
            ValueError: ``response.input_tokens`` is not the conversation's ids
                (the turn was not generated from this conversation).
        """
        if list(response.input_tokens) != self.ids:
            raise ValueError("add_response: the response's input_tokens are not this conversation's ids")
        self.ids = self.ids + list(response.output_tokens)
        self.messages.append(assistant_message(self.tokenizer, response.output_tokens,
                                               stopped=response.stop_reason == "stop",
                                               stop_token_ids=self.stop_token_ids))

    def append(self, new_messages: Sequence[Message]) -> MessageDelta:
        """Append ``new_messages`` as a token delta (:func:`message_delta`)."""
        delta = message_delta(self.tokenizer, self.ids, self.messages, new_messages,
                              chat_template_kwargs=self.chat_template_kwargs)
        self.ids = self.ids + delta.ids
        self.messages.extend(new_messages)
        self.drift_events += delta.drift
        return delta

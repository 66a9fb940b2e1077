"""A finished ``Response`` as the server events an OpenAI server streams
(``responses.create(stream=True)``), built from the ``openai`` package's own event types.

In order, ``sequence_number`` counting from 0: ``response.created`` and
``response.in_progress`` (the response with ``status="in_progress"`` and no
output), then per output item: ``response.output_item.added``; for a message
``response.content_part.added``, ``response.output_text.delta`` (the whole text,
with its logprobs when asked), ``response.output_text.done``,
``response.content_part.done``; for a function call
``response.function_call_arguments.delta`` and ``.done``; then
``response.output_item.done``; last ``response.completed`` (or
``response.incomplete``) with the whole response.
"""

from __future__ import annotations

from typing import Any

from openai.types.responses import (Response, ResponseCompletedEvent, ResponseContentPartAddedEvent,
                                    ResponseContentPartDoneEvent, ResponseCreatedEvent,
                                    ResponseFunctionCallArgumentsDeltaEvent, ResponseFunctionCallArgumentsDoneEvent,
                                    ResponseFunctionToolCall, ResponseIncompleteEvent, ResponseInProgressEvent,
                                    ResponseOutputItemAddedEvent, ResponseOutputItemDoneEvent, ResponseOutputMessage,
                                    ResponseTextDeltaEvent, ResponseTextDoneEvent)

__all__ = ["response_events"]


def response_events(response: Response) -> list[Any]:
    """The events of ``response`` (see the module docstring)."""
    events: list[Any] = []

    def add(cls: Any, **fields: Any) -> None:
        events.append(cls(sequence_number=len(events), **fields))

    pending = response.model_copy(update={"status": "in_progress", "output": [], "usage": None,
                                          "incomplete_details": None, "completed_at": None})
    add(ResponseCreatedEvent, type="response.created", response=pending)
    add(ResponseInProgressEvent, type="response.in_progress", response=pending)
    for index, item in enumerate(response.output):
        if isinstance(item, ResponseOutputMessage):
            add(ResponseOutputItemAddedEvent, type="response.output_item.added", output_index=index,
                item=item.model_copy(update={"status": "in_progress", "content": []}))
            for k, part in enumerate(item.content):
                text = getattr(part, "text", "")
                logprobs = [lp.model_dump() for lp in getattr(part, "logprobs", None) or ()]
                ids = {"item_id": item.id, "output_index": index, "content_index": k}
                add(ResponseContentPartAddedEvent, type="response.content_part.added", **ids,
                    part=part.model_copy(update={"text": "", "logprobs": [] if logprobs else None}))
                add(ResponseTextDeltaEvent, type="response.output_text.delta", **ids, delta=text, logprobs=logprobs)
                add(ResponseTextDoneEvent, type="response.output_text.done", **ids, text=text, logprobs=logprobs)
                add(ResponseContentPartDoneEvent, type="response.content_part.done", **ids, part=part)
        elif isinstance(item, ResponseFunctionToolCall):
            add(ResponseOutputItemAddedEvent, type="response.output_item.added", output_index=index,
                item=item.model_copy(update={"status": "in_progress", "arguments": ""}))
            ids = {"item_id": item.id or "", "output_index": index}
            add(ResponseFunctionCallArgumentsDeltaEvent, type="response.function_call_arguments.delta", **ids,
                delta=item.arguments)
            add(ResponseFunctionCallArgumentsDoneEvent, type="response.function_call_arguments.done", **ids,
                arguments=item.arguments)
        add(ResponseOutputItemDoneEvent, type="response.output_item.done", output_index=index, item=item)
    if response.status == "incomplete":
        add(ResponseIncompleteEvent, type="response.incomplete", response=response)
    else:
        add(ResponseCompletedEvent, type="response.completed", response=response)
    return events

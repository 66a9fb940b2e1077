"""Refuse a default-collated batch where one dataset item, or one chat message, is expected.

torch's ``DataLoader`` with its default ``collate_fn`` turns a batch of rows into one
dict of columns::

    {"messages": [{"role": ["user", "user"], "content": [q0, q1]}],
     "answer": ["#### 3", "#### 5"], "id": tensor([0, 1])}

Handed on as one item it reached the chat template as a role that is a list (RLVR
trained on ``<|im_start|>['user', 'user']``).  ``submit`` (so ``rollout_batch`` and
``prepare_batch``, which submit through it), :class:`~engine.datastream.DataStream`
and the chat renderers (:func:`engine.chat.render_messages`,
:func:`engine.chat.render_chat`) check with :func:`check_item` /
:func:`check_messages` and raise one :class:`~engine.errors.DatasetError` naming the
field and the fix.

What is refused (each check is O(fields + messages) type tests; torch is never imported):

* a message (a dict in ``messages``) whose ``role`` is not a ``str``, or whose
  ``content`` is not a ``str``, ``None`` or a list of content-part dicts;
* a dict with no scalar field, each value a list/tuple or an array/tensor with a
  batch dimension (``ndim >= 1``), all of one length, at least one a list of
  strings (a collated string column), none a list of dicts (a row's messages or
  tool specs; collated messages are caught by the first rule); nested dicts are
  not looked into;
* a list or tuple of rows (dicts with ``messages``) given as one item (``list(loader)``
  of a loader with ``collate_fn=lambda rows: rows``, handed to ``rollout_batch``).

A row is never refused for holding lists or tensors next to a scalar field (a
question, an id), nor for a pre-tokenized row of tensors only.
"""

from __future__ import annotations

from typing import Any

from .errors import DatasetError

__all__ = ["ITEMS_FIX", "ROWS_FIX", "check_item", "check_messages"]

#: the fix for a batch that reached ``submit`` / ``rollout_batch`` as one item
ITEMS_FIX = ("a torch DataLoader with the default collate makes one dict of a batch of rows: build it with "
             "collate_fn=lambda rows: rows and call rollout_batch(batch) (or submit each row) per batch, "
             "or pass prepare_batch such a DataLoader itself")
#: the fix for a batch met by ``prepare_batch``'s stream (it takes the loader's batches apart itself)
ROWS_FIX = ("a torch DataLoader with the default collate makes one dict of a batch of rows: build it with "
            "collate_fn=lambda rows: rows (batches as lists of rows) or batch_size=None (one row at a time)")
#: the fix for a chat message that is not one message
MESSAGES_FIX = ("each message is {'role': str, 'content': str | list of content-part dicts | None}; a list here "
                "is usually a torch DataLoader's default collate: build it with collate_fn=lambda rows: rows")


def _describe(value: Any) -> str:
    shape = getattr(value, "shape", None)
    if shape is not None:
        return f"a {type(value).__name__} of shape {tuple(shape)}"
    text = repr(value)
    return f"a {type(value).__name__} of {len(value)} ({text if len(text) <= 60 else text[:57] + '...'})"


def _messages_problem(messages: Any, field: str) -> tuple[str, bool] | None:
    """``(what is wrong, whether it is a collated batch)``, or None."""
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            continue  # a message object (pydantic, ...): the template judges it
        role = message.get("role")
        if type(role) is not str:
            if isinstance(role, (list, tuple)) or hasattr(role, "shape"):
                return f"{field}[{i}]['role'] is {_describe(role)}, not a str", True
            return f"{field}[{i}]['role'] must be a str, got {type(role).__name__} ({role!r})", False
        content = message.get("content")
        if type(content) is str or content is None:
            continue
        if isinstance(content, (list, tuple)):
            if all(isinstance(part, dict) for part in content):
                continue  # content parts: [{"type": "text", "text": ...}, {"type": "image"}]
            return f"{field}[{i}]['content'] is {_describe(content)}, not a str or a list of content-part dicts", True
        if hasattr(content, "shape"):
            return f"{field}[{i}]['content'] is {_describe(content)}, not a str", True
        return (f"{field}[{i}]['content'] must be a str, a list of content-part dicts or None, "
                f"got {type(content).__name__}", False)
    return None


def _columns_problem(item: dict[str, Any]) -> str | None:
    """Why ``item`` is a batch of columns (no scalar field), or None."""
    length, strings = -1, None
    for name, value in item.items():
        kind = type(value)
        if kind is str or kind is int or kind is float or kind is bool or value is None:
            return None  # a scalar: one row (the common case, answered at the first such field)
        if kind is list or kind is tuple:
            if value and isinstance(value[0], dict):
                return None  # a list of records (messages, tool specs): a row's structure, not a column
            n = len(value)
            if strings is None and n and all(type(v) is str for v in value):
                strings = name
        elif isinstance(value, dict):
            continue
        elif getattr(value, "ndim", 0):  # an array/tensor with a batch dimension
            n = len(value)
        else:
            return None  # a scalar (str, number, 0-d tensor, None): one row
        if length < 0:
            length = n
        elif n != length:
            return None
    if strings is None:
        return None
    return f"no field is a single value and {strings!r} is a list of {length} strings"


def _problem(item: Any) -> tuple[str, bool] | None:
    """``(what is wrong, whether it is a batch)``, or None."""
    if isinstance(item, dict):
        messages = item.get("messages")
        if type(messages) is list or type(messages) is tuple:
            for message in messages:  # the common case first: plain text messages
                if (type(message) is not dict or type(message.get("role")) is not str
                        or type(message.get("content")) is not str):
                    problem = _messages_problem(messages, "messages")
                    if problem is not None:
                        return problem
                    break
        columns = _columns_problem(item)
        return None if columns is None else (columns, True)
    if (type(item) is list or type(item) is tuple) and item and isinstance(item[0], dict) and "messages" in item[0]:
        return f"is a {type(item).__name__} of {len(item)} rows", True
    return None


def check_item(item: Any, where: str, fix: str, *where_args: object) -> None:
    """Refuse a batch where one dataset item is expected (see the module docstring).

    Args:
        item: the dataset item (any object; only dicts, lists and tuples are looked at).
        where: names the item in the message (``"submit: data"``, ``"rollout_batch: items[%d]"``),
            %-formatted with ``where_args`` only when the item is refused (the check is on the
            per-episode path).
        fix: the fix to state (:data:`ITEMS_FIX`, :data:`ROWS_FIX`).

    Raises:
        DatasetError: ``item`` is a collated batch or a list of rows, or a message
            of its ``messages`` has a role or content that is not a string.
    """
    found = _problem(item)
    if found is not None:
        problem, batch = found
        where = where % where_args if where_args else where
        sep = " " if problem.startswith("is ") else ": "
        if batch:
            raise DatasetError(f"{where}{sep}{problem}, so it is a batch, not one dataset item; {fix}")
        raise DatasetError(f"{where}: {problem}; {MESSAGES_FIX}")


def check_messages(messages: Any, where: str) -> None:
    """Refuse chat messages whose role or content is not a string (a default-collated batch).

    Args:
        messages: the chat (a list or tuple of message dicts; anything else is left to the template).
        where: names the caller in the message (``"render_messages"``).

    Raises:
        DatasetError: a message's ``role`` is not a ``str``, or its ``content`` is
            not a ``str``, ``None`` or a list of content-part dicts.
    """
    if type(messages) is list or type(messages) is tuple:
        found = _messages_problem(messages, "messages")
        if found is not None:
            raise DatasetError(f"{where}: {found[0]}; {MESSAGES_FIX}")

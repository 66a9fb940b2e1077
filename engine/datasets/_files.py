"""Datasets for ``rollout run``: GSM8K-style jsonl files, a built-in arithmetic set and a
built-in image set (``builtin:shapes``, :mod:`engine.datasets._shapes`).

A row is ``{"question": str, "answer": str}`` where ``answer`` ends with
``#### <number>`` (GSM8K format, openai/grade-school-math).  :func:`load_dataset`
turns each row into a workflow item: the row's keys plus ``"messages"`` (a
one-turn chat asking the question), which :class:`workflows.rlvr.RLVRWorkflow`
renders with the chat template; ``answer`` reaches the reward function as a
keyword argument.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..errors import DatasetError

__all__ = ["BUILTIN_ARITH", "BUILTIN_SHAPES", "PROMPT_SUFFIX", "builtin_arith", "load_dataset", "to_item"]

BUILTIN_ARITH = "builtin:arith"
BUILTIN_SHAPES = "builtin:shapes"
_BUILTINS = "'builtin:arith[:N]' or 'builtin:shapes[:N]'"
PROMPT_SUFFIX = "\nAnswer with the final number after '####'."

_TEMPLATES = (  # (question, operator); a > b >= 2, and b divides a for "/"
    ("{name} has {a} apples and buys {b} more. How many apples does {name} have now?", "+"),
    ("A box holds {a} pencils. {name} takes {b} of them out. How many pencils are left in the box?", "-"),
    ("{name} has {b} bags with {a} marbles in each bag. How many marbles does {name} have in total?", "*"),
    ("{name} shares {a} cookies equally among {b} friends. How many cookies does each friend get?", "/"),
)
_OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b, "/": lambda a, b: a // b}
_NAMES = ("Ava", "Ben", "Chloe", "Dan", "Emma", "Finn", "Grace", "Hugo")


def builtin_arith(n: int = 16, seed: int = 0) -> list[dict[str, str]]:
    """``n`` small arithmetic word problems in GSM8K format (deterministic for ``seed``)."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        template, op = _TEMPLATES[i % len(_TEMPLATES)]
        b = rng.randint(2, 9)
        a = b * rng.randint(2, 9) if op == "/" else rng.randint(b + 1, 30)
        question = template.format(name=rng.choice(_NAMES), a=a, b=b)
        rows.append({"question": question, "answer": f"#### {_OPS[op](a, b)}"})
    return rows


def to_item(row: dict[str, Any]) -> dict[str, Any]:
    """A dataset row plus ``messages`` (the user turn: question + answer-format hint)."""
    return {**row, "messages": [{"role": "user", "content": row["question"] + PROMPT_SUFFIX}]}


def _builtin_size(spec: str, name: str) -> int:
    rest = spec[len(name):]
    try:
        n = int(rest[1:]) if rest.startswith(":") else 16
        if rest and not rest.startswith(":"):
            raise ValueError
    except ValueError:
        raise DatasetError(f"dataset {spec!r}: expected {name!r} or '{name}:N'") from None
    return n


def load_dataset(spec: str, limit: int | None = None, *, required: Sequence[str] = ()) -> list[dict[str, Any]]:
    """Load ``spec`` (``"builtin:arith[:N]"``, ``"builtin:shapes[:N]"`` or a jsonl path)
    as workflow items, at most ``limit`` of them.

    ``builtin:shapes`` items are image rows for :class:`workflows.vision_rlvr.VisionRLVRWorkflow`
    (``images``, ``messages`` with an image part, ``question``, integer ``answer``; see
    :func:`engine.datasets.builtin_shapes`); the others are text rows (:func:`to_item`).

    Args:
        required: fields every row must have besides ``question`` (the reward's
            data keys: ``("answer",)`` for the GSM8K reward).

    Raises:
        DatasetError: unknown built-in name or size, the file is missing or empty, a
            line is not UTF-8 or not a JSON object, a row lacks a string ``question``
            or has an empty one, or lacks a ``required`` field (names the file and
            line number).
    """
    is_arith, is_shapes = spec.startswith(BUILTIN_ARITH), spec.startswith(BUILTIN_SHAPES)
    if spec.startswith("builtin:") and not (is_arith or is_shapes):
        raise DatasetError(f"unknown built-in dataset {spec!r}; the built-in ones are {_BUILTINS}")
    if is_shapes:
        from ._shapes import builtin_shapes

        n = _builtin_size(spec, BUILTIN_SHAPES)
        items = builtin_shapes(n if limit is None else min(n, limit))
        if not items:
            raise DatasetError(f"dataset {spec!r} has no rows")
        return items
    if is_arith:
        rows = builtin_arith(_builtin_size(spec, BUILTIN_ARITH))
    else:
        rows = _read_jsonl(Path(spec), limit, tuple(required))
    if limit is not None:
        rows = rows[:limit]
    if not rows:
        raise DatasetError(f"dataset {spec!r} has no rows")
    return [to_item(r) for r in rows]


def _read_jsonl(path: Path, limit: int | None, required: tuple[str, ...] = ()) -> list[dict[str, Any]]:
    if not path.is_file():
        raise DatasetError(f"dataset file not found: {path}")
    rows: list[dict[str, Any]] = []
    with path.open("rb") as f:  # bytes: a line that is not UTF-8 is reported with its number
        for lineno, raw in enumerate(f, 1):
            if limit is not None and len(rows) >= limit:
                break
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise DatasetError(f"{path}:{lineno}: not valid UTF-8 ({exc.reason} at byte {exc.start} "
                                   "of the line)") from None
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DatasetError(f"{path}:{lineno}: not valid JSON ({exc.msg} at column {exc.colno})") from None
            if not isinstance(row, dict):
                raise DatasetError(f"{path}:{lineno}: expected a JSON object, got {type(row).__name__}")
            if not isinstance(row.get("question"), str):
                raise DatasetError(f"{path}:{lineno}: row has no string field 'question'")
            if not row["question"].strip():
                raise DatasetError(f"{path}:{lineno}: field 'question' is empty")
            for name in required:
                if name not in row:
                    raise DatasetError(f"{path}:{lineno}: row has no field {name!r} (the reward needs it)")
            if "answer" in row and not isinstance(row["answer"], (str, int, float)):
                raise DatasetError(f"{path}:{lineno}: field 'answer' must be a string or number")
            rows.append(row)
    return rows

"""A user's dataset for ``rollout run``, loaded with Hugging Face ``datasets``.

:func:`load_items` turns a dataset into workflow items (dicts with ``messages``,
a one-turn or multi-turn chat, plus the row's columns, which reach the reward
function as keyword arguments).  Sources (``DataSpec.source``):

* ``builtin:arith[:N]`` (GSM8K-style word problems, offline) and
  ``builtin:shapes[:N]`` (images, :mod:`engine.datasets._shapes`);
* a local file: ``.jsonl``/``.json`` (JSON lines or a JSON array), ``.parquet``,
  ``.csv``, ``.arrow``;
* a folder written by ``Dataset.save_to_disk`` / ``DatasetDict.save_to_disk``,
  or a folder of data files;
* anything else is a hub id (``openai/gsm8k`` with ``subset="main"``), loaded
  only when the machine can reach the hub.

Column mapping (``None`` = detect):

* ``messages_key``: a column holding the chat (a list of ``{"role", "content"}``);
  detected as ``messages`` when no prompt column or template is named.
* ``prompt_key``: the column holding the prompt text; detected as the first of
  :data:`PROMPT_KEYS` present.  The user turn is the text plus ``prompt_suffix``
  (the reward's answer-format hint, e.g. ``"... after '####'"`` for GSM8K).
* ``prompt_template``: the user turn is this text with every ``{column}``
  replaced by the row's value (``{{`` and ``}}`` are literal braces; other braces,
  as in ``\\boxed{}`` or ``\\frac{1}{2}``, are kept as written).  No suffix is added.
* ``answer_key``: the column whose value becomes the item's ``answer`` (the
  keyword the built-in rewards read); detected as the first of :data:`ANSWER_KEYS`.
* ``system_prompt``: a system turn put first, unless the chat has one.

Order: rows are shuffled (``shuffle``, with a ``random.Random(seed)`` of its own),
the first ``limit`` kept, then repeated ``epochs`` times (each later epoch in a new
order when shuffling).  A row that cannot be used (empty prompt, missing answer,
malformed chat) is an error naming its row index (0-based, in the loaded split)
and the reason, or, with ``skip_bad_rows``, one warning line per row.

Errors: :class:`~engine.errors.DatasetError`, one line naming the source and the
field (a missing file, a file ``datasets`` cannot read, an unknown split, no
prompt column, a template placeholder that is not a column, ...).
"""

from __future__ import annotations

import logging
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import DatasetError

__all__ = ["ANSWER_KEYS", "DataSpec", "LoadedData", "PROMPT_KEYS", "load_items", "render_template"]

logger = logging.getLogger(f"rollout.{__name__}")

#: Prompt columns tried in order when ``prompt_key`` is not given.
PROMPT_KEYS = ("question", "prompt", "problem", "input", "instruction", "query")
#: Answer columns tried in order when ``answer_key`` is not given.
ANSWER_KEYS = ("answer", "solution", "ground_truth", "reference", "target")
_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".pq": "parquet", ".csv": "csv",
            ".arrow": "arrow"}
_PLACEHOLDER = re.compile(r"\{\{|\}\}|\{([A-Za-z_][A-Za-z0-9_]*)\}")


@dataclass(frozen=True, kw_only=True)
class DataSpec:
    """What to load and how to map its columns (see the module docstring).

    Attributes:
        source: ``builtin:...``, a file, a folder or a hub id.
        split: the split to use (``None``: ``train``, or the only split there is).
        subset: a hub dataset's configuration name (``main`` for ``openai/gsm8k``).
        limit: rows per epoch (the first ``limit`` after shuffling); ``None`` = all.
        shuffle, seed: shuffle rows with ``random.Random(seed)``.
        epochs: times every row is used (>= 1).
        prompt_key, answer_key, messages_key, system_prompt, prompt_template: the mapping.
        prompt_suffix: appended to a prompt taken from ``prompt_key``.
        required: data keys every item must carry with a value (the reward's, e.g. ``("answer",)``).
        skip_bad_rows: skip unusable rows (one warning each) instead of refusing the dataset.
    """

    source: str
    split: str | None = None
    subset: str | None = None
    limit: int | None = None
    shuffle: bool = False
    seed: int = 0
    epochs: int = 1
    prompt_key: str | None = None
    answer_key: str | None = None
    messages_key: str | None = None
    system_prompt: str | None = None
    prompt_template: str | None = None
    prompt_suffix: str = ""
    required: tuple[str, ...] = ()
    skip_bad_rows: bool = False

    def __post_init__(self) -> None:
        if self.limit is not None and self.limit < 1:
            raise DatasetError(f"limit must be >= 1 or None, got {self.limit}")
        if self.epochs < 1:
            raise DatasetError(f"epochs must be >= 1, got {self.epochs}")


@dataclass(frozen=True)
class LoadedData:
    """Items ready to submit, and what was left out.

    Attributes:
        items: ``epochs * rows`` workflow items.
        rows: rows used per epoch.
        columns: the dataset's column names.
        skipped: ``(row index, reason)`` of each row left out (``skip_bad_rows``).
    """

    items: list[dict[str, Any]]
    rows: int
    columns: tuple[str, ...]
    skipped: tuple[tuple[int, str], ...] = field(default=())


def load_items(spec: DataSpec) -> LoadedData:
    """Load ``spec.source`` and map its rows to workflow items (see the module docstring).

    Raises:
        DatasetError: one line naming the source and what is wrong.
    """
    if spec.source.startswith("builtin:shapes"):  # image items, made ready: no column mapping
        shapes = _builtin_shapes(spec)
        return LoadedData(_repeat(shapes, spec), len(shapes), tuple(shapes[0]))
    if spec.source.startswith("builtin:"):
        rows, name = _builtin_text(spec), spec.source
        columns = list(rows[0])
    else:
        dataset, name = _open(spec)
        columns = list(dataset.column_names)
        rows = dataset
    mapping = _Mapping.plan(spec, columns, name)
    order = list(range(len(rows)))
    if spec.shuffle:
        random.Random(spec.seed).shuffle(order)
    if spec.limit is not None:
        order = order[: spec.limit]
    items, skipped = [], []
    for index in order:
        try:
            try:
                row = rows[index]
            except UnicodeDecodeError as exc:  # pyarrow keeps bad bytes until a row is read
                raise _BadRow(f"not valid UTF-8 ({exc.reason} at byte {exc.start} of a field)") from None
            items.append(mapping.item(row))
        except _BadRow as exc:
            if not spec.skip_bad_rows:
                raise DatasetError(f"dataset {name}: row index {index}: {exc} (--skip-bad-rows skips such "
                                   "rows)") from None
            logger.warning("dataset %s: row index %d skipped: %s", name, index, exc)
            skipped.append((index, str(exc)))
    if not items:
        why = f" ({len(skipped)} rows skipped)" if skipped else ""
        raise DatasetError(f"dataset {name} has no usable rows{why}")
    return LoadedData(_repeat(items, spec), len(items), tuple(columns), tuple(skipped))


def _repeat(items: list[dict[str, Any]], spec: DataSpec) -> list[dict[str, Any]]:
    out = list(items)
    for epoch in range(1, spec.epochs):
        again = list(items)
        if spec.shuffle:
            random.Random(spec.seed + epoch).shuffle(again)
        out += again
    return out


def _builtin_shapes(spec: DataSpec) -> list[dict[str, Any]]:
    from ._files import load_dataset

    items = load_dataset(spec.source, None)
    if spec.shuffle:
        random.Random(spec.seed).shuffle(items)
    return items[: spec.limit] if spec.limit else items


def _builtin_text(spec: DataSpec) -> list[dict[str, Any]]:
    """The rows of ``builtin:arith[:N]`` (``question``, ``answer``), mapped like any dataset."""
    from ._files import load_dataset

    return [{k: v for k, v in item.items() if k != "messages"} for item in load_dataset(spec.source, None)]


def _datasets_module() -> Any:
    try:
        import datasets
    except ImportError as exc:  # pragma: no cover - a dependency
        raise DatasetError(f"loading datasets needs the 'datasets' package ({exc})") from exc
    return datasets


def _why(exc: BaseException) -> str:
    """The messages of ``exc`` and its causes, on one line (datasets wraps pyarrow's)."""
    parts: list[str] = []
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        text = " ".join(str(current).split())
        if text and text not in parts:
            parts.append(text)
        current = current.__cause__ or current.__context__
    return ": ".join(parts[-2:]) if parts else "unknown error"


def _open(spec: DataSpec) -> tuple[Any, str]:
    """``(datasets.Dataset, display name)`` for a file, folder or hub id."""
    source = spec.source
    path = Path(source).expanduser()
    datasets = _datasets_module()
    try:
        if path.is_file():
            builder = _FORMATS.get(path.suffix.lower())
            if builder is None:
                raise DatasetError(f"dataset file {source}: unknown format {path.suffix!r}; use one of "
                                   f"{', '.join(sorted(_FORMATS))}, a save_to_disk folder or a hub id")
            if path.stat().st_size == 0:
                raise DatasetError(f"dataset {source} has no rows (the file is empty)")
            loaded = datasets.load_dataset(builder, data_files=str(path), split=spec.split or "train")
        elif path.is_dir():
            if any((path / f).is_file() for f in ("state.json", "dataset_dict.json")):
                loaded = datasets.load_from_disk(str(path))
                split = getattr(loaded, "split", None)
                if spec.split is not None and split is not None and not isinstance(loaded.column_names, dict) \
                        and str(split) != spec.split:
                    raise DatasetError(f"dataset {source}: holds split {str(split)!r}, not {spec.split!r}")
            else:
                loaded = datasets.load_dataset(str(path), spec.subset, split=spec.split)
        elif _looks_like_a_path(source):
            raise DatasetError(f"dataset file not found: {source}")
        else:
            loaded = datasets.load_dataset(source, spec.subset, split=spec.split)
    except DatasetError:
        raise
    except ConnectionError as exc:
        raise DatasetError(f"dataset {source!r}: not a local file or folder, and the Hugging Face hub could not be "
                           f"reached ({_why(exc)})") from None
    except Exception as exc:  # datasets/pyarrow raise many types: report them in one line
        raise DatasetError(f"dataset {source}: cannot load it ({type(exc).__name__}: {_why(exc)})") from None
    return _one_split(loaded, spec), source


def _one_split(loaded: Any, spec: DataSpec) -> Any:
    if not hasattr(loaded, "column_names") or isinstance(loaded.column_names, dict):  # a DatasetDict
        splits = list(loaded)
        split = spec.split or ("train" if "train" in splits else splits[0] if len(splits) == 1 else None)
        if split not in splits:
            raise DatasetError(f"dataset {spec.source}: split {spec.split!r} not found; splits are "
                               f"{', '.join(splits)} (choose one with --split)")
        return loaded[split]
    return loaded


def _looks_like_a_path(source: str) -> bool:
    return (source.startswith((".", "/", "~")) or "\\" in source or Path(source).suffix.lower() in _FORMATS
            or source.count("/") > 1)


class _BadRow(Exception):
    """A row that cannot be used (message: the reason)."""


def render_template(template: str, row: dict[str, Any]) -> str:
    """``template`` with each ``{column}`` replaced by ``str(row[column])``; ``{{``/``}}``
    are literal braces, other braces are kept as written.

    Raises:
        KeyError: a placeholder names no key of ``row``.
    """

    def sub(match: re.Match[str]) -> str:
        text = match.group(0)
        if text in ("{{", "}}"):
            return text[0]
        return str(row[match.group(1)])

    return _PLACEHOLDER.sub(sub, template)


def _placeholders(template: str) -> list[str]:
    return [m.group(1) for m in _PLACEHOLDER.finditer(template) if m.group(1)]


@dataclass(frozen=True)
class _Mapping:
    """Resolved column mapping: row -> item."""

    prompt_key: str | None
    messages_key: str | None
    answer_key: str | None
    template: str | None
    suffix: str
    system_prompt: str | None
    required: tuple[str, ...]

    @classmethod
    def plan(cls, spec: DataSpec, columns: Sequence[str], name: str) -> _Mapping:
        have = set(columns)
        listed = ", ".join(columns) or "none"

        def check(key: str | None, flag: str) -> str | None:
            if key is not None and key not in have:
                raise DatasetError(f"dataset {name}: {flag} {key!r} is not a column; columns are {listed}")
            return key

        messages_key = check(spec.messages_key, "--messages-key")
        prompt_key = check(spec.prompt_key, "--prompt-key")
        template = spec.prompt_template
        if template is not None:
            missing = [p for p in _placeholders(template) if p not in have]
            if missing:
                raise DatasetError(f"dataset {name}: --prompt-template placeholder {{{missing[0]}}} is not a column; "
                                   f"columns are {listed} (write {{{{ and }}}} for literal braces)")
        if sum(x is not None for x in (messages_key, prompt_key, template)) > 1:
            raise DatasetError("name one of --messages-key, --prompt-key and --prompt-template, not several")
        if messages_key is None and prompt_key is None and template is None:
            if "messages" in have:
                messages_key = "messages"
            else:
                prompt_key = next((k for k in PROMPT_KEYS if k in have), None)
                if prompt_key is None:
                    raise DatasetError(f"dataset {name}: no prompt column (none of {', '.join(PROMPT_KEYS)}, "
                                       f"messages); columns are {listed}; name one with --prompt-key, "
                                       "--messages-key or --prompt-template")
        answer_key = check(spec.answer_key, "--answer-key") or next((k for k in ANSWER_KEYS if k in have), None)
        for key in spec.required:
            if key not in have and not (key == "answer" and answer_key is not None):
                hint = " (name it with --answer-key)" if key == "answer" else ""
                raise DatasetError(f"dataset {name}: no column {key!r}, which the reward needs{hint}; "
                                   f"columns are {listed}")
        return cls(prompt_key, messages_key, answer_key, template, spec.prompt_suffix, spec.system_prompt,
                   tuple(spec.required))

    def item(self, row: dict[str, Any]) -> dict[str, Any]:
        item = dict(row)
        if self.messages_key is not None:
            messages = _chat(row.get(self.messages_key), self.messages_key)
        else:
            if self.template is not None:
                text = render_template(self.template, row)
            else:
                assert self.prompt_key is not None  # from_spec: a template or a prompt column
                value = row.get(self.prompt_key)
                if value is None:
                    raise _BadRow(f"field {self.prompt_key!r} is missing or null")
                if not isinstance(value, (str, int, float)) or isinstance(value, bool):
                    raise _BadRow(f"field {self.prompt_key!r} must be text, got {type(value).__name__}")
                text = str(value) + self.suffix if str(value).strip() else ""
            if not text.strip():
                raise _BadRow(f"field {self.prompt_key!r} is empty" if self.template is None
                              else "the prompt template renders to empty text")
            messages = [{"role": "user", "content": text}]
        if self.system_prompt and not (messages and messages[0].get("role") == "system"):
            messages = [{"role": "system", "content": self.system_prompt}, *messages]
        item["messages"] = messages
        if self.answer_key is not None:
            answer = row.get(self.answer_key)
            if answer is not None and (isinstance(answer, (dict, bool)) or not isinstance(answer, (str, int, float,
                                                                                                      list))):
                raise _BadRow(f"field {self.answer_key!r} must be text, a number or a list, "
                              f"got {type(answer).__name__}")
            item["answer"] = answer
        for key in self.required:
            if item.get(key) is None:
                name = self.answer_key if key == "answer" and self.answer_key else key
                raise _BadRow(f"field {name!r} is missing or null (the reward needs it)")
        return item


def _chat(value: Any, key: str) -> list[dict[str, Any]]:
    """Check a chat column's value: a non-empty list of ``{"role": str, "content": ...}``."""
    if not isinstance(value, list) or not value:
        raise _BadRow(f"field {key!r} must be a non-empty list of messages, got "
                      f"{type(value).__name__ if not isinstance(value, list) else 'an empty list'}")
    messages = []
    for i, turn in enumerate(value):
        if not isinstance(turn, dict) or not isinstance(turn.get("role"), str) or "content" not in turn:
            raise _BadRow(f"field {key!r}: message {i} must be an object with 'role' and 'content'")
        if turn["content"] is None or (isinstance(turn["content"], str) and not turn["content"].strip()):
            raise _BadRow(f"field {key!r}: message {i} has empty content")
        messages.append({k: v for k, v in turn.items() if v is not None})
    return messages

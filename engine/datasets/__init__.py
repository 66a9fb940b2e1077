"""Datasets for runs: rows turned into workflow items (dicts with ``messages``).

- :mod:`engine.datasets._files`: GSM8K-style jsonl files and the built-in
  ``builtin:arith`` set (:func:`load_dataset`, :func:`builtin_arith`, :func:`to_item`);
- :mod:`engine.datasets._hf`: a user's dataset through Hugging Face ``datasets`` (files,
  ``save_to_disk`` folders, hub ids), columns mapped to chats (:class:`DataSpec`,
  :func:`load_items`);
- :mod:`engine.datasets._shapes`: ``builtin:shapes``, a counting task on images drawn with
  PIL (:func:`builtin_shapes`).

May import: the standard library and :mod:`engine.errors`; ``datasets`` and PIL only
inside the functions that need them.  Not the executor, the backends or the
application.  Names resolve on first access."""

from __future__ import annotations

from typing import TYPE_CHECKING

__all__ = [
    "ANSWER_KEYS",
    "BUILTIN_ARITH",
    "BUILTIN_SHAPES",
    "DataSpec",
    "LoadedData",
    "PROMPT_KEYS",
    "PROMPT_SUFFIX",
    "SHAPES_QUESTION",
    "builtin_arith",
    "builtin_shapes",
    "draw_shapes",
    "load_dataset",
    "load_items",
    "render_template",
    "to_item",
]

_LAZY = {
    "ANSWER_KEYS": "engine.datasets._hf",
    "BUILTIN_ARITH": "engine.datasets._files",
    "BUILTIN_SHAPES": "engine.datasets._files",
    "DataSpec": "engine.datasets._hf",
    "LoadedData": "engine.datasets._hf",
    "PROMPT_KEYS": "engine.datasets._hf",
    "PROMPT_SUFFIX": "engine.datasets._files",
    "SHAPES_QUESTION": "engine.datasets._shapes",
    "builtin_arith": "engine.datasets._files",
    "builtin_shapes": "engine.datasets._shapes",
    "draw_shapes": "engine.datasets._shapes",
    "load_dataset": "engine.datasets._files",
    "load_items": "engine.datasets._hf",
    "render_template": "engine.datasets._hf",
    "to_item": "engine.datasets._files",
}

if TYPE_CHECKING:
    from ._files import BUILTIN_ARITH, BUILTIN_SHAPES, PROMPT_SUFFIX, builtin_arith, load_dataset, to_item
    from ._hf import ANSWER_KEYS, DataSpec, LoadedData, PROMPT_KEYS, load_items, render_template
    from ._shapes import SHAPES_QUESTION, builtin_shapes, draw_shapes

from engine.lazy import lazy_exports  # noqa: E402

__getattr__, __dir__ = lazy_exports(globals(), _LAZY)

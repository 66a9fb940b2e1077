"""Decode where the reward runs (ours): completions travel to reward workers as
token ids and are decoded there, off the engine's event loop.

:func:`tokenizer_file` writes a fast tokenizer's ``tokenizer.json`` once
(content-addressed, under ``<cache>/tokenizers/``, the cache folder of
:func:`engine.models.default_cache_dir`), and a :class:`~rewards._worker.TokenText`
names that file and the ids.  A pool's worker loads the file once per process
and decodes each ``TokenText`` argument to ``str`` before calling the reward
function (an ``async def`` reward is given the decoded text in-process), so a
reward function sees exactly what ``tokenizer.decode(ids,
skip_special_tokens=...)`` returns.

This holds only for tokenizers whose ``decode`` is the Rust tokenizer's own
(no ``clean_up_tokenization_spaces``); for others :func:`tokenizer_file`
returns None and callers decode in-process.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
import weakref
from pathlib import Path
from typing import Any

from ._worker import TokenText

__all__ = ["TokenText", "rust_tokenizer", "tokenizer_file"]

_FILES: weakref.WeakKeyDictionary[Any, str | None] = weakref.WeakKeyDictionary()


def rust_tokenizer(tokenizer: Any) -> Any:
    """The ``tokenizers.Tokenizer`` behind a fast tokenizer whose encode/decode add
    nothing on top of it (no clean-up of spaces), else None."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return None
    return backend


def tokenizer_file(tokenizer: Any, cache_dir: str | os.PathLike[str] | None = None) -> str | None:
    """Path of a ``tokenizer.json`` equal to ``tokenizer``'s Rust tokenizer, for
    :class:`TokenText`; None when ``tokenizer`` is not a plain fast tokenizer
    (see the module docstring) or the file cannot be written.

    Blocking file I/O, once per tokenizer object and process (call it at
    construction time, not from a trio task).  ``cache_dir``: default
    ``engine.models.default_cache_dir() / "tokenizers"``; the file is named by
    the BLAKE2b digest of its contents and written atomically, so processes
    share it safely.
    """
    try:
        return _FILES[tokenizer]
    except (KeyError, TypeError):  # TypeError: not weak-referenceable
        pass
    backend = rust_tokenizer(tokenizer)
    path: str | None = None
    if backend is not None:
        try:
            text = backend.to_str()
            if cache_dir is None:
                from engine.models import default_cache_dir

                cache_dir = default_cache_dir() / "tokenizers"
            folder = Path(cache_dir)
            target = folder / f"{hashlib.blake2b(text.encode(), digest_size=16).hexdigest()}.json"
            if not target.is_file():
                folder.mkdir(parents=True, exist_ok=True)
                fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tokenizer-", suffix=".json")
                try:
                    with os.fdopen(fd, "w", encoding="utf-8") as f:
                        f.write(text)
                    os.replace(tmp, target)
                except BaseException:
                    os.unlink(tmp)
                    raise
            path = str(target)
        except Exception:  # no usable backend or an unwritable cache: decode in-process
            path = None
    try:
        _FILES[tokenizer] = path
    except TypeError:
        pass
    return path

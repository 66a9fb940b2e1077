"""Model resolution: a model spec (``builtin:smollm2``, ``builtin:tiny``, ``builtin:tiny-vlm``,
a folder, a hub id) to something ``from_pretrained`` loads, offline.

- :mod:`engine.models._resolve`: :func:`resolve_model`, the model cache
  (:func:`default_cache_dir`) and the built-in SmolLM2 (:func:`ensure_smollm2`);
- :mod:`engine.models._tiny`: the tiny offline models (a byte-level tokenizer, a tiny
  random causal LM and VLM), whose public entry is :mod:`engine.testing`;
- :mod:`engine.models._folders`: atomic, locked folder builds.

May import: the standard library and :mod:`engine.errors`; torch and transformers only
inside the functions that build a model.  Not the executor, the backends or the
application.  Names resolve on first access."""

from __future__ import annotations

from typing import TYPE_CHECKING

__all__ = [
    "BUILTIN_MODEL",
    "BUILTIN_TINY",
    "BUILTIN_TINY_VLM",
    "default_cache_dir",
    "ensure_smollm2",
    "find_smollm2_gguf",
    "resolve_model",
    "smollm2_dir",
]

_LAZY = {
    "BUILTIN_MODEL": "engine.models._resolve",
    "BUILTIN_TINY": "engine.models._resolve",
    "BUILTIN_TINY_VLM": "engine.models._resolve",
    "default_cache_dir": "engine.models._resolve",
    "ensure_smollm2": "engine.models._resolve",
    "find_smollm2_gguf": "engine.models._resolve",
    "resolve_model": "engine.models._resolve",
    "smollm2_dir": "engine.models._resolve",
}

if TYPE_CHECKING:
    from ._resolve import (
        BUILTIN_MODEL,
        BUILTIN_TINY,
        BUILTIN_TINY_VLM,
        default_cache_dir,
        ensure_smollm2,
        find_smollm2_gguf,
        resolve_model,
        smollm2_dir,
    )

from engine.lazy import lazy_exports  # noqa: E402

__getattr__, __dir__ = lazy_exports(globals(), _LAZY)

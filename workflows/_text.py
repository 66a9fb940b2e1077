"""Token ids to text for the built-in workflows (what their reward functions read)."""

from __future__ import annotations

from typing import Any

from rewards import rust_tokenizer

__all__ = ["decode"]


def decode(tokenizer: Any, ids: list[int], skip_special_tokens: bool) -> str:
    """``ids`` as text, by the tokenizer's Rust backend when it has one (no transformers
    per-call overhead: the same text for a plain fast tokenizer), else by
    ``tokenizer.decode``."""
    backend = rust_tokenizer(tokenizer)
    if backend is not None:
        return backend.decode(ids, skip_special_tokens=skip_special_tokens)
    return tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

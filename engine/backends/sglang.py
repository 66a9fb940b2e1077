"""``sglang``: SGLang's native ``/generate`` API (also ``rollout serve``), kept importable
here; the backend lives in :mod:`engine.backends.remote.sglang`, its wire format in
:mod:`engine.backends.sglang_wire`."""

from .remote import SGLangBackend

__all__ = ["SGLangBackend"]

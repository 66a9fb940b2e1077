"""Which engine shard the running code is in (:func:`shard_index`).

Its own module, imported by the package and by :mod:`engine.shards._shard_main`:
a shard process runs ``python -m engine.shards._shard_main``, so that module is
``__main__`` there and must not be imported by the package (it would be loaded a
second time, with a second context variable, and runpy warns about it).
"""

from __future__ import annotations

import contextvars

__all__ = ["SHARD_INDEX", "shard_index"]

SHARD_INDEX: contextvars.ContextVar[int | None] = contextvars.ContextVar("rollout_shard_index", default=None)


def shard_index() -> int | None:
    """The index (0..N-1) of the engine shard this code runs in: in a backend
    factory that the shard calls, in its workflows and filters; None outside a
    shard (e.g. in the coordinator's process).  For factories that give each shard
    its own resource (:class:`~engine.backends.hf.HFBackendFactory`'s ``devices``:
    one GPU per shard)."""
    return SHARD_INDEX.get()

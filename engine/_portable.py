"""Pickling for another process (a reward worker, an engine shard): :func:`dumps`.

Plain pickle names classes and functions by module and qualified name; a process
started with ``python -m ...`` or by spawn has a different ``__main__``, so
anything defined in the user's script (and lambdas, nested functions) must travel
by value.  cloudpickle does that (as trio-parallel and Ray choose); the bytes load
with plain :func:`pickle.loads` wherever cloudpickle is importable.
"""

from __future__ import annotations

import pickle
from pickle import HIGHEST_PROTOCOL
from typing import Any

try:  # mirror trio-parallel: cloudpickle when installed (lambdas, __main__), else pickle
    from cloudpickle import dumps as _cloud_dumps
except ImportError:  # pragma: no cover - cloudpickle comes with tensordict
    from pickle import dumps as _cloud_dumps

__all__ = ["dumps"]


def dumps(obj: Any, protocol: int = HIGHEST_PROTOCOL) -> bytes:
    """Pickle ``obj`` for another process: plain pickle (twice as fast) when it can
    do it without naming ``__main__``, else cloudpickle (by value: lambdas, nested
    functions, things defined in ``__main__``).

    Raises:
        Exception: what cloudpickle raises for an object it cannot pickle either
            (a lock, an open file, a live trio object).
    """
    try:
        data = pickle.dumps(obj, protocol=protocol)
    except Exception:
        return _cloud_dumps(obj, protocol=protocol)
    if b"__main__" in data:  # the other process has another __main__ to load it from
        return _cloud_dumps(obj, protocol=protocol)
    return data

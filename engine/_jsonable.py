"""Records as plain JSON values, for ``summary.json`` and the servers' info routes."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

__all__ = ["plain"]


def plain(obj: Any) -> Any:
    """``obj`` as plain JSON values: dataclass instances (their fields) and dicts (keys
    as ``str``) as objects, lists and tuples as arrays, a non-finite float as ``None``
    (JSON has no NaN); anything else as its ``repr``.  Never raises."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if obj is None or isinstance(obj, (int, float, str, bool)):
        return obj
    if isinstance(obj, dict):
        return {str(k): plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [plain(v) for v in obj]
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    return repr(obj)

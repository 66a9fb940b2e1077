"""Unit tier: :func:`engine._jsonable.plain`, the one conversion of records to JSON values
(``summary.json``'s statistics, ``rollout serve``'s ``/server_info``)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import ClassVar

from engine._jsonable import plain


@dataclass(frozen=True)
class _Inner:
    rate: float = math.nan
    counts: dict[int, int] = field(default_factory=lambda: {1: 2})


@dataclass(frozen=True)
class _Record:
    kind: ClassVar[str] = "not a field"
    name: str = "pool"
    inner: _Inner = field(default_factory=_Inner)
    pair: tuple[int, float] = (1, math.inf)


def test_records_become_json_values_and_non_finite_floats_become_null():
    out = plain({"stats": _Record(), "ok": True, "none": None, "obj": object})
    assert out["stats"] == {"name": "pool", "inner": {"rate": None, "counts": {"1": 2}}, "pair": [1, None]}
    assert out["ok"] is True and out["none"] is None and out["obj"] == repr(object)
    assert json.loads(json.dumps(out, allow_nan=False)) == out  # strict JSON: no NaN, no Infinity


def test_a_class_is_not_read_as_a_record():
    assert plain(_Record) == repr(_Record)

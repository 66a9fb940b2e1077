"""PEP 562 lazy exports, shared by the ``engine``, ``workflows`` and ``rewards``
packages: public names resolve on first access, so importing a package (as
reward worker processes do) does not import torch or trio."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def lazy_exports(namespace: dict[str, Any], mapping: dict[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """Return ``(__getattr__, __dir__)`` for a package whose ``namespace`` (its
    ``globals()``) exports ``mapping`` (public name -> defining module)."""
    package = namespace["__name__"]

    def __getattr__(name: str) -> Any:
        try:
            module = mapping[name]
        except KeyError:
            raise AttributeError(f"module {package!r} has no attribute {name!r}") from None
        value = getattr(importlib.import_module(module), name)
        namespace[name] = value  # cache: later lookups skip __getattr__
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(namespace.get("__all__", ())))

    return __getattr__, __dir__

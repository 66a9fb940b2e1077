"""Built-in rollout workflows, exported lazily.

``import workflows`` is cheap: built-ins (which import torch/transformers) are
loaded on first attribute access through module ``__getattr__``.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["RLVRWorkflow", "RolloutWorkflow", "resolve_workflow"]

_LAZY = {
    "RLVRWorkflow": "workflows.rlvr",
    "RolloutWorkflow": "workflows.base",
    "resolve_workflow": "workflows.base",
}


def __getattr__(name: str) -> Any:
    try:
        module = _LAZY[name]
    except KeyError:
        raise AttributeError(f"module 'workflows' has no attribute {name!r}") from None
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))

"""Built-in rollout workflows, exported lazily.

``import workflows`` is cheap: built-ins (which import torch/transformers) are
loaded on first attribute access through module ``__getattr__``.
"""

from __future__ import annotations


__all__ = ["BUILTIN_WORKFLOWS", "MathAgentWorkflow", "MultiTurnWorkflow", "RLVRWorkflow", "RolloutWorkflow", "VisionRLVRWorkflow",
           "resolve_workflow"]

_LAZY = {
    "BUILTIN_WORKFLOWS": "workflows.registry",
    "MathAgentWorkflow": "workflows.math_agent",
    "MultiTurnWorkflow": "workflows.multi_turn",
    "RLVRWorkflow": "workflows.rlvr",
    "RolloutWorkflow": "workflows.base",
    "VisionRLVRWorkflow": "workflows.vision_rlvr",
    "resolve_workflow": "workflows.base",
}


from engine.lazy import lazy_exports  # noqa: E402

__getattr__, __dir__ = lazy_exports(globals(), _LAZY)

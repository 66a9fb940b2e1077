"""Built-in rollout workflows, exported lazily.

``import workflows`` is cheap: built-ins (which import torch/transformers) are
loaded on first attribute access through module ``__getattr__``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING


__all__ = ["AgentsSDKMathWorkflow", "BUILTIN_WORKFLOWS", "LangGraphMathWorkflow", "MathAgentWorkflow", "MultiTurnWorkflow", "RLVRWorkflow", "RolloutWorkflow", "VisionRLVRWorkflow",
           "resolve_workflow"]

_LAZY = {
    "AgentsSDKMathWorkflow": "workflows.agents_sdk_math",
    "LangGraphMathWorkflow": "workflows.langgraph_math",
    "BUILTIN_WORKFLOWS": "workflows.registry",
    "MathAgentWorkflow": "workflows.math_agent",
    "MultiTurnWorkflow": "workflows.multi_turn",
    "RLVRWorkflow": "workflows.rlvr",
    "RolloutWorkflow": "engine.workflow",
    "VisionRLVRWorkflow": "workflows.vision_rlvr",
    "resolve_workflow": "engine.workflow",
}


if TYPE_CHECKING:  # what type checkers see; at run time each name resolves on first access
    from engine.workflow import RolloutWorkflow as RolloutWorkflow, resolve_workflow as resolve_workflow
    from .agents_sdk_math import AgentsSDKMathWorkflow as AgentsSDKMathWorkflow
    from .langgraph_math import LangGraphMathWorkflow as LangGraphMathWorkflow
    from .math_agent import MathAgentWorkflow as MathAgentWorkflow
    from .multi_turn import MultiTurnWorkflow as MultiTurnWorkflow
    from .registry import BUILTIN_WORKFLOWS as BUILTIN_WORKFLOWS
    from .rlvr import RLVRWorkflow as RLVRWorkflow
    from .vision_rlvr import VisionRLVRWorkflow as VisionRLVRWorkflow

from engine.lazy import lazy_exports  # noqa: E402

__getattr__, __dir__ = lazy_exports(globals(), _LAZY)

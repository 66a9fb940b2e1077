"""The built-in workflows by name (``rollout run --workflow NAME``), imported lazily.

Each entry says where the class lives and what it needs from a dataset row, so
that ``rollout run --help`` can list them without importing any of them.
Anything else given to ``--workflow`` is an import string (``"pkg.module:Class"``,
``"pkg.module.Class"`` or ``"path/to/file.py:Class"``).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["BUILTIN_WORKFLOWS", "BuiltinWorkflow"]


@dataclass(frozen=True)
class BuiltinWorkflow:
    """A built-in workflow.

    Attributes:
        path: import string of the class.
        row: what the workflow needs from a dataset row (for ``--help``).
        summary: one line on what it does.
        needs_processor: the constructor also takes ``processor=`` (a
            transformers multimodal processor).
    """

    path: str
    row: str
    summary: str
    needs_processor: bool = False


BUILTIN_WORKFLOWS: dict[str, BuiltinWorkflow] = {
    "rlvr": BuiltinWorkflow(
        "workflows.rlvr.RLVRWorkflow",
        row="'messages' (rollout run builds it from 'question'); other keys reach the reward (gsm8k: 'answer')",
        summary="single-turn RL with a verifiable reward",
    ),
    "multi_turn": BuiltinWorkflow(
        "workflows.multi_turn.MultiTurnWorkflow",
        row="as rlvr; kwargs max_turns, turn_discount, feedback",
        summary="answer, get feedback when the reward is not positive, try again (token-exact)",
    ),
    "math_agent": BuiltinWorkflow(
        "workflows.math_agent.MathAgentWorkflow",
        row="'question' (or 'messages'); other keys reach the reward (gsm8k: 'answer'); kwargs max_turns, "
            "turn_discount, export_style",
        summary="GSM8K agent with a calculator tool through the engine's OpenAI client (returns interactions)",
    ),
    "agents_sdk_math": BuiltinWorkflow(
        "workflows.agents_sdk_math.AgentsSDKMathWorkflow",
        row="as math_agent; kwargs max_turns, turn_discount, export_style, streamed (needs the agents extra)",
        summary="the GSM8K agent written with the OpenAI Agents SDK (Responses API) against the engine's proxy",
    ),
    "langgraph_math": BuiltinWorkflow(
        "workflows.langgraph_math.LangGraphMathWorkflow",
        row="as math_agent; kwargs max_turns, turn_discount, export_style, use_responses_api (needs the agents "
            "extra)",
        summary="the GSM8K agent written with LangGraph's ReAct agent (streamed) against the engine's proxy",
    ),
    "vision_rlvr": BuiltinWorkflow(
        "workflows.vision_rlvr.VisionRLVRWorkflow",
        row="'images' (PIL images, file paths or bytes) and 'messages'; other keys reach the reward",
        summary="single-turn RLVR on images through a multimodal processor",
        needs_processor=True,
    ),
}

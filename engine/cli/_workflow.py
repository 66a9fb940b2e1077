"""``rollout run --workflow/--workflow-kwargs/--reward``: parsing, checks, construction.

Everything that can be checked before the model loads is checked in
:func:`plan_workflow` (the workflow class and the reward function are resolved
there), so a typo is one line on stderr within a second, naming the flag.
"""

from __future__ import annotations

import argparse
import inspect
import json
from dataclasses import dataclass
from typing import Any

from ..errors import RewardError, RolloutError, WorkflowError

__all__ = ["DEFAULT_REWARD", "REWARDS", "WorkflowPlan", "add_workflow_arguments", "build_workflow", "plan_workflow",
           "reward_data_keys", "reward_prompt_hint", "workflows_epilog"]

#: ``--reward NAME``: the built-in rewards, as (import string, answer-format hint that
#: ``rollout run`` appends to a prompt taken from a dataset column).
REWARDS = {
    "gsm8k": ("rewards.gsm8k:gsm8k_reward", "\nAnswer with the final number after '####'."),
    "math": ("rewards.math:math_reward", "\nPut your final answer within \\boxed{}."),
    "exact_match": ("rewards.exact_match:exact_match_reward", ""),
}
DEFAULT_REWARD = "gsm8k"


def _builtin_reward(spec: str) -> str | None:
    """The built-in name of ``--reward spec`` (a name or its import string), else None."""
    return next((name for name, (path, _) in REWARDS.items() if spec in (name, path)), None)


def reward_prompt_hint(spec: str) -> str:
    """The answer-format hint of a built-in reward (``""`` for any other)."""
    name = _builtin_reward(spec)
    return REWARDS[name][1] if name else ""


def reward_data_keys(spec: str, fn: Any = None) -> tuple[str, ...]:
    """The data keys a reward needs in every item: ``("answer",)`` for the built-ins;
    for another function, its parameters after AReaL's four that have no default."""
    if _builtin_reward(spec):
        return ("answer",)
    fn = getattr(fn, "_fn", None) or fn  # a FileFunction holds the function it loaded
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return ()
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    named = [p for p in params if p.kind in (*positional, inspect.Parameter.KEYWORD_ONLY)]
    return tuple(p.name for p in named[4:] if p.default is inspect.Parameter.empty)


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON ({exc.msg} at column {exc.colno}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object like '{{\"max_turns\": 3}}', got {text!r}")
    return value


def workflows_epilog() -> str:
    """The ``--help`` text listing the built-in workflows and their row needs."""
    from workflows.registry import BUILTIN_WORKFLOWS

    lines = ["built-in workflows (--workflow NAME):"]
    for name, entry in BUILTIN_WORKFLOWS.items():
        lines.append(f"  {name:<12} {entry.summary}")
        lines.append(f"  {'':<12} row needs: {entry.row}")
    lines.append("  or an import string: pkg.module:Class, pkg.module.Class, path/to/file.py:Class,")
    lines.append("  built as Class(reward_fn=..., gconfig=..., tokenizer=..., **workflow_kwargs)")
    return "\n".join(lines)


def add_workflow_arguments(run: argparse.ArgumentParser) -> None:
    """Add ``--workflow``, ``--workflow-kwargs`` and ``--reward`` to ``rollout run``."""
    from workflows.registry import BUILTIN_WORKFLOWS

    names = "|".join(BUILTIN_WORKFLOWS)
    run.add_argument("--workflow", default="rlvr", metavar=f"{{{names}}}|IMPORT",
                     help="the workflow: a built-in name (listed below) or an import string (default rlvr)")
    run.add_argument("--workflow-kwargs", type=_json_object, default=None, metavar="JSON",
                     help="extra keyword arguments of the workflow's constructor, a JSON object "
                          "(e.g. '{\"max_turns\": 3, \"turn_discount\": 0.9}')")
    run.add_argument("--reward", default=DEFAULT_REWARD, metavar=f"{{{'|'.join(REWARDS)}}}|IMPORT",
                     help=f"reward function: a built-in (gsm8k: the number after '####'; math: math-verify on "
                          f"\\boxed{{}} answers; exact_match: normalised text) or an import string pkg.module:fn, "
                          f"pkg.module.fn, path/to/file.py:fn (default {DEFAULT_REWARD})")


@dataclass(frozen=True)
class WorkflowPlan:
    """What ``--workflow``/``--reward`` resolved to (before the model loads)."""

    name: str
    target: Any  # a class (or factory) to call, or a ready workflow instance
    kwargs: dict[str, Any]
    reward_fn: Any
    needs_processor: bool


def plan_workflow(args: argparse.Namespace) -> WorkflowPlan:
    """Resolve ``--workflow`` and ``--reward``.

    Raises:
        WorkflowError / RewardError: one line naming the flag and the reason.
    """
    from engine.imports import _import, resolve_reward_fn
    from workflows.registry import BUILTIN_WORKFLOWS

    try:
        name = _builtin_reward(args.reward)
        reward_fn = resolve_reward_fn(REWARDS[name][0] if name else args.reward)
    except RewardError as exc:
        if not any(c in args.reward for c in ".:/"):
            raise RewardError(f"--reward {args.reward!r}: unknown reward; built-ins are {', '.join(REWARDS)}, "
                              "anything else must be an import string like 'pkg.module:fn'") from None
        raise RewardError(f"--reward: {exc}") from None
    name = args.workflow
    entry = BUILTIN_WORKFLOWS.get(name)
    if entry is None and not any(c in name for c in ".:/"):
        raise WorkflowError(f"--workflow {name!r}: unknown workflow; built-ins are {', '.join(BUILTIN_WORKFLOWS)}, "
                            "anything else must be an import string like 'pkg.module:Class'")
    try:
        target = _import(entry.path if entry else name)[0]
    except ValueError as exc:
        raise WorkflowError(f"--workflow {name!r}: {exc}") from None
    return WorkflowPlan(name, target, dict(args.workflow_kwargs or {}), reward_fn,
                        bool(entry and entry.needs_processor))


def build_workflow(plan: WorkflowPlan, *, gconfig: Any, tokenizer: Any, processor: Any = None) -> Any:
    """``target(reward_fn=..., gconfig=..., tokenizer=..., [processor=...,] **kwargs)``.

    Raises:
        WorkflowError: the constructor rejects the arguments (names ``--workflow-kwargs``).
    """
    target = plan.target
    if not inspect.isclass(target) and (hasattr(target, "arun_episode") or hasattr(target, "run")):
        if plan.kwargs:
            raise WorkflowError(f"--workflow-kwargs: {plan.name!r} names a workflow instance, which takes no kwargs")
        return target
    if not callable(target):
        raise WorkflowError(f"--workflow {plan.name!r}: names a {type(target).__name__}, not a workflow class")
    extra = {"processor": processor} if plan.needs_processor else {}
    try:
        return target(reward_fn=plan.reward_fn, gconfig=gconfig, tokenizer=tokenizer, **extra, **plan.kwargs)
    except RolloutError:
        raise
    except (TypeError, ValueError) as exc:
        raise WorkflowError(f"--workflow-kwargs: cannot build workflow {plan.name!r}: {exc}") from exc

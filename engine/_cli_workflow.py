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

from .errors import RewardError, RolloutError, WorkflowError

__all__ = ["WorkflowPlan", "add_workflow_arguments", "build_workflow", "plan_workflow", "workflows_epilog"]

DEFAULT_REWARD = "rewards.gsm8k:gsm8k_reward"


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
    run.add_argument("--reward", default=DEFAULT_REWARD, metavar="IMPORT",
                     help=f"reward function: pkg.module:fn, pkg.module.fn or path/to/file.py:fn "
                          f"(default {DEFAULT_REWARD})")


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
        reward_fn = resolve_reward_fn(args.reward)
    except RewardError as exc:
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

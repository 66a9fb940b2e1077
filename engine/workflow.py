"""The workflow contract (AReaL ``areal/api/workflow_api.py``) and spec resolution.

It lives in the engine's core, below the workflow implementations (``workflows/``), so
that the executor never imports the implementations package; ``workflows.RolloutWorkflow``
and ``engine.RolloutWorkflow`` name the same class."""

from __future__ import annotations

import abc
import inspect
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, Protocol

from engine.errors import WorkflowError

if TYPE_CHECKING:
    from rewards import RewardOutcome

    from engine.types import ModelRequest, ModelResponse

__all__ = ["EngineRewards", "EpisodeEngine", "EpisodeRewards", "RolloutWorkflow", "resolve_workflow"]


class EpisodeRewards(Protocol):
    """What a workflow may call on ``engine.reward_pool``: a :class:`rewards.RewardPool`
    (the engine's own, or one given to ``open_rollout_engine(reward_pool=)``), or a
    double such as :class:`engine.testing.InProcessRewardPool`."""

    def score(self, reward_fn: Callable[..., Any], prompt: Any, completions: Any, prompt_ids: Any,
              completion_ids: Any, /, **data: Any) -> Awaitable[RewardOutcome]:
        """``reward_fn(prompt, completions, prompt_ids, completion_ids, **data)`` under the
        pool's timeout and retry policy: its :class:`rewards.RewardOutcome` (``reward``
        float, ``is_fallback`` bool).  Raises :class:`~engine.errors.RewardError`."""
        ...


class EngineRewards(EpisodeRewards, Protocol):
    """What the engine asks of its reward pool (``open_rollout_engine(reward_pool=)``): what
    an episode may call (:class:`EpisodeRewards`), and a sync ``statistics()`` snapshot the
    engine reports as ``EngineStatistics.rewards`` (a :class:`rewards.RewardPoolStatistics`
    for the engine's own pools)."""

    def statistics(self) -> Any:
        """A snapshot of the pool, sync and cheap."""
        ...


class EpisodeEngine(Protocol):
    """What :meth:`RolloutWorkflow.arun_episode` may call on its ``engine`` (AReaL types
    it ``InferenceEngine``): a :class:`~engine.executor.RolloutEngine`, seen from inside
    one episode.  Anything else on the engine (``submit``, ``prepare_batch``,
    ``set_version``, ...) is the trainer's, not the workflow's."""

    async def agenerate(self, req: ModelRequest) -> ModelResponse:
        """Generate one response: tokens, logprobs and per-token versions (resumed across
        weight updates).  Raises :class:`~engine.errors.BackendError` or
        :class:`~engine.errors.InvalidRequestError`."""
        ...

    @property
    def reward_pool(self) -> EpisodeRewards:
        """The engine's reward pool (never ``None`` inside an episode)."""
        ...


class RolloutWorkflow(abc.ABC):
    """One episode of interaction between a policy and its environment.

    Subclasses implement :meth:`arun_episode`.  The engine runs it as one trio task
    per episode; cancelling the episode cancels whatever it awaits (generation,
    reward job).
    """

    @abc.abstractmethod
    async def arun_episode(self, engine: EpisodeEngine, data: dict[str, Any]) -> Any:
        """Run one episode on one dataset item.

        Args:
            engine: what an episode may call (:class:`EpisodeEngine`):
                ``await engine.agenerate(req: ModelRequest) -> ModelResponse`` and
                ``await engine.reward_pool.score(...)``.
            data: one dataset item (a dict).

        Returns:
            A trajectory ``TensorDict`` with batch size ``[B]`` (fields in
            ``engine.data.TRAJECTORY_SCHEMA``), a ``dict[id, Interaction]`` of
            OpenAI-compatible completions (``InteractionCache.export_interactions``;
            the engine makes one row per interaction:
            :mod:`engine.openai.interaction`), or ``None`` to reject the episode.
            An exception fails the episode (reason ``workflow_error`` unless it is a
            reward/backend/request error); it never stops the run.
        """


class _RunAdapter(RolloutWorkflow):
    """Wrap an object with a compatible ``async run(engine, data)`` method."""

    def __init__(self, obj: Any) -> None:
        self._obj = obj

    async def arun_episode(self, engine: EpisodeEngine, data: dict[str, Any]) -> Any:
        return await self._obj.run(engine, data)

    def __repr__(self) -> str:
        return f"_RunAdapter({self._obj!r})"


def _import_path(path: str) -> Any:
    from engine.imports import import_object

    return import_object(path, error=WorkflowError, what="workflow")


def resolve_workflow(workflow: Any, workflow_kwargs: dict[str, Any] | None = None) -> RolloutWorkflow:
    """Turn a workflow spec into an instance.

    A spec is a :class:`RolloutWorkflow` instance, a class (instantiated with
    ``workflow_kwargs``), an import string naming either (``"pkg.module.Class"``,
    ``"pkg.module:Class"`` or ``"path/to/file.py:Class"``, see
    :mod:`engine.imports`), or any object with an
    ``async arun_episode(engine, data)`` or ``async run(engine, data)`` method.

    Raises:
        WorkflowError: the path cannot be imported, the class cannot be built with
            ``workflow_kwargs``, ``workflow_kwargs`` is given with an instance, or the
            object has no compatible coroutine method.
    """
    spec = workflow
    if isinstance(workflow, str):
        workflow = _import_path(workflow)
    if inspect.isclass(workflow):
        try:
            workflow = workflow(**(workflow_kwargs or {}))
        except TypeError as exc:
            raise WorkflowError(f"cannot build workflow {spec!r} with workflow_kwargs: {exc}") from exc
    elif workflow_kwargs:
        raise WorkflowError(f"workflow_kwargs given, but workflow {spec!r} is already an instance")
    if isinstance(workflow, RolloutWorkflow):
        return workflow
    if inspect.iscoroutinefunction(getattr(workflow, "arun_episode", None)):
        return workflow  # duck-typed AReaL-style workflow
    if inspect.iscoroutinefunction(getattr(workflow, "run", None)):
        return _RunAdapter(workflow)
    raise WorkflowError(
        f"workflow {spec!r} has no coroutine method arun_episode(engine, data) or run(engine, data)"
    )

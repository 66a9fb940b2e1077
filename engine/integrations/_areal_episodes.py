"""AReaL's workflows as engine episodes: the trio side of the adapter.

Every AReaL workflow the adapter is given becomes one of these engine workflows (a
:class:`engine.RolloutWorkflow`, run by the engine as one trio task per group member):

* :class:`AReaLEpisode`: a ``areal.api.RolloutWorkflow`` (``RLVRWorkflow``,
  ``MultiTurnWorkflow``, yours).  Its ``arun_episode(engine, data)`` runs unchanged on
  the adapter's asyncio loop (:mod:`._areal_bridge`) with the adapter as its
  ``engine``: each ``await engine.agenerate(req)`` comes back into this episode's trio
  task.  AReaL's ``workflow_context`` (``is_eval``, ``task_id``) is set as AReaL's
  executor sets it.  A returned dict of ``InteractionWithTokenLogpReward`` is
  concatenated as AReaL's executor does; a tensor dict is carried as a ``TensorDict``
  (:func:`._areal_convert.to_engine_trajectory`).
* :class:`AgentEpisode`: an agent, AReaL's "any class with ``async run(data,
  **extra_kwargs)``" (``areal.workflow.openai.math_agent.MathAgent``): it gets
  ``base_url``, ``api_key`` and an ``http_client`` whose transport answers the OpenAI
  routes in-process (:class:`engine.openai.EngineOpenAI` on this episode's engine: no
  socket, no server); what ``run`` returns is the reward (a number: the last
  completion's; a dict: per completion id), then AReaL's ``turn_discount`` and
  ``export_style`` apply and the completions become the rows (AReaL's keys and dtypes).

The reward pool: an ``AsyncRewardWrapper`` of AReaL held by a workflow instance
(``RLVRWorkflow.async_reward_fn``, ``MultiTurnWorkflow.async_reward_fn``) is swapped for
:class:`EngineReward` (same call, same ``timeout_seconds`` / ``max_retries``), which
scores in the engine's reward pool: killable workers, fallbacks counted per episode.
"""

from __future__ import annotations

import contextvars
import json
import logging
from typing import Any

import httpx

from ..context import episode_id
from ..errors import BackendError, InvalidRequestError, WorkflowError
from ..workflow import RolloutWorkflow
from ._areal_bridge import AsyncioLoop, call_trio, run_bridged
from ._areal_convert import to_engine_trajectory

__all__ = ["AReaLEpisode", "AgentEpisode", "EPISODE_ENGINE", "EngineReward", "swap_reward_wrappers"]

logger = logging.getLogger(f"rollout.{__name__}")

#: asyncio side of an episode: the engine (trio) its ``agenerate`` calls go to
EPISODE_ENGINE: contextvars.ContextVar[Any] = contextvars.ContextVar("areal_episode_engine", default=None)

#: where an agent's OpenAI client points (never resolved: its transport answers in-process)
AGENT_BASE_URL = "http://trio-rollout.invalid/v1"


class EngineReward:
    """An AReaL ``AsyncRewardWrapper``'s replacement: ``await fn(*args, **data) -> float``
    (from the asyncio side of an episode) scores in the episode's engine's reward pool
    (``engine.reward_pool.score_call``) with the wrapper's ``timeout_seconds`` and
    ``max_retries``.

    Raises (from a call): :class:`~engine.errors.RewardError` (the last attempt raised, the
    worker died, the value is not a number); RuntimeError outside an adapter episode.
    (Construction: ``RewardError`` when ``reward_fn`` cannot be pickled, ``ValueError`` for
    an out-of-range policy: :class:`rewards.AsyncRewardWrapper`'s checks.)
    """

    def __init__(self, reward_fn: Any, timeout_seconds: float = 15.0, max_retries: int = 3) -> None:
        from rewards import AsyncRewardWrapper

        self.reward_fn = reward_fn
        self.timeout_seconds = timeout_seconds
        self.max_retries = max_retries
        self._wrapper = AsyncRewardWrapper(reward_fn, timeout_seconds=timeout_seconds, max_retries=max_retries)

    async def __call__(self, *args: Any, **data: Any) -> float:
        return await call_trio(self._score, EPISODE_ENGINE.get(), args, data)

    async def _score(self, engine: Any, args: tuple, data: dict[str, Any]) -> float:  # trio, in the episode's task
        pool = getattr(engine, "reward_pool", None)
        score_call = getattr(pool, "score_call", None)
        if score_call is not None:  # the engine's pool: the wrapper's policy, any signature
            outcome = await score_call(self.reward_fn, args, data, timeout_seconds=self.timeout_seconds,
                                       max_retries=self.max_retries)
            return float(outcome.reward)
        if pool is not None and len(args) == 4:  # a duck-typed pool (engine.testing.InProcessRewardPool)
            return float((await pool.score(self.reward_fn, *args, **data)).reward)
        return float(await self._wrapper(*args, **data))  # the current pool (rewards.current_reward_pool)

    def __repr__(self) -> str:
        return f"EngineReward({self.reward_fn!r})"


def swap_reward_wrappers(workflow: Any) -> int:
    """Replace each AReaL ``AsyncRewardWrapper`` among ``workflow``'s attributes by an
    :class:`EngineReward` of the same function and policy; a ``reward_fn`` given as an
    import string (RLVR loads it lazily) is imported now.  Returns how many were swapped."""
    from areal.api import AsyncRewardWrapper as ArealWrapper
    from areal.utils.dynamic_import import import_from_string

    attrs = getattr(workflow, "__dict__", {})
    if isinstance(attrs.get("reward_fn"), str) and "async_reward_fn" not in attrs:
        workflow.reward_fn = import_from_string(workflow.reward_fn)
        workflow.async_reward_fn = ArealWrapper(workflow.reward_fn)
    swapped = 0
    for name, value in list(attrs.items()):
        if isinstance(value, ArealWrapper):
            setattr(workflow, name, EngineReward(value.reward_fn, value.timeout_seconds, value.max_retries))
            swapped += 1
    return swapped


def _reward_fns(workflow: Any) -> Any:
    """The first reward function ``workflow`` holds (for the engine's one-time check)."""
    fn = getattr(workflow, "reward_fn", None)
    if callable(fn):
        return fn
    for value in getattr(workflow, "__dict__", {}).values():
        if isinstance(value, EngineReward):
            return value.reward_fn
    return None


class AReaLEpisode(RolloutWorkflow):
    """An AReaL ``RolloutWorkflow`` instance as an engine workflow (see the module docstring).

    Args:
        workflow: the AReaL workflow instance (used as is: its class is not changed).
        adapter: the ``AReaLInferenceEngine`` the workflow sees as its ``engine``.
        loop: the adapter's :class:`~._areal_bridge.AsyncioLoop`.
        is_eval: AReaL's ``workflow_context.is_eval`` for its episodes.
        cancel_grace_s: :func:`~._areal_bridge.run_bridged`'s bound on a cancelled episode.
    """

    def __init__(self, workflow: Any, adapter: Any, loop: AsyncioLoop, *, is_eval: bool = False,
                 cancel_grace_s: float = 10.0) -> None:
        self.workflow = workflow
        self.adapter = adapter
        self.loop = loop
        self.is_eval = is_eval
        self.cancel_grace_s = cancel_grace_s
        self.reward_fn = _reward_fns(workflow)  # read by the engine's reward check (rollout/prepare_batch)

    async def arun_episode(self, engine: Any, data: dict[str, Any]) -> Any:
        traj = await run_bridged(self.loop, self._run, engine, data, episode_id.get(),
                                 cancel_grace_s=self.cancel_grace_s)
        return to_engine_trajectory(traj)

    async def _run(self, engine: Any, data: dict[str, Any], task_id: int | None) -> Any:  # asyncio
        from areal.experimental.openai.types import InteractionWithTokenLogpReward
        from areal.infra import workflow_context
        from areal.infra.workflow_context import WorkflowContext
        from areal.utils import perf_tracer
        from areal.utils.data import concat_padded_tensors

        EPISODE_ENGINE.set(engine)
        if task_id is not None:
            perf_tracer.set_task_id(task_id)
        workflow_context.set(WorkflowContext(is_eval=self.is_eval, task_id=task_id))
        traj = await self.workflow.arun_episode(self.adapter, data)
        if isinstance(traj, dict) and traj and all(isinstance(v, InteractionWithTokenLogpReward)
                                                   for v in traj.values()):
            if not all(v.has_tensor_data for v in traj.values()):
                raise WorkflowError("an AReaL workflow returned interactions without token data "
                                    "(an external API's); this adapter trains on token data only")
            traj = concat_padded_tensors([v.to_tensor_dict() for v in traj.values()])  # AReaL's executor
        return traj

    def __repr__(self) -> str:
        return f"AReaLEpisode({type(self.workflow).__name__})"


class AgentEpisode(RolloutWorkflow):
    """An agent (``async run(data, **extra_kwargs)``) as an engine workflow (see the module docstring).

    Args:
        agent: the agent instance.
        loop: the adapter's asyncio loop.
        tokenizer: the policy's tokenizer (chat template).
        gconfig: base sampling parameters of the agent's completions (ours).
        turn_discount, export_style: AReaL's ``AgentConfig`` fields of the same names.
        tool_parser: :func:`engine.openai.resolve_tool_parser` spec (AReaL's ``tool_call_parser``).
    """

    def __init__(self, agent: Any, loop: AsyncioLoop, *, tokenizer: Any, gconfig: Any, turn_discount: float = 1.0,
                 export_style: str = "individual", tool_parser: Any = "qwen", is_eval: bool = False,
                 cancel_grace_s: float = 10.0) -> None:
        if tokenizer is None:
            raise InvalidRequestError("an agent workflow needs the policy's tokenizer: set "
                                      "InferenceEngineConfig.tokenizer_path or pass tokenizer= to the adapter")
        self.agent, self.loop, self.tokenizer, self.gconfig = agent, loop, tokenizer, gconfig
        self.turn_discount, self.export_style, self.tool_parser = turn_discount, export_style, tool_parser
        self.is_eval, self.cancel_grace_s = is_eval, cancel_grace_s
        self.reward_fn = _reward_fns(agent)  # read by the engine's reward check (rollout/prepare_batch)

    async def arun_episode(self, engine: Any, data: dict[str, Any]) -> Any:
        from ..openai import EngineOpenAI

        client = EngineOpenAI(engine, self.tokenizer, gconfig=self.gconfig, tool_parser=self.tool_parser)
        routes = _OpenAIRoutes(client)
        try:
            rewards = await run_bridged(self.loop, self._run, data, routes, episode_id.get(),
                                        cancel_grace_s=self.cancel_grace_s)
        except Exception as exc:
            if routes.error is not None:  # a completion failed under the agent's SDK call: that is the cause
                raise routes.error from exc
            raise
        cache = client.cache
        if not len(cache):
            return None
        if isinstance(rewards, dict):
            for completion_id, reward in rewards.items():
                cache.set_reward(completion_id, reward)
        elif isinstance(rewards, (int, float)) and not isinstance(rewards, bool):
            cache.set_last_reward(float(rewards))
        elif rewards is not None:
            raise WorkflowError(f"agent {type(self.agent).__name__}.run returned {type(rewards).__name__}; expected "
                                "the reward (a number) or a dict of completion id -> reward")
        cache.apply_reward_discount(self.turn_discount)
        return to_engine_trajectory(_areal_rows(cache.export_interactions(self.export_style)))

    async def _run(self, data: dict[str, Any], routes: _OpenAIRoutes, task_id: int | None) -> Any:  # asyncio
        from areal.infra import workflow_context
        from areal.infra.workflow_context import WorkflowContext

        workflow_context.set(WorkflowContext(is_eval=self.is_eval, task_id=task_id))
        async with httpx.AsyncClient(transport=_InProcessTransport(routes), base_url=AGENT_BASE_URL) as http:
            return await self.agent.run(data, base_url=AGENT_BASE_URL, api_key="trio-rollout", http_client=http)

    def __repr__(self) -> str:
        return f"AgentEpisode({type(self.agent).__name__})"


def _areal_rows(interactions: dict[str, Any]) -> dict[str, Any] | None:
    """Our interactions as AReaL's executor makes rows of them: one per interaction
    (``InteractionWithTokenLogpReward.to_tensor_dict``: int64 ids/masks/versions, float32
    logprobs, bool attention, float32 reward), concatenated with AReaL's padding."""
    import torch
    from areal.utils.data import concat_padded_tensors

    rows = []
    for node in interactions.values():
        row = node.to_trajectory()
        rows.append({"input_ids": row["input_ids"].to(torch.int64), "loss_mask": row["loss_mask"].to(torch.int64),
                     "logprobs": row["logprobs"].to(torch.float32), "versions": row["versions"].to(torch.int64),
                     "attention_mask": row["attention_mask"].to(torch.bool),
                     "rewards": row["rewards"].to(torch.float32)})
    return concat_padded_tensors(rows) if rows else None


class _OpenAIRoutes:
    """The OpenAI routes an agent's SDK calls, answered by one episode's :class:`EngineOpenAI`
    (trio side).  A bad request is answered 400; any other error is kept (:attr:`error`, the
    first) and answered 502 (a backend's) or 500, so the agent sees an API error and, if it
    gives up, the episode fails with the engine's own error."""

    def __init__(self, client: Any) -> None:
        self.client = client
        self.error: BaseException | None = None

    async def handle(self, method: str, path: str, body: bytes) -> tuple[int, dict[str, Any]]:  # trio
        try:
            params = json.loads(body) if body else {}  # the SDK's body: create()'s keywords
            if method == "GET" and path.endswith("/models"):
                return 200, {"object": "list", "data": [{"id": self.client.model, "object": "model",
                                                          "owned_by": "trio-rollout"}]}
            if method == "POST" and path.endswith("/chat/completions"):
                return 200, (await self.client.create_chat_completion(**params)).model_dump(mode="json")
            if method == "POST" and path.endswith("/completions"):
                return 200, (await self.client.create_completion(**params)).model_dump(mode="json")
            return 404, _error(f"no route {method} {path} (trio-rollout answers /models, /chat/completions, "
                               "/completions)", "not_found")
        except (InvalidRequestError, NotImplementedError, TypeError, ValueError) as exc:
            return 400, _error(f"{type(exc).__name__}: {exc}", "invalid_request_error")
        except Exception as exc:
            self.error = self.error or exc
            backend = isinstance(exc, BackendError)
            return (502 if backend else 500), _error(f"{type(exc).__name__}: {exc}",
                                                      "backend_error" if backend else "server_error")


def _error(message: str, kind: str) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "code": kind}}


class _InProcessTransport(httpx.AsyncBaseTransport):
    """An httpx transport (asyncio side) that hands each request to :class:`_OpenAIRoutes` in
    the episode's trio task; no socket."""

    def __init__(self, routes: _OpenAIRoutes) -> None:
        self._routes = routes

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        body = await request.aread()
        status, payload = await call_trio(self._routes.handle, request.method, request.url.path, body)
        return httpx.Response(status, json=payload, request=request)

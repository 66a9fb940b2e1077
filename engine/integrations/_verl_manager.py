"""The engine as verl's agent-loop manager: ``generate_sequences(DataProto) -> DataProto``.

verl 0.9.1's trainer loads ``actor_rollout_ref.rollout.agent.agent_loop_manager_class``
(``verl/trainer/ppo/ray_trainer.py``, ``init_workers``), builds it with
``Cls.create(config=, llm_client=, teacher_client=, reward_loop_worker_handles=)`` and calls
``generate_sequences(gen_batch)`` each step (synchronously: verl's ``auto_await`` runs the
coroutine).  :class:`TrioAgentLoopManager` is that class.  It runs verl's **own**
``AgentLoopWorker`` in this process (verl's manager puts workers in Ray actors, which
would need the engine pickled into them), with :class:`TrioLLMServerClient` as its
``llm_client``: verl's agent loops (``agent_name`` per row, ``default_agent_loop``
otherwise), verl's per-sample post-processing (``_agent_loop_postprocess``: left-padded
``prompts``, right-padded ``responses`` / ``response_mask`` / ``rollout_log_probs``,
``position_ids`` from the attention mask, the streaming reward) and verl's batch assembly
(``_postprocess``), then ``meta_info["timing"]`` as verl's manager computes it.

Failures keep rows aligned: one sample's agent loop that raises (a backend request, a tool
that escapes the loop's own handling, a streaming reward) runs again from its start, up to
``TrioVerlSettings.max_attempts`` runs; after that ``generate_sequences`` raises
:class:`AgentLoopFailedError` naming the row (never a short or shifted batch).
:class:`~engine.errors.InvalidRequestError` (a configuration mistake) is not retried.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import numpy as np
from verl.experimental.agent_loop import AgentLoopManager, AgentLoopWorker
from verl.protocol import DataProto
from verl.utils.ray_utils import auto_await
from verl.utils.skip import SkipManager

from ..errors import InvalidRequestError, RolloutError
from ._verl_client import TrioLLMServerClient, as_asyncio_engine
from . import _verl_weights  # noqa: F401  (registers the "trio" checkpoint backend and rollout name)
from ._verl_sampling import ENGINES, EngineEntry, TrioVerlSettings

__all__ = ["AgentLoopFailedError", "TrioAgentLoopManager", "TrioAgentLoopWorker"]

logger = logging.getLogger(f"rollout.{__name__}")


class AgentLoopFailedError(RolloutError):
    """One row's agent loop raised on each of its ``max_attempts`` runs; the message names
    the row (position in the batch, dataset ``index``, rollout number) and the last error,
    which is chained as ``__cause__``."""


class TrioAgentLoopWorker(AgentLoopWorker):
    """verl's ``AgentLoopWorker``, in-process, whose per-row ``_run_agent_loop`` runs again
    when it raises (see the module docstring).  Everything else is verl's."""

    def __init__(self, config: Any, llm_client: Any, teacher_client: Any = None,
                 reward_loop_worker_handles: Any = None, *, max_attempts: int = 3) -> None:
        super().__init__(config, llm_client, teacher_client, reward_loop_worker_handles)
        self.max_attempts = max_attempts
        self.reruns = 0

    async def _run_agent_loop(self, sampling_params: dict[str, Any], trajectory: dict[str, Any], *,
                              agent_name: str, trace: bool = True, **kwargs: Any) -> Any:
        for attempt in range(1, self.max_attempts + 1):
            try:
                return await super()._run_agent_loop(sampling_params, trajectory, agent_name=agent_name,
                                                     trace=trace, **kwargs)
            except (asyncio.CancelledError, InvalidRequestError):
                raise
            except Exception as exc:
                where = (f"row with index {trajectory.get('sample_index')} (rollout {trajectory.get('rollout_n')}, "
                         f"agent {agent_name!r})")
                if attempt == self.max_attempts:
                    raise AgentLoopFailedError(
                        f"verl adapter: the agent loop of the {where} failed {attempt} time(s); last error: "
                        f"{type(exc).__name__}: {exc}") from exc
                self.reruns += 1
                logger.warning("verl adapter: the agent loop of the %s failed (attempt %d of %d), running it "
                               "again: %s: %s", where, attempt, self.max_attempts, type(exc).__name__, exc)
        raise AssertionError("unreachable")  # pragma: no cover


def _check_config(config: Any) -> None:
    """What this adapter cannot honour, one line each (the field and the fix)."""
    rollout = config.actor_rollout_ref.rollout
    mode = rollout.get("logprobs_mode", "processed_logprobs")
    if mode not in (None, "processed_logprobs"):
        raise InvalidRequestError(
            f"actor_rollout_ref.rollout.logprobs_mode={mode!r}: trio-rollout's logprobs are those of the distribution "
            "it sampled (after temperature/top-k/top-p): use processed_logprobs")
    distillation = config.get("distillation")
    if distillation is not None and distillation.get("enabled", False):
        raise InvalidRequestError("distillation.enabled=True: teacher logprobs through trio-rollout are not supported "
                                  "yet; disable distillation or use verl's own rollout")


def _build_engine(config: Any, settings: TrioVerlSettings) -> Any:
    """The engine ``settings.engine`` names (a factory called with verl's config), or the
    built-in one: the ``hf`` backend on ``actor_rollout_ref.model.path``."""
    if settings.engine:
        from engine.imports import import_object

        factory = import_object(settings.engine, error=InvalidRequestError, what="trio_rollout.engine")
        return factory(config)
    from transformers import AutoTokenizer

    from engine.backends.hf import HFBackend
    from engine.executor import EngineConfig
    from engine.sync import RolloutEngineThread

    path = str(config.actor_rollout_ref.model.path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    backend = HFBackend(path, tokenizer, device=settings.device, dtype=settings.dtype)
    return RolloutEngineThread(backend, EngineConfig()).start()


class TrioAgentLoopManager(AgentLoopManager):
    """verl's ``agent_loop_manager_class`` over a trio-rollout engine (module docstring).

    Args:
        config: verl's whole trainer config (``DictConfig``).
        llm_client, teacher_client: verl's (unused: generation goes to the engine; a teacher
            is refused by the config check).
        reward_loop_worker_handles: verl's streaming reward workers (Ray actor handles),
            passed to verl's worker unchanged (``None``: the trainer scores later).
        engine: the engine to use (a started :class:`engine.RolloutEngineThread` or an
            :class:`engine.aio.AsyncioEngine`); None: build it from
            ``actor_rollout_ref.rollout.custom.trio_rollout`` (:class:`TrioVerlSettings`).

    The engine is registered under ``settings.engine_name`` for
    :class:`TrioCheckpointManager` (the trainer's weight updates) in this process.

    Raises (construction): ``ValueError`` / :class:`~engine.errors.InvalidRequestError`
    naming the config field (unknown ``trio_rollout`` key, ``logprobs_mode``,
    distillation).  From ``generate_sequences``: :class:`AgentLoopFailedError`, and verl's
    own errors.
    """

    def __init__(self, config: Any, llm_client: Any = None, teacher_client: Any = None,
                 reward_loop_worker_handles: Any = None, *, engine: Any = None) -> None:
        super().__init__(config, llm_client, teacher_client, reward_loop_worker_handles)
        _check_config(config)
        self.settings = TrioVerlSettings.from_custom(config.actor_rollout_ref.rollout.get("custom"))
        self._owned = engine is None
        self._thread = engine if engine is not None else _build_engine(config, self.settings)
        self.engine = as_asyncio_engine(self._thread)
        self.client = TrioLLMServerClient(config, self.engine, self.settings)
        ENGINES[self.settings.engine_name] = EngineEntry(engine=self.engine,
                                                         model_path=str(config.actor_rollout_ref.model.path))

    @classmethod
    @auto_await
    async def create(cls, *args: Any, engine: Any = None, **kwargs: Any) -> TrioAgentLoopManager:
        """verl's constructor protocol (``AgentLoopManager.create``): the instance, with its
        in-process worker."""
        instance = cls(*args, engine=engine, **kwargs)
        await instance._init_agent_loop_workers()
        return instance

    async def _init_agent_loop_workers(self) -> None:
        self.agent_loop_workers = [TrioAgentLoopWorker(self.config, self.client, self.teacher_client,
                                                       self.reward_loop_worker_handles,
                                                       max_attempts=self.settings.max_attempts)]

    @property
    def reruns(self) -> int:
        """Agent-loop runs repeated after a failure, so far."""
        return sum(w.reruns for w in self.agent_loop_workers)

    @auto_await
    @SkipManager.annotate(role="rollout")
    async def generate_sequences(self, prompts: DataProto) -> DataProto:
        """One row out per row in, in order (see the module docstring).

        Args:
            prompts: verl's generation batch: ``non_tensor_batch`` with ``raw_prompt`` (the
                messages), optionally ``agent_name``, ``index``, ``tools_kwargs``,
                ``extra_info`` and the reward columns; ``meta_info`` ``global_steps`` /
                ``validate``.

        Returns:
            verl's ``DataProto``: ``prompts [B, prompt_length]`` (left-padded),
            ``responses`` / ``response_mask`` / ``rollout_log_probs`` (float32, when
            ``calculate_log_probs``) ``[B, response_length]`` (right-padded, 0),
            ``input_ids`` / ``attention_mask`` / ``position_ids [B, P+R]`` (int64),
            ``rm_scores`` when the streaming reward ran; ``non_tensor_batch`` with the
            input columns, ``__num_turns__``, ``min_global_steps`` / ``max_global_steps``;
            ``meta_info["timing"]``.
        """
        if "priority" not in prompts.non_tensor_batch:  # as verl's manager (vLLM request priority)
            prompts.non_tensor_batch["priority"] = np.arange(len(prompts), dtype=np.int64)
        output = await self.agent_loop_workers[0].generate_sequences(prompts)
        metrics = output.meta_info.pop("metrics")
        timing = self._performance_metrics([metrics], output)
        output.meta_info = {"timing": timing, **output.meta_info}
        return output

    def close(self) -> None:
        """Close the engine if this manager built it (verl's trainer never calls this: the
        engine thread ends with the process)."""
        if self._owned:
            self._thread.close()
        entry = ENGINES.get(self.settings.engine_name)
        if entry is not None and entry.engine is self.engine:
            del ENGINES[self.settings.engine_name]

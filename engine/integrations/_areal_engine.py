"""``AReaLInferenceEngine``: AReaL 1.0.4's ``InferenceEngine`` over trio-rollout's engine.

Imports AReaL: reached only through :mod:`engine.integrations.areal`'s lazy names.  See that
module for what runs where; here, method by method, what AReaL's API maps to:

=================================  ===========================================================
AReaL                              here
=================================  ===========================================================
``initialize(train_data_parallel  the engine (:class:`engine.RolloutEngineThread`) with C, B, eta
_size=dp)``                        from the config divided by ``dp`` (AReaL's executor), and the
                                   asyncio loop of the workflows
``submit`` / ``wait`` /            ``engine.submit`` / ``wait_results`` / ``wait_for_task``; a
``wait_for_task``                  record that is not accepted is ``None``; ids never submitted
                                   or consumed: ``ValueError("... never submitted")``
``rollout_batch`` /                the engine's (reward check, failure breaker, run-ahead
``prepare_batch``                  pipeline), cut into AReaL's per-group dicts
``pause`` / ``resume``,            two independent reasons to hold the engine (no new episodes,
``pause_generation`` /             no new generation segments): it runs when neither holds
``continue_generation``
``update_weights_from_disk``       AReaL's handshake, then ``engine.update_weights(meta.path)``
``staleness_manager``,             views of the engine's admission (``on_version_recovered`` =
``workflow_executor``              ``engine.restore``)
``export_stats``                   AReaL's ``stats_tracker`` (what workflows recorded) plus the
                                   engine's counters under ``trio_rollout/``
=================================  ===========================================================
"""

from __future__ import annotations

import dataclasses
import logging
import shutil
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from areal.api import ModelResponse as ArealModelResponse
from areal.api import RolloutStat, RolloutWorkflow as ArealRolloutWorkflow
from areal.api.engine_api import InferenceEngine
from areal.utils import name_resolve, names, stats_tracker
from areal.utils.dynamic_import import import_from_string

from ..aio import AsyncioEngine
from ..backends.base import InferenceBackend
from ..errors import InvalidRequestError
from ..sync import RolloutEngineThread
from ._areal_bridge import AsyncioLoop, current_bridge
from ._areal_convert import from_engine_response, to_areal_groups, to_engine_request
from ._areal_episodes import EPISODE_ENGINE, AReaLEpisode, AgentEpisode, swap_reward_wrappers
from ._areal_options import AReaLEngineOptions

__all__ = ["AReaLInferenceEngine"]

logger = logging.getLogger(f"rollout.{__name__}")


class _StalenessView:
    """AReaL's ``StalenessManager`` surface over the engine's admission (read-only but for
    ``on_version_recovered``)."""

    def __init__(self, adapter: AReaLInferenceEngine) -> None:
        self._adapter = adapter

    @property
    def _config(self) -> Any:
        return self._adapter._engine_config

    @property
    def max_concurrent_rollouts(self) -> int:
        return int(self._config.max_concurrent_rollouts)

    @property
    def consumer_batch_size(self) -> int:
        return int(self._config.consumer_batch_size)

    @property
    def max_staleness(self) -> int | None:
        return self._config.max_head_offpolicyness

    def get_pending_limit(self) -> int:
        eta = self.max_staleness
        return (0 if eta is None else eta + 1) * self.consumer_batch_size

    def get_capacity(self) -> int:
        return int(self._adapter._engine.statistics().capacity)

    def get_stats(self) -> RolloutStat:
        """Lifetime counts (``accepted`` is not reset by a recovery, unlike AReaL's counter;
        ``rejected`` includes failed episodes, which AReaL counts as rejected)."""
        s = self._adapter._engine.statistics()
        return RolloutStat(accepted=s.accepted, enqueued=s.queued, rejected=s.rejected + s.failed, running=s.running)

    def on_version_recovered(self, version: int) -> None:
        """After a checkpoint recovery at ``version``: ``accepted = version * B`` and the
        engine's version (AReaL issue #1388), :meth:`engine.RolloutEngine.restore`."""
        self._adapter._engine.restore(int(version))


class _ExecutorView:
    """What AReaL's trainer reads of ``rollout.workflow_executor`` (SPMD mode)."""

    def __init__(self, adapter: AReaLInferenceEngine) -> None:
        self._adapter = adapter
        self.staleness_manager = adapter.staleness_manager

    def is_paused(self) -> bool:
        return bool(self._adapter._holds)

    def get_capacity(self) -> int:
        return self.staleness_manager.get_capacity()


class AReaLInferenceEngine(InferenceEngine):
    """AReaL's ``InferenceEngine`` on trio-rollout's engine (see the module docstrings).

    Args:
        config: AReaL's ``InferenceEngineConfig`` (``consumer_batch_size``,
            ``max_concurrent_rollouts``, ``max_head_offpolicyness``, ``experiment_name`` /
            ``trial_name`` for the weight-update handshake, ``tokenizer_path``, ``agent``).
        backend: the inference backend (an :class:`engine.InferenceBackend`: ``HFBackend``,
            a remote SGLang/vLLM backend, ...), or a zero-argument callable building one at
            ``initialize``.
        options: :class:`~engine.integrations.areal.AReaLEngineOptions`.

    Raises (from ``initialize``):
        InvalidRequestError: no backend was given.
        RuntimeError: the engine did not start (its cause attached).
    """

    def __init__(self, config: Any, backend: InferenceBackend | Callable[[], InferenceBackend] | None = None, *,
                 options: AReaLEngineOptions | None = None) -> None:
        self.config = config
        self.options = options or AReaLEngineOptions()
        self._backend_spec = backend
        self._engine: Any = None  # RolloutEngineThread
        self._aio: AsyncioEngine | None = None
        self._loop: AsyncioLoop | None = None
        self._engine_config: Any = None
        self._holds: set[str] = set()  # "submission" (pause), "generation" (pause_generation)
        self._hold_lock = threading.Lock()
        self._submitted = threading.Condition()  # notified on each submit (wait for more than is pending)
        self._workflows: dict[tuple[Any, ...], tuple[Any, Any]] = {}  # spec key -> (kwargs, episode workflow)
        self._followers: list[AReaLInferenceEngine] = []
        self._updates: ThreadPoolExecutor | None = None
        self._tokenizer = self.options.tokenizer
        self.staleness_manager = _StalenessView(self)

    # -- lifecycle ---------------------------------------------------------------------------
    def initialize(self, engine_id: str | None = None, addr: str | list[str] | None = None,
                   train_data_parallel_size: int | None = None) -> None:
        """Start the engine and the workflows' asyncio loop (``engine_id`` and ``addr``, AReaL's
        server discovery, are unused: the backend was given to the constructor).

        Raises:
            RuntimeError: called twice, or the engine did not start (cause attached).
            InvalidRequestError: no backend was given.
        """
        if self._engine is not None:
            raise RuntimeError("AReaLInferenceEngine.initialize() called twice")
        spec = self._backend_spec
        if spec is None:
            raise InvalidRequestError("AReaLInferenceEngine needs backend= (an engine.InferenceBackend such as "
                                      "HFBackend(model_dir), or a callable building one)")
        backend = spec if isinstance(spec, InferenceBackend) else spec()
        self._engine_config = self._build_engine_config(train_data_parallel_size)
        self._loop = AsyncioLoop(name="areal-workflows").start()
        try:
            self._engine = RolloutEngineThread(backend, self._engine_config,
                                               start_timeout_s=self.options.start_timeout_s).start()
        except BaseException:
            self._loop.close(self.options.close_timeout_s)
            raise
        self._aio = AsyncioEngine(self._engine, cancel_grace_s=self.options.cancel_grace_s)
        self._updates = ThreadPoolExecutor(max_workers=1, thread_name_prefix="areal-weight-update")

    def _build_engine_config(self, dp: int | None) -> Any:
        from .._config import EngineConfig

        if dp is None:
            import torch.distributed as dist

            dp = dist.get_world_size() if dist.is_initialized() else 1
        c = self.config
        base = self.options.engine_config or EngineConfig(staleness_policy="flag", drop_incomplete_group=True)
        concurrent = c.max_concurrent_rollouts or c.consumer_batch_size
        return dataclasses.replace(base, max_concurrent_rollouts=max(1, concurrent // dp),
                                   consumer_batch_size=max(1, c.consumer_batch_size // dp),
                                   max_head_offpolicyness=c.max_head_offpolicyness)

    def destroy(self) -> None:
        """Cancel what is running (recorded as failed, ``cancelled``), stop the engine, the
        asyncio loop and the weight-update thread.  Idempotent."""
        engine, self._engine = self._engine, None
        try:
            if engine is not None:
                engine.close()
        finally:
            if self._loop is not None:
                self._loop.close(self.options.close_timeout_s)
            if self._updates is not None:
                self._updates.shutdown(wait=True)

    @property
    def initialized(self) -> bool:
        return self._engine is not None

    @property
    def workflow_executor(self) -> _ExecutorView:
        self._running()
        return _ExecutorView(self)

    def _running(self) -> RolloutEngineThread:
        if self._engine is None:
            raise RuntimeError("AReaLInferenceEngine is not initialized (call initialize())")
        return self._engine

    # -- generation ----------------------------------------------------------------------------
    async def agenerate(self, req: Any) -> Any:
        """AReaL's ``agenerate``: one generation, AReaL's ``ModelRequest`` in, its
        ``ModelResponse`` out (tokens, per-token logprobs and versions, stop reason).  Inside
        an episode of this engine the call runs in the episode's trio task; elsewhere (your
        own asyncio code) as a task of the engine (:class:`engine.aio.AsyncioEngine`).

        Raises:
            InvalidRequestError: ``n_samples != 1``, no token budget, beam search, ... (a ValueError).
            BackendError: the backend failed.
        """
        ours = to_engine_request(req)
        engine, bridge = EPISODE_ENGINE.get(), current_bridge()
        if engine is not None and bridge is not None:
            resp = await bridge.call(engine.agenerate, ours)
        else:
            self._running()
            assert self._aio is not None
            resp = await self._aio.agenerate(ours)
        return from_engine_response(resp, req, ArealModelResponse)

    # -- workflows -------------------------------------------------------------------------------
    def _episode_workflow(self, workflow: Any, workflow_kwargs: dict[str, Any] | None, is_eval: bool) -> Any:
        """AReaL's ``WorkflowLike`` (``RemoteInfEngine._resolve_workflow``'s cases) as the engine
        workflow that runs it; a class or import string given again with the same kwargs
        object reuses the instance built the first time (AReaL builds one per call)."""
        if workflow is None:
            raise ValueError("workflow must be specified (AReaL's online agent mode is not supported)")
        if isinstance(workflow, (str, type)):
            key = (workflow, id(workflow_kwargs), is_eval)
            cached = self._workflows.get(key)
            if cached is not None and cached[0] is workflow_kwargs:
                return cached[1]
            episode = self._wrap(self._instance(workflow, workflow_kwargs), is_eval)
            self._workflows[key] = (workflow_kwargs, episode)
            return episode
        if workflow_kwargs is not None:
            logger.warning("workflow_kwargs is ignored when workflow is already an instance")
        return self._wrap(workflow, is_eval)

    @staticmethod
    def _instance(spec: Any, kwargs: dict[str, Any] | None) -> Any:
        obj = spec
        if isinstance(spec, str):
            try:
                obj = import_from_string(spec)
            except (ValueError, ImportError, AttributeError) as exc:
                raise ValueError(f"Failed to import workflow from string {spec!r}: {exc}") from exc
        if isinstance(obj, type):
            if issubclass(obj, ArealRolloutWorkflow) and kwargs is None:
                raise ValueError(f"workflow_kwargs is required when workflow is a class or string. "
                                 f"Got workflow={spec}, but workflow_kwargs=None.")
            return obj(**(kwargs or {}))
        return obj

    def _wrap(self, workflow: Any, is_eval: bool) -> Any:
        opts = self.options
        if opts.engine_reward_pool:
            swap_reward_wrappers(workflow)
        if isinstance(workflow, ArealRolloutWorkflow) or _has_coroutine(workflow, "arun_episode"):
            return AReaLEpisode(workflow, self, self._require_loop(), is_eval=is_eval,
                                cancel_grace_s=opts.cancel_grace_s)
        if _has_coroutine(workflow, "run"):
            agent = getattr(self.config, "agent", None)
            return AgentEpisode(workflow, self._require_loop(), tokenizer=self._agent_tokenizer(),
                                gconfig=opts.agent_gconfig, turn_discount=getattr(agent, "turn_discount", 1.0),
                                export_style=getattr(agent, "export_style", "individual"),
                                tool_parser=getattr(agent, "tool_call_parser", "qwen"), is_eval=is_eval,
                                cancel_grace_s=opts.cancel_grace_s)
        raise ValueError(f"workflow {workflow!r} is neither an AReaL RolloutWorkflow nor an agent with "
                         "async run(data, **extra_kwargs)")

    def _require_loop(self) -> AsyncioLoop:
        self._running()
        assert self._loop is not None
        return self._loop

    def _agent_tokenizer(self) -> Any:
        if self._tokenizer is None and getattr(self.config, "tokenizer_path", None):
            from areal.utils.hf_utils import load_hf_tokenizer

            self._tokenizer = load_hf_tokenizer(self.config.tokenizer_path)
        return self._tokenizer

    @staticmethod
    def _filter(should_accept_fn: Any) -> Callable[[Any], bool] | None:
        """AReaL's ``should_accept_fn`` (a callable or an import string) on the engine's
        ``TensorDict``: it sees the AReaL dict."""
        fn = should_accept_fn
        if fn is None:
            return None
        if isinstance(fn, str):
            try:
                fn = import_from_string(fn)
            except (ValueError, ImportError, AttributeError) as exc:
                raise ValueError(f"Failed to import should_accept_fn from string {should_accept_fn!r}: {exc}") from exc
        if not callable(fn):
            raise TypeError(f"should_accept_fn {should_accept_fn!r} is not callable")

        def accept(td: Any) -> bool:
            return bool(fn(to_areal_groups(td)[0]))

        return accept

    def _groups(self, td: Any) -> list[dict[str, Any]]:
        return to_areal_groups(td, keep_engine_keys=self.options.keep_engine_keys)

    # -- submission and results ------------------------------------------------------------------
    def submit(self, data: dict[str, Any], workflow: Any, workflow_kwargs: dict[str, Any] | None = None,
               should_accept_fn: Any = None, group_size: int = 1, task_id: int | None = None,
               callback_addr: str | None = None, is_eval: bool = False, proxy_addr: str | None = None) -> int:
        """Enqueue one episode (a group of ``group_size`` runs of the workflow on ``data``);
        returns its task id at once.  ``proxy_addr`` is unused (agents run in-process).

        Raises:
            NotImplementedError: ``callback_addr`` (AReaL's single-controller callbacks).
            ValueError: the workflow cannot be resolved, ``group_size < 1``, a used ``task_id``.
        """
        if callback_addr:
            raise NotImplementedError("submit(callback_addr=...) is AReaL's single-controller mode; "
                                      "this adapter runs in SPMD mode (wait/wait_for_task instead)")
        engine = self._running()
        episode = self._episode_workflow(workflow, workflow_kwargs, is_eval)
        task = int(engine.submit(data, episode, None, self._filter(should_accept_fn), group_size, task_id))
        with self._submitted:
            self._submitted.notify_all()
        return task

    def wait(self, count: int, timeout: float | None = None, raise_timeout: bool = True) -> list[dict[str, Any] | None]:
        """``count`` ended episodes, oldest first: AReaL's dict for an accepted one, ``None``
        for a rejected or failed one (the reason is in the engine's statistics).

        More than are pending now: with a ``timeout``, episodes submitted meanwhile count
        (AReaL's semantics: it raises ``TimeoutError`` when not enough ended in time); without
        one, ``ValueError`` at once (AReaL would wait its default of 7 days).

        Raises:
            ValueError: ``count <= 0``; more than could end and no ``timeout``.
            TimeoutError: ``timeout`` passed (nothing consumed); with ``raise_timeout=False`` ``[]``.
        """
        if count <= 0:
            raise ValueError(f"count must be positive, got {count}")
        engine = self._running()
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                records = engine.wait_results(count, remaining)
                break
            except TimeoutError:
                if raise_timeout:
                    raise
                return []
            except ValueError:
                if remaining is None:  # more than could ever end, and nothing bounds the wait
                    raise
                if remaining <= 0:
                    if raise_timeout:
                        raise TimeoutError(f"fewer than {count} episodes ended within {timeout} s (fewer were "
                                           "submitted)") from None
                    return []
                with self._submitted:  # until another thread submits (then ask again), or the deadline
                    self._submitted.wait(remaining)
        return [self._groups(r.trajectory)[0] if _accepted(r) else None for r in records]

    def wait_for_task(self, task_id: int, timeout: float | None = None,
                      raise_timeout: bool = True) -> dict[str, Any] | None:
        """One episode's dict (``None``: rejected or failed, or the timeout passed with
        ``raise_timeout=False``).

        Raises:
            ValueError: ``task_id`` was never submitted or is already consumed.
            TimeoutError: ``timeout`` passed (the record stays).
        """
        engine = self._running()
        try:
            record = engine.wait_for_task(task_id, timeout)
        except TimeoutError:
            if raise_timeout:
                raise
            return None
        except ValueError as exc:
            raise ValueError(f"Task {task_id} is never submitted, or was already consumed ({exc})") from None
        return self._groups(record.trajectory)[0] if _accepted(record) else None

    def rollout_batch(self, data: list[dict[str, Any]], workflow: Any, workflow_kwargs: dict[str, Any] | None = None,
                      group_size: int = 1) -> list[dict[str, Any]]:
        """Submit every item, wait for all; the accepted groups' dicts in submission order
        (``[]`` when all were rejected, as AReaL).

        Raises:
            EpisodeFailuresError: none was accepted and some failed (**ours**: AReaL returns
                ``[]``, and its trainer fails later on a ``KeyError``); the message names the
                counts by reason and the first failures.  Or the engine's failure breaker opened.
        """
        if workflow is None:
            raise ValueError("Workflow must be specified for rollout_batch.")
        episode = self._episode_workflow(workflow, workflow_kwargs, False)
        return self._groups(self._running().rollout_batch(list(data), episode, group_size=group_size))

    def prepare_batch(self, dataloader: Any, workflow: Any, workflow_kwargs: dict[str, Any] | None = None,
                      should_accept_fn: Any = None, group_size: int = 1,
                      dynamic_bs: bool = False) -> list[dict[str, Any]]:
        """AReaL's asynchronous path on the engine's run-ahead pipeline: once ``B`` accepted
        groups are ready (``dynamic_bs``: once ``B`` ended), their dicts, oldest first.
        ``B`` is the consumer batch size, which must equal the dataloader's batch size
        (AReaL counts the one, bounds staleness with the other).

        Raises:
            ValueError: the dataloader's ``batch_size`` differs from ``B``.
            EpisodeFailuresError: recent episodes all failed (the engine's failure breaker),
                or (``dynamic_bs``) the ended groups hold none accepted and some failed.
        """
        if workflow is None:
            raise ValueError("Workflow must be specified for prepare_batch.")
        engine = self._running()
        size = getattr(dataloader, "batch_size", None)
        B = self._engine_config.consumer_batch_size
        if size is not None and size != B:
            raise ValueError(f"prepare_batch: the dataloader's batch_size is {size} but the consumer batch size "
                             f"is {B} (InferenceEngineConfig.consumer_batch_size / data-parallel size); AReaL "
                             "returns batch_size groups and bounds staleness by consumer_batch_size: set them equal")
        episode = self._episode_workflow(workflow, workflow_kwargs, False)
        batch = engine.prepare_batch(dataloader, episode, should_accept_fn=self._filter(should_accept_fn),
                                     group_size=group_size, dynamic_bs=dynamic_bs)
        return self._groups(batch)

    # -- pause, versions ----------------------------------------------------------------------------
    def _hold(self, reason: str, on: bool) -> None:
        with self._hold_lock:
            before = bool(self._holds)
            (self._holds.add if on else self._holds.discard)(reason)
            after = bool(self._holds)
            if before != after:
                (self._running().pause if after else self._running().resume)()

    def pause(self) -> None:
        """No new episodes or generation segments until :meth:`resume` (AReaL: submission)."""
        self._hold("submission", True)

    def resume(self) -> None:
        self._hold("submission", False)

    def pause_generation(self) -> None:
        """No new generation segments until :meth:`continue_generation` (around weight updates;
        independent of :meth:`pause`)."""
        self._hold("generation", True)

    def continue_generation(self) -> None:
        self._hold("generation", False)

    def set_version(self, version: int) -> None:
        self._running().set_version(int(version))

    def get_version(self) -> int:
        return int(self._running().version)

    # -- weights -------------------------------------------------------------------------------------
    def follow(self, leader: AReaLInferenceEngine) -> None:
        """Load every weight update ``leader`` loads (an evaluation engine next to the training
        one: AReaL's trainer updates only ``rollout``; in-process backends hold their own copy)."""
        leader._followers.append(self)

    def update_weights_from_disk(self, meta: Any) -> Future[None]:
        """AReaL's disk weight update: returns at once; the future waits (up to
        ``weight_update_timeout_s``) for the trainer's name-resolve key
        ``names.update_weights_from_disk(experiment, trial, <version now>)``, which the trainer
        adds once ``meta.path`` is written, then loads that folder into the engine (and its
        followers) as ``meta.version`` (default: the current version), then removes it if
        ``meta.clear_checkpoint_after_load``.

        Raises:
            ValueError: ``meta.type`` is not ``"disk"``.
            RuntimeError: ``experiment_name`` / ``trial_name`` unset (AReaL's rule).
        The future raises: ``TimeoutError`` (no key in time), ``BackendError`` (the folder did
        not load: the old weights and version stay).
        """
        if meta.type != "disk":
            raise ValueError(f"update_weights_from_disk: meta.type must be 'disk', got {meta.type!r}")
        if self.config.experiment_name is None or self.config.trial_name is None:
            raise RuntimeError("Experiment and trial names must be set for disk-based weight updates.")
        self._running()
        assert self._updates is not None
        key = names.update_weights_from_disk(self.config.experiment_name, self.config.trial_name, self.get_version())
        version = self.get_version() if meta.version is None else int(meta.version)
        engines = [self, *self._followers]

        def load() -> None:
            name_resolve.wait(key, timeout=self.options.weight_update_timeout_s)  # the module's current repository
            for adapter in engines:
                adapter._running().update_weights(str(meta.path), version=version)
            if meta.clear_checkpoint_after_load:
                shutil.rmtree(meta.path, ignore_errors=True)
            logger.info("weights of version %s loaded from %s", version, meta.path)

        return self._updates.submit(load)

    def init_weights_update_group(self, meta: Any, rank_ids: list[int] | None = None) -> Future[None]:
        raise NotImplementedError("xccl weight updates (NCCL from the trainer to the servers) are not supported by "
                                  "this adapter: set actor.weight_update_mode=disk")

    def update_weights_from_distributed(self, meta: Any, param_specs: list[Any]) -> Future[None]:
        raise NotImplementedError("xccl weight updates are not supported by this adapter: set "
                                  "actor.weight_update_mode=disk")

    def offload(self) -> None:
        raise NotImplementedError("offload: the engine's backend keeps its model loaded; do not colocate the "
                                  "rollout with the actor (scheduling_strategy) under this adapter")

    def onload(self, tags: list[str] | None = None) -> None:
        raise NotImplementedError("onload: see offload")

    # -- statistics ----------------------------------------------------------------------------------
    def export_stats(self) -> dict[str, float]:
        """AReaL's ``stats_tracker.export_all()`` (what workflows recorded: ``rollout/reward``,
        ...) plus the engine's counters as ``trio_rollout/<name>`` (cumulative counts, the
        current version, queued/running/waiting now, and per-reason rejections/failures)."""
        stats = dict(stats_tracker.export_all(reduce_group=None))
        s = self._running().statistics()
        for name in ("submitted", "accepted", "rejected", "failed", "queued", "running", "results_waiting", "version",
                     "generated_tokens", "segments_resumed", "reward_fallbacks", "capacity"):
            stats[f"trio_rollout/{name}"] = float(getattr(s, name))
        for prefix, reasons in (("rejected", s.rejected_by_reason), ("failed", s.failed_by_reason)):
            for reason, n in reasons.items():
                stats[f"trio_rollout/{prefix}/{getattr(reason, 'value', reason)}"] = float(n)
        return stats

    def statistics(self) -> Any:
        """The engine's :class:`engine.EngineStatistics` (ours; exact reasons, counts)."""
        return self._running().statistics()


def _accepted(record: Any) -> bool:
    return getattr(record.status, "value", record.status) == "accepted" and record.trajectory is not None


def _has_coroutine(obj: Any, name: str) -> bool:
    import inspect

    return inspect.iscoroutinefunction(getattr(obj, name, None))

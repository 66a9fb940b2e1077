"""The trainer's weights into the engine: verl's weight-sync seams, filled.

verl 0.9.1 syncs weights once per step with ``checkpoint_manager.update_weights(global_steps)``
(``verl/trainer/ppo/ray_trainer.py``).  The manager class is pluggable
(``actor_rollout_ref.rollout.checkpoint_manager_class``), and so is the transfer between
the actor's workers and the rollout (``rollout.checkpoint_engine.backend``, registered with
``CheckpointEngineRegistry.register`` from ``checkpoint_engine.custom_backend_module``,
``verl/checkpoint_engine/base.py``).  The engine fills both:

* :class:`TrioCheckpointEngine` (backend ``"trio"``): on the actor's workers, verl's
  ``ActorRolloutRefWorker.update_weights`` (``verl/workers/engine_workers.py``) calls
  ``send_weights(engine.get_per_tensor_param(), global_steps)``; every rank consumes the
  generator (FSDP gathers collectively) and the master writes the tensors as
  ``<weights_dir>/step-<global_steps>/model.safetensors``.
* :class:`TrioCheckpointManager` (``checkpoint_manager_class``): in the trainer process,
  ``update_weights(global_steps)`` runs the workers' ``update_weights(mode="trio")``, adds
  the model's config and tokenizer files to the folder, and loads it into the engine with
  ``version=global_steps`` (the engine pauses, aborts in-flight generations and resumes
  them on the new weights: tokens carry the version that produced them); the previous
  step's folder is then removed.  The replica calls verl makes around it (sleep, wake up,
  abort, KV cache) are no-ops: the engine owns its own memory.

The backend also registers a rollout ``name`` ``"trio"`` (:class:`TrioReplica` in
``RolloutReplicaRegistry``; :class:`TrioRolloutAdapter` in verl's worker-side rollout
table) so that ``LLMServerManager`` launches no vLLM/SGLang server for it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
from collections.abc import AsyncGenerator, Generator
from pathlib import Path
from typing import Any

import torch
from verl.checkpoint_engine.base import CheckpointEngine, CheckpointEngineRegistry
from verl.utils.import_utils import import_external_libs
from verl.utils.ray_utils import auto_await
from verl.workers.rollout import base as _rollout_base
from verl.workers.rollout.base import BaseRollout
from verl.workers.rollout.replica import RolloutReplica, RolloutReplicaRegistry

from ..errors import InvalidRequestError
from ._verl_sampling import ENGINES

__all__ = ["BACKEND", "TrioCheckpointEngine", "TrioCheckpointManager", "TrioReplica", "TrioRolloutAdapter",
           "step_folder"]

logger = logging.getLogger(f"rollout.{__name__}")

BACKEND = "trio"
_WEIGHTS_FILE = "model.safetensors"
#: files of the model folder a weight folder needs besides the weights (config, tokenizer)
_SIDE_FILES = (".json", ".txt", ".model", ".jinja", ".tiktoken")


def step_folder(weights_dir: str | os.PathLike[str], global_steps: int | None) -> Path:
    """``<weights_dir>/step-<N>`` (``N`` = ``global_steps``, 0 when None)."""
    return Path(weights_dir) / f"step-{0 if global_steps is None else int(global_steps)}"


def _weights_dir(kwargs: dict[str, Any]) -> str:
    weights_dir = kwargs.get("weights_dir")
    if not weights_dir:
        raise InvalidRequestError(
            "actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.trio.weights_dir is not set: give a folder "
            "that the trainer's workers and the rollout engine both see")
    return str(weights_dir)


@CheckpointEngineRegistry.register(BACKEND)
class TrioCheckpointEngine(CheckpointEngine):
    """verl's ``CheckpointEngine`` for backend ``"trio"`` (actor side; see the module docstring).

    Args (verl passes ``checkpoint_engine.engine_kwargs.trio`` as keywords, plus its own):
        bucket_size, is_master: verl's (only the master writes).
        weights_dir: the shared folder (required).
        engine_name: unused here (the manager's).
    """

    def __init__(self, bucket_size: int = 0, is_master: bool = False, weights_dir: str | None = None,
                 engine_name: str = "default", **_: Any) -> None:
        self.weights_dir = _weights_dir({"weights_dir": weights_dir})
        self.is_master = is_master
        self.bucket_size = bucket_size

    def prepare(self) -> dict[str, Any]:
        return {}

    @classmethod
    def build_topology(cls, actor_wg_world_size: int, rollout_world_size: int,
                       metadata: list[dict]) -> tuple[dict[str, list[Any]], dict[str, list[Any]]]:
        return {}, {}

    def init_process_group(self, **kwargs: Any) -> None:
        return None

    def finalize(self) -> None:
        return None

    async def send_weights(self, weights: Generator[tuple[str, torch.Tensor], None, None],
                           global_steps: int | None = None) -> dict[str, float]:
        """Consume ``weights`` (``(HF name, full tensor)`` pairs); the master writes them to
        ``step_folder(weights_dir, global_steps)`` atomically (a temporary folder renamed).
        Returns verl's per-sync metrics (``trio/weights_mb``)."""
        from safetensors.torch import save_file

        state: dict[str, torch.Tensor] = {}
        for name, tensor in weights:
            if self.is_master:  # a copy: tied weights must not share storage in safetensors
                state[name] = tensor.detach().to("cpu", copy=True).contiguous()
        if not self.is_master:
            return {}
        folder = step_folder(self.weights_dir, global_steps)
        tmp = folder.with_name(folder.name + ".partial")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        await asyncio.to_thread(save_file, state, str(tmp / _WEIGHTS_FILE))
        shutil.rmtree(folder, ignore_errors=True)
        tmp.rename(folder)
        size = sum(t.numel() * t.element_size() for t in state.values())
        return {"trio/weights_mb": size / 2**20}

    async def receive_weights(self, global_steps: int | None = None) -> AsyncGenerator[tuple[str, torch.Tensor], None]:
        raise NotImplementedError("the trio backend has no rollout-side receiver: TrioCheckpointManager loads "
                                  "the folder into the engine")
        yield  # pragma: no cover


async def _load(aio: Any, folder: str, version: int) -> None:
    await aio.engine.update_weights(folder, version=version)


class TrioCheckpointManager:
    """verl's ``checkpoint_manager_class`` for the engine (trainer side; module docstring).

    Args (as verl's ``CheckpointEngineManager``):
        config: ``actor_rollout_ref.rollout.checkpoint_engine`` (verl's
            ``CheckpointEngineConfig``): ``backend`` must be ``"trio"``;
            ``engine_kwargs.trio.weights_dir`` (required), ``.engine_name`` (default
            ``"default"``: the ``trio_rollout.engine_name`` of the agent-loop manager).
        actor_wg: the actor's worker group (``update_weights(global_steps=, mode=)``).
        replicas: verl's rollout replicas (kept, unused).

    Raises:
        InvalidRequestError: (construction) another backend, no ``weights_dir``; (from
            ``update_weights``) no ``TrioAgentLoopManager`` registered that engine in
            this process, or the workers wrote no weights.
        BackendError: the engine could not load the weights (from the engine).
    """

    def __init__(self, config: Any, actor_wg: Any, replicas: list[Any] | None = None) -> None:
        if config.backend != BACKEND:
            raise InvalidRequestError(
                f"actor_rollout_ref.rollout.checkpoint_engine.backend={config.backend!r}: TrioCheckpointManager moves "
                f"the weights through backend {BACKEND!r}; set checkpoint_engine.backend={BACKEND} and "
                "checkpoint_engine.custom_backend_module=engine.integrations.verl")
        import_external_libs(config.custom_backend_module or None)  # as verl's manager does
        kwargs = dict(config.engine_kwargs.get(BACKEND, {}) or {})
        self.config = config
        self.weights_dir = _weights_dir(kwargs)
        self.engine_name = str(kwargs.get("engine_name", "default"))
        self.actor_wg = actor_wg
        self.replicas = list(replicas or [])
        self.syncs = 0
        self._previous: Path | None = None

    @auto_await
    async def update_weights(self, global_steps: int | None = None) -> dict[str, Any]:
        """Move the actor's weights into the engine as version ``global_steps`` (0 when None).
        Returns the workers' metrics (verl logs them)."""
        entry = ENGINES.get(self.engine_name)
        if entry is None:
            raise InvalidRequestError(
                f"TrioCheckpointManager: no engine named {self.engine_name!r} in this process; set "
                "actor_rollout_ref.rollout.agent.agent_loop_manager_class=engine.integrations.verl.TrioAgentLoopManager "
                "(its trio_rollout.engine_name must match checkpoint_engine.engine_kwargs.trio.engine_name)")
        version = 0 if global_steps is None else int(global_steps)
        results = await asyncio.gather(*self.actor_wg.update_weights(global_steps=global_steps, mode=BACKEND))
        folder = step_folder(self.weights_dir, global_steps)
        if not (folder / _WEIGHTS_FILE).is_file():
            raise InvalidRequestError(f"TrioCheckpointManager: the actor's workers wrote no {_WEIGHTS_FILE} in {folder} "
                                      "(is weights_dir a folder both sides see?)")
        await asyncio.to_thread(_add_side_files, Path(entry.model_path), folder)
        await entry.engine.run(_load, entry.engine, str(folder), version)
        if self._previous is not None and self._previous != folder:
            shutil.rmtree(self._previous, ignore_errors=True)
        self._previous = folder
        self.syncs += 1
        metrics: dict[str, Any] = {}
        for result in results:
            if isinstance(result, dict):
                metrics.update(result)
        return metrics

    def add_replicas(self, replicas: list[Any]) -> None:
        self.replicas.extend(replicas)

    def remove_replicas(self, replicas: list[Any]) -> None:
        self.replicas = [r for r in self.replicas if r not in set(replicas)]

    @auto_await
    async def sleep_replicas(self) -> None:
        """No-op: the engine keeps its weights and cache (it is not on the actor's GPUs)."""

    @auto_await
    async def wake_up_replicas(self) -> None:
        """No-op (see :meth:`sleep_replicas`)."""

    @auto_await
    async def abort_replicas(self, reject_request: bool = False) -> None:
        """No-op: :meth:`update_weights` pauses and resumes the engine itself."""

    @auto_await
    async def resume_generation_replicas(self) -> None:
        """No-op (see :meth:`abort_replicas`)."""

    @auto_await
    async def release_kv_cache_replicas(self) -> None:
        """No-op (see :meth:`sleep_replicas`)."""

    @auto_await
    async def resume_kv_cache_replicas(self) -> None:
        """No-op (see :meth:`sleep_replicas`)."""


def _add_side_files(model_path: Path, folder: Path) -> None:
    """Copy the model folder's config and tokenizer files into a weight folder (so that
    ``from_pretrained`` and servers can load it); the weights themselves are not copied."""
    if not model_path.is_dir():
        return
    for item in model_path.iterdir():
        if item.is_file() and item.suffix in _SIDE_FILES and not item.name.endswith(".index.json"):
            shutil.copy2(item, folder / item.name)


class TrioReplica(RolloutReplica):
    """Rollout ``name`` ``"trio"``: a replica with no server (the agent-loop manager
    generates with the engine), so ``LLMServerManager`` launches nothing on the GPUs."""

    async def launch_servers(self) -> None:
        self.servers: list[Any] = []
        self._server_address = f"trio-rollout-{self.replica_rank}"
        self._server_handle = None

    def rollout_worker_use_gpu(self) -> bool:
        return False


class TrioRolloutAdapter(BaseRollout):
    """The worker-side rollout of ``name`` ``"trio"``: holds nothing (weights go through the
    ``trio`` checkpoint backend)."""

    async def resume(self, tags: list[str]) -> None:
        return None

    async def update_weights(self, weights: Any, wire_format: str = "named_tensors", **kwargs: Any) -> None:
        raise InvalidRequestError(
            "rollout name 'trio' got naive (in-process) weights: set actor_rollout_ref.rollout.checkpoint_engine."
            "backend=trio and checkpoint_manager_class=engine.integrations.verl.TrioCheckpointManager")

    async def release(self) -> None:
        return None


RolloutReplicaRegistry.register(BACKEND, lambda: TrioReplica)
# verl 0.9.1 has no public registration for the worker-side rollout class (a module-level
# table read by get_rollout_class); the entry is added, never replaced.
_rollout_base._ROLLOUT_REGISTRY.setdefault((BACKEND, "async"), f"{__name__}.TrioRolloutAdapter")

"""The engine side of OpenRLHF's weight broadcast (OpenRLHF 0.11.2).

OpenRLHF's trainer (``openrlhf/trainer/ray/ppo_actor.py``, ``ActorPPOTrainer``) talks to each
rollout engine as follows:

1. ``_init_vllm_sync_group``: ``engine.init_process_group(master_address, master_port,
   rank_offset, world_size, "openrlhf", backend=--vllm.sync_backend, use_ray=--vllm.sync_with_ray)``
   while DeepSpeed rank 0 joins the same group as rank 0;
2. ``broadcast_to_vllm``: per ``model.named_parameters()`` entry, ``engine.update_weight(name,
   dtype, shape, empty_cache=<last parameter>)`` while rank 0 broadcasts the tensor
   (``_broadcast_param``), or ``update_weight_cuda_ipc`` (``--train.colocate_all`` with NCCL,
   synchronous mode).

:class:`WeightReceiver` receives into CPU or CUDA tensors and stages them; the adapter loads
the staged set with one ``engine.update_weights`` at the last parameter.  The transports:

* ``use_ray=True`` (``--vllm.sync_with_ray``): ``ray.util.collective`` with the trainer's
  backend, ``gloo`` (``--vllm.sync_backend gloo``, torch's gloo: works on CPU, tested) or
  ``nccl`` (CUDA; the tensors are received on the current CUDA device).
* ``use_ray=False`` (the default): OpenRLHF's own ``stateless_init_process_group`` (vLLM's
  ``StatelessProcessGroup`` + ``PyNcclCommunicator``): needs CUDA and the ``vllm`` package in the
  engine's process; refused with one line otherwise.  Not tested (no GPU tier here).
* CUDA IPC (``update_weight_cuda_ipc``): refused with one line: it needs the engine on the
  trainer's GPU sharing its memory handles; run without ``--train.colocate_all`` or with
  ``--vllm.sync_backend gloo``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..errors import InvalidRequestError

__all__ = ["WeightReceiver"]


class WeightReceiver:
    """Joins OpenRLHF's broadcast group and stages the parameters it receives (blocking calls:
    the adapter runs them off the event loop)."""

    def __init__(self) -> None:
        self._broadcast: Callable[[Any], None] | None = None
        self._device = "cpu"
        self._staged: dict[str, Any] = {}

    def init_group(self, master_address: str, master_port: int, rank: int, world_size: int, group_name: str,
                   backend: str, use_ray: bool) -> None:
        """Join as ``rank`` (see the module docstring for the transports).

        Raises:
            InvalidRequestError: ``use_ray=False`` without CUDA or without vLLM; an unknown backend.
        """
        import torch

        if use_ray:
            import ray.util.collective as collective
            from ray.util.collective.types import Backend

            if str(backend).lower() == "nccl":
                if not torch.cuda.is_available():
                    raise InvalidRequestError("init_process_group: --vllm.sync_backend nccl needs CUDA in the "
                                              "engine's process; use --vllm.sync_backend gloo on CPU")
                self._device = f"cuda:{torch.cuda.current_device()}"
            collective.init_collective_group(world_size=world_size, rank=rank, backend=Backend(backend),
                                             group_name=group_name)
            self._broadcast = lambda tensor: collective.broadcast(tensor, 0, group_name=group_name)
            return
        if not torch.cuda.is_available():
            raise InvalidRequestError("init_process_group: OpenRLHF's default weight sync (PyNccl, use_ray=False) "
                                      "needs CUDA and vllm; on CPU run the trainer with --vllm.sync_with_ray "
                                      "--vllm.sync_backend gloo")
        try:
            from openrlhf.utils.distributed_util import stateless_init_process_group

            group = stateless_init_process_group(master_address, master_port, rank, world_size,
                                                 torch.cuda.current_device())
        except ImportError as exc:
            raise InvalidRequestError("init_process_group: OpenRLHF's default weight sync (PyNccl) needs the vllm "
                                      f"package in the engine's process ({exc}); or use --vllm.sync_with_ray") from exc
        self._device = f"cuda:{torch.cuda.current_device()}"
        self._broadcast = lambda tensor: group.broadcast(tensor, src=0, stream=torch.cuda.current_stream())

    def receive(self, name: str, dtype: Any, shape: Any) -> None:
        """Receive parameter ``name`` (``torch.dtype``, shape) from rank 0 and stage it.

        Raises:
            InvalidRequestError: :meth:`init_group` was not called.
        """
        import torch

        if self._broadcast is None:
            raise InvalidRequestError("update_weight before init_process_group: OpenRLHF joins the weight group "
                                      "first (ActorPPOTrainer._init_vllm_sync_group)")
        tensor = torch.empty(tuple(shape), dtype=dtype, device=self._device)
        self._broadcast(tensor)
        self._staged[name] = tensor

    def receive_cuda_ipc(self, name: str) -> None:
        """Raises :class:`InvalidRequestError`: CUDA IPC is not supported (module docstring)."""
        raise InvalidRequestError(f"update_weight_cuda_ipc({name!r}): CUDA IPC weight sync (--train.colocate_all "
                                  "with NCCL) is not supported by the trio-rollout engine; run without "
                                  "--train.colocate_all, or with --vllm.sync_with_ray --vllm.sync_backend gloo")

    def take(self) -> dict[str, Any]:
        """The staged parameters (emptied)."""
        staged, self._staged = self._staged, {}
        return staged

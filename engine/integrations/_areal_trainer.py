"""``AReaLPPOTrainer``: AReaL 1.0.4's ``PPOTrainer`` with trio-rollout as its rollout engine.

AReaL's trainer builds its rollout in ``PPOTrainer._init_rollout`` (``areal/trainer/rl_trainer.py``)
and hard-codes ``RemoteSGLangEngine`` / ``RemotevLLMEngine`` there; there is no registry.  This
subclass overrides that one method (nothing else of the trainer changes): in SPMD mode AReaL
does ``engine_cls(config); engine.initialize(train_data_parallel_size=dp)``, here the engine is
:class:`~engine.integrations.areal.AReaLInferenceEngine` over a backend the caller builds::

    with AReaLPPOTrainer(config, train_dataset, valid_dataset,
                         backend=lambda: HFBackend(config.actor.path)) as trainer:
        trainer.train(workflow="areal.workflow.rlvr.RLVRWorkflow", workflow_kwargs=...)

The trainer makes two rollout engines (training, and evaluation with no staleness bound, as
AReaL does), so ``backend`` is a factory, called once for each; the evaluation engine loads
every weight update the training one loads (:meth:`AReaLInferenceEngine.follow`).

Requirements (checked at construction, one line each):

* SPMD mode (``AREAL_SPMD_MODE=1``, what ``python -m areal.infra.launcher.local`` and
  ``torchrun`` set up): the single-controller mode builds its rollout through a scheduler and
  RPC workers (``engine_cls.as_controller``), which this adapter does not provide;
* ``actor.weight_update_mode: disk`` (xccl sends the weights over NCCL to the servers);
* no LoRA (AReaL supports it only in single-controller mode).
"""

from __future__ import annotations

from collections.abc import Callable
from copy import deepcopy
from typing import Any

from areal.trainer import PPOTrainer
from areal.utils.environ import is_single_controller

from ._areal_engine import AReaLInferenceEngine
from ._areal_options import AReaLEngineOptions

__all__ = ["AReaLPPOTrainer"]


class AReaLPPOTrainer(PPOTrainer):
    """``areal.trainer.PPOTrainer`` whose rollout is trio-rollout's engine (see the module docstring).

    Args:
        config, train_dataset, valid_dataset: as for ``PPOTrainer`` (a ``PPOConfig`` /
            ``GRPOConfig``; ``config.rollout`` is the engines' ``InferenceEngineConfig``, its
            ``backend`` string is read for the allocation only).
        backend: a zero-argument callable returning a new :class:`engine.InferenceBackend`
            (``lambda: HFBackend(path)``, a remote SGLang/vLLM backend over your servers).
        options: :class:`~engine.integrations.areal.AReaLEngineOptions` of both engines.

    Raises:
        RuntimeError: not in SPMD mode.
        ValueError: ``backend`` is not callable, the weight update mode is not ``disk``, LoRA.
    """

    def __init__(self, config: Any, train_dataset: Any = None, valid_dataset: Any = None, *,
                 backend: Callable[[], Any], options: AReaLEngineOptions | None = None) -> None:
        if is_single_controller():
            raise RuntimeError("AReaLPPOTrainer runs in AReaL's SPMD mode: set AREAL_SPMD_MODE=1 (launch with "
                               "`python -m areal.infra.launcher.local` or torchrun); the single-controller mode "
                               "builds its rollout through RPC workers, which this adapter does not provide")
        if not callable(backend):
            raise ValueError("AReaLPPOTrainer(backend=...) must be a callable returning a new backend (the trainer "
                             "builds two rollout engines: training and evaluation), e.g. lambda: HFBackend(path)")
        if config.actor.weight_update_mode != "disk":
            raise ValueError(f"actor.weight_update_mode={config.actor.weight_update_mode!r}: AReaLPPOTrainer "
                             "loads weights from disk (xccl sends them over NCCL to SGLang/vLLM servers); set "
                             "actor.weight_update_mode=disk")
        if getattr(config.actor, "use_lora", False):
            raise ValueError("actor.use_lora: AReaL supports LoRA only in single-controller mode; "
                             "AReaLPPOTrainer runs in SPMD mode")
        self._trio_backend = backend
        self._trio_options = options
        super().__init__(config, train_dataset=train_dataset, valid_dataset=valid_dataset)

    def _init_rollout(self, rollout_config: Any, is_eval: bool = False, lora_path: str | None = None) -> Any:
        """AReaL's SPMD branch of ``_init_rollout`` with this engine: a copy of the config (for
        evaluation: no staleness bound), ``initialize(train_data_parallel_size=dp)``."""
        if lora_path is not None:
            raise ValueError("LoRA weights are not supported by AReaLPPOTrainer (SPMD mode)")
        config = deepcopy(rollout_config)
        if is_eval:
            config.max_head_offpolicyness = int(1e12)  # AReaL: eval has no offpolicyness control
        engine = AReaLInferenceEngine(config, backend=self._trio_backend, options=self._trio_options)
        if is_eval:
            engine.follow(self.rollout)
        engine.initialize(train_data_parallel_size=self.actor_alloc.parallel.dp_size)
        return engine

"""trio-rollout as AReaL's rollout engine: an ``areal.api.engine_api.InferenceEngine``.

::

    from areal.api.cli_args import InferenceEngineConfig
    from areal.workflow import RLVRWorkflow
    from engine import HFBackend
    from engine.integrations.areal import AReaLInferenceEngine

    rollout = AReaLInferenceEngine(InferenceEngineConfig(experiment_name="e", trial_name="t",
                                                         consumer_batch_size=8, max_head_offpolicyness=1),
                                   backend=HFBackend(model_dir))
    rollout.initialize()
    batch = rollout.prepare_batch(dataloader, RLVRWorkflow(reward_fn, gconfig, tokenizer), group_size=4)
    # batch: AReaL's list of per-group dicts (input_ids, loss_mask, logprobs, versions, attention_mask, rewards)
    rollout.destroy()

and AReaL's trainer on it: ``AReaLPPOTrainer(config, train_dataset, valid_dataset, backend=...)``
(``areal.trainer.PPOTrainer`` whose ``_init_rollout`` builds this engine, SPMD mode).

Tested with AReaL **1.0.4** (PyPI wheel).  The seams: ``InferenceEngine``
(``areal/api/engine_api.py``), ``PPOTrainer._init_rollout`` (``areal/trainer/rl_trainer.py``),
the disk weight-update handshake of ``FSDPEngine._update_weights_from_disk``
(``areal/engine/fsdp_engine.py``) and ``RemoteInfEngine.update_weights_from_disk``
(``areal/infra/remote_inf_engine.py``).

What runs where:

* AReaL's own workflow classes run unchanged (``areal.workflow.RLVRWorkflow``,
  ``MultiTurnWorkflow``, agents such as ``areal.workflow.openai.math_agent.MathAgent``):
  each submitted item is one episode of the engine (its admission, staleness bound,
  pause, cancellation, accounting: every episode ends once as accepted, rejected or
  failed), whose trio task runs the workflow's ``arun_episode`` on the adapter's one
  asyncio loop thread and serves its ``agenerate`` calls (:mod:`._areal_bridge`: no thread
  per call).  Rewards: AReaL's ``AsyncRewardWrapper`` held by a workflow is swapped for
  the engine's reward pool (killable workers; :mod:`._areal_episodes`).
* What comes back is AReaL's: ``wait`` a list of dicts (``None`` = rejected or failed),
  ``rollout_batch`` / ``prepare_batch`` a list of per-group dicts, each padded to its own
  group's width with AReaL's pad values, the keys the workflow returned and no others
  (:mod:`._areal_convert`); they equal what AReaL's own ``WorkflowExecutor`` returns for
  the same responses (tests/integrations/areal/test_side_by_side.py).
* ``update_weights_from_disk(meta)`` follows AReaL's handshake: it is called *before*
  the trainer writes ``meta.path``; its future waits for AReaL's name-resolve key
  ``names.update_weights_from_disk(experiment, trial, version)`` (the version before the
  update), then loads the folder (episodes in flight are interrupted and resumed; their
  tokens carry the versions that produced them) as ``meta.version``.

Importing this module imports no AReaL; ``AReaLInferenceEngine`` and ``AReaLPPOTrainer``
resolve on first access and need AReaL 1.0.4 (the tier's venv:
``bash tests/integrations/areal/venv.sh .venv-areal``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ._areal_options import AReaLEngineOptions

if TYPE_CHECKING:
    from ._areal_engine import AReaLInferenceEngine as AReaLInferenceEngine
    from ._areal_trainer import AReaLPPOTrainer as AReaLPPOTrainer

__all__ = ["AREAL_VERSION", "AReaLEngineOptions", "AReaLInferenceEngine", "AReaLPPOTrainer"]

#: the AReaL release this adapter is tested with
AREAL_VERSION = "1.0.4"

_LAZY = {"AReaLInferenceEngine": "._areal_engine", "AReaLPPOTrainer": "._areal_trainer"}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    try:
        value = getattr(importlib.import_module(module, __package__), name)
    except ImportError as exc:
        if not (exc.name or "").startswith("areal"):
            raise
        raise ImportError(f"engine.integrations.areal.{name} needs AReaL {AREAL_VERSION} ({exc}): build its venv "
                          "with `bash tests/integrations/areal/venv.sh .venv-areal` (make test-integrations)") from None
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))

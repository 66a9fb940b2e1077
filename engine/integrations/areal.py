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

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..types import GenerationHyperparameters

if TYPE_CHECKING:
    from ._areal_engine import AReaLInferenceEngine as AReaLInferenceEngine
    from ._areal_trainer import AReaLPPOTrainer as AReaLPPOTrainer

__all__ = ["AREAL_VERSION", "AReaLEngineOptions", "AReaLInferenceEngine", "AReaLPPOTrainer"]

#: the AReaL release this adapter is tested with
AREAL_VERSION = "1.0.4"

_LAZY = {"AReaLInferenceEngine": "._areal_engine", "AReaLPPOTrainer": "._areal_trainer"}


@dataclass(frozen=True, kw_only=True)
class AReaLEngineOptions:
    """The adapter's own settings (AReaL's are in its ``InferenceEngineConfig``); validated
    on construction, a ``ValueError`` names the field.

    Attributes:
        engine_config: the engine's settings (:class:`engine.EngineConfig`: reward pool,
            timeouts, failure breaker, ...); ``max_concurrent_rollouts``,
            ``consumer_batch_size`` and ``max_head_offpolicyness`` are taken from AReaL's
            config (divided by the data-parallel size, as AReaL's executor does).  Default:
            ``EngineConfig(staleness_policy="flag", drop_incomplete_group=True)``: AReaL keeps
            finished trajectories that turned stale (``"drop"`` rejects them); a group with a
            rejected or failed member is dropped whole (AReaL drops it when a member raises,
            but keeps a partial group when members return ``None``, which shifts its actor's
            group-wise reward normalization).  ``reward_normalization`` must stay off: AReaL's
            actor normalizes rewards itself.
        tokenizer: the policy's tokenizer, for agent workflows (their chat completions);
            default: loaded from ``InferenceEngineConfig.tokenizer_path``.
        agent_gconfig: base sampling parameters of an agent's completions (ours; the
            agent's own ``create(...)`` arguments override them).
        engine_reward_pool: swap a workflow's AReaL ``AsyncRewardWrapper`` for the engine's
            reward pool (the workflow instance is changed in place; the class is not).
        keep_engine_keys: keep ``group_id`` / ``group_size`` (and ``is_stale``) in what
            AReaL receives (off: exactly AReaL's keys).
        weight_update_timeout_s: how long an ``update_weights_from_disk`` future waits for
            the trainer's name-resolve key (AReaL's 120 s).
        cancel_grace_s: how long a cancelled episode waits for its asyncio task to end.
        start_timeout_s: bound of ``initialize`` (the backend's start-up: model loading).
        close_timeout_s: bound of each step of ``destroy``.
    """

    engine_config: Any = None
    tokenizer: Any = None
    agent_gconfig: GenerationHyperparameters | None = None
    engine_reward_pool: bool = True
    keep_engine_keys: bool = False
    weight_update_timeout_s: float = 120.0
    cancel_grace_s: float = 10.0
    start_timeout_s: float = 600.0
    close_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        for name in ("weight_update_timeout_s", "cancel_grace_s", "start_timeout_s", "close_timeout_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value) or value <= 0:
                raise ValueError(f"{name} must be a number of seconds > 0, got {value!r}")
        config = self.engine_config
        if config is not None:
            from .._config import EngineConfig

            if not isinstance(config, EngineConfig):
                raise ValueError(f"engine_config must be an engine.EngineConfig, got {type(config).__name__}")
            if config.reward_normalization:
                raise ValueError("engine_config.reward_normalization must be False under AReaL: its actor "
                                 "normalizes rewards (actor.reward_norm); normalizing here would do it twice")
        if self.agent_gconfig is not None and not isinstance(self.agent_gconfig, GenerationHyperparameters):
            raise ValueError("agent_gconfig must be an engine.GenerationHyperparameters (ours, not AReaL's), got "
                             f"{type(self.agent_gconfig).__name__}")


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

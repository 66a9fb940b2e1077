"""``AReaLEngineOptions``: the AReaL adapter's own settings (imports no AReaL), re-exported by
:mod:`engine.integrations.areal`."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ..types import GenerationHyperparameters

__all__ = ["AReaLEngineOptions"]


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

"""``EngineWeightUpdater``: torchrl's collector weight update, as ``engine.update_weights``.

Imports torchrl (0.14.1); reached through :mod:`engine.integrations.torchrl`.

The seam (torchrl 0.14.1): ``LLMCollector(weight_updater=...)`` takes a
``torchrl.collectors.WeightUpdaterBase`` (``collectors/weight_update.py``; the only weight
hook ``LLMCollector.__init__`` exposes: it passes no ``weight_sync_schemes`` to its base).
``collector.update_policy_weights_(weights)`` (``collectors/_base.py``) calls the updater,
whose ``_sync_weights_with_worker`` is implemented here, then ``Collector.update_policy_weights_``
(``collectors/_single.py``) calls ``collector.increment_version()``, which bumps the
``PolicyVersion`` transform when ``track_policy_version=True``.  The engine's version is set
to the version that bump produces, so the ``policy_version`` torchrl writes into the batch
and the per-token versions the engine writes agree.

torchrl marks ``WeightUpdaterBase`` deprecated (a ``DeprecationWarning`` when a subclass is
defined, and one when an updater is passed to ``LLMCollector(weight_updater=...)``), yet it
is the only weight hook ``LLMCollector`` 0.14.1 has.  So :class:`EngineWeightUpdater` is a
registered virtual subclass (no warning at import), and :func:`install_weight_updater` sets
it on the collector directly (no warning at construction): that is what
:class:`~engine.integrations.torchrl.EngineWrapper` does when torchrl's ``LLMCollector``
registers itself with the policy.
"""

from __future__ import annotations

import logging
import os
import weakref
from collections.abc import Callable
from typing import Any

import torch
from tensordict import TensorDictBase
from torchrl.collectors.weight_update import WeightUpdaterBase
from torchrl.modules.llm.policies.common import LLMWrapperBase

from ..errors import InvalidRequestError
from ._torchrl_bridge import Bridge

__all__ = ["EngineWeightUpdater", "install_weight_updater", "state_dict_of"]

logger = logging.getLogger(f"rollout.{__name__}")


class EngineWeightUpdater:
    """Pushes the trainer's weights to a trio-rollout engine (``engine.update_weights``).

    ``collector.update_policy_weights_(w)`` with ``w`` one of: the trainer's model
    (``nn.Module``, e.g. a ``PreTrainedModel``), a torchrl LLM wrapper holding it (its
    ``.model``), a state dict, a ``TensorDict`` of weights (flattened with ``"."``), a
    checkpoint folder (``str`` / ``os.PathLike``: the server backends load folders), or
    nothing (then ``source``, the model given at construction, is read).

    The new version is the collector's ``policy_version + 1`` when it tracks an integer
    version (``LLMCollector(track_policy_version=True)``: torchrl bumps it right after this
    call), else the engine's version + 1.  Weights reach the backend through
    ``engine.update_weights`` (in-flight generations are aborted and resumed on the new
    weights: their tokens carry both versions).

    It is a ``torchrl.collectors.WeightUpdaterBase`` by registration (``isinstance`` holds;
    defining a subclass would raise torchrl's deprecation warning at import) and implements
    the part of that interface the collectors call: ``register_collector``, ``collector``,
    ``__call__`` / ``push_weights``, ``register_post_hook``, ``init``, ``increment_version``.

    Args:
        engine: a :class:`engine.RolloutEngineThread` or a trio-native engine.
        source: the default weights (``update_policy_weights_()`` without arguments).

    Raises (from an update):
        InvalidRequestError: no weights given and no ``source``; a type that holds no weights.
        BackendError: the backend refused the weights (old weights and version stay).
    """

    def __init__(self, engine: Any, *, source: Any = None) -> None:
        self.engine = engine
        self.source = source
        self._bridge = Bridge(engine)
        self._collectors: list[weakref.ReferenceType[Any]] = []
        self.post_hooks: list[Callable[[], Any]] = []
        self.updates = 0

    # -- torchrl's WeightUpdaterBase interface ----------------------------------------------
    def register_collector(self, collector: Any) -> None:
        """Keep a weak reference to ``collector`` (called by its ``weight_updater`` setter)."""
        self._collectors.append(weakref.ref(collector))

    @property
    def collector(self) -> Any:
        """The registered collector (None if none, or gone)."""
        if len(self._collectors) > 1:
            raise ValueError("EngineWeightUpdater: cannot access `collector` with multiple collectors")
        return self._collectors[0]() if self._collectors else None

    def init(self, *args: Any, **kwargs: Any) -> None:
        """Nothing to set up (torchrl calls it when the collector starts)."""

    def register_post_hook(self, hook: Callable[[], Any]) -> None:
        """Call ``hook()`` after each update."""
        self.post_hooks.append(hook)

    def increment_version(self) -> None:
        """Bump the policy version of every registered collector (torchrl's helper)."""
        for ref in self._collectors:
            collector = ref()
            if collector is not None:
                collector.increment_version()

    def __call__(self, policy_or_weights: Any = None, worker_ids: Any = None, **kwargs: Any) -> None:
        self.push_weights(policy_or_weights=policy_or_weights, worker_ids=worker_ids)

    def push_weights(self, policy_or_weights: Any = None, worker_ids: Any = None) -> None:
        """Load ``policy_or_weights`` (or ``source``) into the engine as the next version.

        ``worker_ids`` must be None (one engine)."""
        if worker_ids is not None:
            raise InvalidRequestError(f"update_policy_weights_(worker_ids={worker_ids!r}): the engine is one "
                                      "worker; call it without worker_ids")
        if policy_or_weights is None:
            if self.source is None:
                raise InvalidRequestError("update_policy_weights_() without weights: pass the trainer's model or "
                                          "its state dict, or build EngineWeightUpdater(engine, source=model)")
            policy_or_weights = self.source
        weights = state_dict_of(policy_or_weights)
        version = self._next_version()
        self._bridge.run(_update, weights, version)
        self.updates += 1
        logger.info("torchrl: weights pushed to the engine as version %s", version)
        for hook in self.post_hooks:
            hook()

    def _next_version(self) -> int:
        collector = self.collector
        tracked = getattr(collector, "policy_version", None) if collector is not None else None
        if isinstance(tracked, int) and not isinstance(tracked, bool):
            return tracked + 1
        return self._bridge.version + 1


WeightUpdaterBase.register(EngineWeightUpdater)


async def _update(engine: Any, source: Any, version: int) -> None:
    await engine.update_weights(source, version=version)


def state_dict_of(weights: Any) -> Any:
    """What ``engine.update_weights`` takes, from what torchrl users pass (see
    :class:`EngineWeightUpdater`): a ``{name: tensor}`` dict or a folder path (``str``).

    Raises:
        InvalidRequestError: a type that holds no weights (names it).
    """
    if isinstance(weights, (str, os.PathLike)):
        return os.fspath(weights)
    if isinstance(weights, LLMWrapperBase):  # a torchrl LLM wrapper: its HF model, under the model's own names
        if not isinstance(getattr(weights, "model", None), torch.nn.Module):
            raise InvalidRequestError(f"update_policy_weights_: the {type(weights).__name__} given holds no model; "
                                      "pass the trainer's model or its state dict")
        weights = weights.model
    if isinstance(weights, torch.nn.Module):
        return {name: t.detach() for name, t in weights.state_dict().items()}
    if isinstance(weights, TensorDictBase):
        return {name: t.detach() for name, t in weights.flatten_keys(".").items()}
    if isinstance(weights, dict):
        return {str(name): t.detach() if isinstance(t, torch.Tensor) else t for name, t in weights.items()}
    raise InvalidRequestError(f"update_policy_weights_: cannot read weights from a {type(weights).__name__}; pass "
                              "the trainer's model, its state dict, a TensorDict of weights or a checkpoint folder")


def install_weight_updater(collector: Any, engine: Any, *, source: Any = None) -> bool:
    """Give ``collector`` an :class:`EngineWeightUpdater` on ``engine`` unless it has a
    weight updater or weight-sync schemes of its own.  Returns whether it installed one."""
    if getattr(collector, "weight_updater", None) is not None or getattr(collector, "_weight_sync_schemes", None):
        return False
    collector.weight_updater = EngineWeightUpdater(engine, source=source)  # the setter registers the collector
    return True

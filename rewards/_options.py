"""``RewardPoolOptions``: a reward pool's settings, frozen, validated, defaults in one place.

Every opener and every config that names reward pool settings takes its
defaults from here: :func:`rewards.open_reward_pool`,
:func:`rewards._ray_pool.open_ray_reward_pool`, ``EngineConfig``'s ``reward_*``
fields (``EngineConfig.reward_options``) and :class:`~rewards.AsyncRewardWrapper`
(trio-parallel keeps its ``DEFAULT_CONTEXT`` the same way).  The defaults follow
AReaL's ``AsyncRewardWrapper`` (``areal/api/reward_api.py``): 15 s per attempt,
3 retries, workers ``max(cpu_count // device_count // 2, 1)``, fallback 0.0.

This module imports only the standard library (the engine's config imports it).
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
from dataclasses import dataclass
from typing import Any

__all__ = ["DEFAULTS", "DEFAULT_BATCH_SIZE", "WORKER_TYPES", "RewardPoolOptions", "default_max_workers"]

WORKER_TYPES = ("spawn", "forkserver")  # never "fork": it hangs once torch is loaded
#: The most calls in one worker job by default (``batch_size``); the batcher sends
#: fewer when fewer wait or when the reward is not cheap (:mod:`rewards._batch`).
DEFAULT_BATCH_SIZE = 64


def default_max_workers() -> int:
    """AReaL's default worker count, ``max(cpu_count // device_count // 2, 1)``.

    ``device_count`` is ``torch.cuda.device_count()`` only if torch is already
    imported (it is never imported here), and is treated as 1 when it is 0 or
    unknown.
    """
    cpu_count = os.cpu_count() or 1
    device_count = 1
    torch = sys.modules.get("torch")
    if torch is not None:
        try:
            device_count = max(int(torch.cuda.device_count()), 1)
        except Exception:  # a broken CUDA setup must not stop reward scoring
            device_count = 1
    return max(cpu_count // device_count // 2, 1)


@dataclass(frozen=True, kw_only=True)
class RewardPoolOptions:
    """A reward pool's policy, workers and micro-batching (units in the names).

    Attributes:
        max_workers: the most worker processes (or Ray actors) running at once;
            None: :func:`default_max_workers` when the pool opens.
        timeout_seconds: seconds one attempt may run (``math.inf``: no limit); a
            worker attempt past it is killed.
        max_retries: retries after the first attempt (attempts = max_retries + 1).
        fallback_reward: the reward returned, flagged, after the last timeout.
        worker_type: ``"spawn"`` or ``"forkserver"`` (never fork: it can hang
            once torch is loaded in the parent); unused by the Ray pool.
        batch_size: the most sync calls sent to a worker in one job (1: no
            micro-batching).  Batches adapt below it: a call that finds a worker
            free goes at once, alone; under load a job takes what waits, split
            over the free workers and capped at ~20 ms of measured reward work
            (slow rewards run alone).  See :mod:`rewards._batch`.
        max_batch_delay_s: how long a batch may wait for more calls once a
            worker is free (0, the default: take what is queued and go).

    Raises:
        ValueError: a field is out of range; the message begins with the field's name.
    """

    max_workers: int | None = None
    timeout_seconds: float = 15.0
    max_retries: int = 3
    fallback_reward: float = 0.0
    worker_type: str = "spawn"
    batch_size: int = DEFAULT_BATCH_SIZE
    max_batch_delay_s: float = 0.0

    def __post_init__(self) -> None:
        if self.max_workers is not None:
            _check_int("max_workers", self.max_workers, 1)
        _check_seconds("timeout_seconds", self.timeout_seconds)
        _check_int("max_retries", self.max_retries, 0)
        fallback = self.fallback_reward
        if isinstance(fallback, bool) or not isinstance(fallback, (int, float)) or not math.isfinite(fallback):
            raise ValueError(f"fallback_reward must be a finite number, got {fallback!r}")
        if self.worker_type not in WORKER_TYPES:
            raise ValueError(f"worker_type must be one of {WORKER_TYPES}, got {self.worker_type!r}")
        _check_int("batch_size", self.batch_size, 1)
        _check_seconds("max_batch_delay_s", self.max_batch_delay_s, allow_zero=True)
        if math.isinf(self.max_batch_delay_s):
            raise ValueError(f"max_batch_delay_s must be finite, got {self.max_batch_delay_s!r}")
        for name in ("timeout_seconds", "fallback_reward", "max_batch_delay_s"):  # ints given: floats kept
            object.__setattr__(self, name, float(getattr(self, name)))

    def with_changes(self, caller: str = "RewardPoolOptions", **changes: Any) -> RewardPoolOptions:
        """A copy with ``changes`` (field names as keywords), validated.

        Raises:
            TypeError: a keyword names no field (the message names ``caller`` and it).
            ValueError: a value is out of range (the message names the field).
        """
        if not changes:
            return self
        unknown = sorted(set(changes) - _FIELDS)
        if unknown:
            raise TypeError(f"{caller}() got unknown reward pool option(s) {unknown}; options: {sorted(_FIELDS)}")
        return dataclasses.replace(self, **changes)

    def resolved(self) -> RewardPoolOptions:
        """These options with ``max_workers`` set (:func:`default_max_workers` if None)."""
        if self.max_workers is not None:
            return self
        return dataclasses.replace(self, max_workers=default_max_workers())


_FIELDS = frozenset(field.name for field in dataclasses.fields(RewardPoolOptions))


def _check_seconds(name: str, value: Any, *, allow_zero: bool = False) -> None:
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or math.isnan(value)
        or value < 0
        or (value == 0 and not allow_zero)
    ):
        kind = "a non-negative" if allow_zero else "a positive"
        raise ValueError(f"{name} must be {kind} number of seconds (math.inf for none), got {value!r}")


def _check_int(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")


#: The defaults, for signatures that keep AReaL's keyword names (``AsyncRewardWrapper``,
#: ``EngineConfig``'s ``reward_*`` fields).
DEFAULTS = RewardPoolOptions()

"""Objects named by import strings in tests/test_import_strings.py (``tests/`` is on
``sys.path`` under pytest, and spawned reward workers inherit it)."""

from __future__ import annotations

import threading

from rewards import RewardActor

NOT_CALLABLE = 3


class NotAReward:
    """A class that is not a RewardActor: calling it would build an instance."""


class LockedReward:
    """A callable holding a lock: cannot be pickled for a worker process."""

    def __init__(self) -> None:
        self.lock = threading.Lock()

    def __call__(self, prompt, completions, prompt_ids, completion_ids, **data) -> float:
        return 1.0


locked_reward = LockedReward()


class HalfActor(RewardActor):
    """A stateless actor named by its class: instantiated with no arguments."""

    def __call__(self, prompt, completions, prompt_ids, completion_ids, **data) -> float:
        return 0.5

"""Stateful reward actors: ``setup()`` once per worker process, then many calls.

This module imports only the standard library: reward worker processes import
it when they unpickle an actor.

How it works (see also :mod:`rewards._worker`):

* Every :class:`RewardActor` gets a random ``actor_key`` when it is created
  (in ``__new__``, so subclasses need not call ``super().__init__()``).
  Pickling keeps the key, so the parent's actor and its copies in the workers
  share it; ``copy.copy`` keeps it too (a copy is the same actor).
* For each call the pool sends the pickled actor with the call's arguments.
  A worker keeps a registry ``{actor_key: set-up actor}``; for a key it has not
  seen it unpickles the actor, runs ``setup()`` and registers it, for a known
  key it reuses the registered instance (and never unpickles the new copy).
  State made in ``setup()`` or in ``__call__`` therefore survives between calls
  *in that worker process*; each worker has its own.
* A worker killed (timeout, cancellation) or dead (crash) takes its registry
  with it: the fresh process that replaces it runs ``setup()`` again on its
  first call for that actor.
* The pool runs ``setup()`` as a job of its own, under
  :attr:`RewardActor.setup_timeout_seconds`, so a slow setup (loading a reward
  model) does not eat into the per-call ``timeout_seconds``: a job sent to a
  worker that has not set the actor up comes back "not set up" without running
  anything, and is re-sent allowing setup with a deadline of
  ``setup_timeout_seconds + timeout_seconds``.  An exception raised by
  ``setup()`` counts as an exception of the reward (retried, then
  ``RewardError``); the actor is registered only after ``setup()`` returned.

An actor whose ``__call__`` is ``async def`` runs in-process (an LLM judge over
HTTP): its ``setup()`` (sync or ``async def``) runs once per pool, in the event
loop, before the first call, also under ``setup_timeout_seconds``.

Picklability: the actor is pickled *before* ``setup()`` (in the parent, where
setup never runs), so put heavy or unpicklable state (models, sockets, locks)
in ``setup()``, not in ``__init__``.  The class must be importable in the
worker (defined at module level, not in ``__main__`` of an unguarded script).
The configuration an actor has at its first call in a worker is the one that
worker keeps; to change it, create a new actor (a new key).
"""

from __future__ import annotations

import uuid
from typing import Any

__all__ = ["RewardActor"]


class RewardActor:
    """Base class of stateful reward functions.

    Subclass it, put per-process initialisation in :meth:`setup` and score one
    item in :meth:`__call__`::

        class LengthPenalty(RewardActor):
            def __init__(self, target: int):
                self.target = target            # small, picklable config

            def setup(self) -> None:            # once per worker process
                self.tokenizer = load_tokenizer()

            def __call__(self, prompt, completions, prompt_ids, completion_ids, **data):
                return -abs(len(completion_ids) - self.target) / self.target

    Pass the instance wherever a reward function goes
    (``pool.score(actor, ...)``, ``RLVRWorkflow(actor, ...)``,
    ``AsyncRewardWrapper(actor)``).

    Attributes:
        setup_timeout_seconds: class attribute, seconds ``setup()`` may take
            (``math.inf``: no limit).  Default 300.
        actor_key: identity shared by the actor and its pickled copies.
    """

    setup_timeout_seconds: float = 300.0
    actor_key: str

    def __new__(cls, *args: Any, **kwargs: Any) -> RewardActor:
        self = super().__new__(cls)
        # Unpickling calls __new__ too and then restores the original key
        # from the pickled __dict__.
        self.actor_key = uuid.uuid4().hex
        return self

    def setup(self) -> None:
        """Initialise per-process state; runs once per worker process.

        The default does nothing.  In an actor with an ``async def __call__``
        this may be ``async def`` too.
        """

    def __call__(
        self, prompt: Any, completions: Any, prompt_ids: Any, completion_ids: Any, **data: Any
    ) -> float:
        """Score one item; may be ``async def`` (then it runs in-process)."""
        raise NotImplementedError(f"{type(self).__qualname__} must implement __call__")

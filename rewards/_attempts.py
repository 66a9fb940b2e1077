"""One attempt of a reward call, of each kind; each returns the reward or raises.

* :meth:`Attempts.in_worker`: a sync reward (or :class:`~rewards.RewardActor`)
  in a worker process, holding one of the pool's slots (:mod:`rewards._slots`).
  An actor goes first as a bare call; a worker that has not set it up answers
  "not set up", and the call is re-sent allowing setup, under the actor's
  ``setup_timeout_seconds`` plus the attempt's timeout.
* a first attempt in a micro-batch (:mod:`rewards._batch`) is run by the pool's
  :meth:`~rewards.RewardPool.score_call` itself (one coroutine less per call); a
  batch that failed as a batch, or an actor not set up, runs alone (:meth:`Attempts.in_worker`).
* :meth:`Attempts.in_process`: an ``async def`` reward, as a trio call in this
  process (no worker slot); an async actor's ``setup()`` runs once per pool.

Each raises :class:`~rewards._slots.JobTimeout` past its timeout,
``trio_parallel.BrokenWorkerError`` when its worker died, what the reward raised,
or :class:`~engine.errors.RewardError` for an invalid value or a job the worker
could not unpickle; the retry policy (:mod:`rewards._policy`) decides what follows.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import trio

from engine.errors import RewardError

from . import _worker
from ._actor import RewardActor
from ._batch import Batcher
from ._slots import JobTimeout, WorkerSlots

__all__ = ["Attempts", "check_result"]


def check_result(tag: str, value: Any, name: str) -> float:
    """The reward of a worker's tagged result (:mod:`rewards._worker`).

    Raises:
        RewardError: the job could not be unpickled in the worker, or the value is invalid.
    """
    if tag == _worker.LOAD_FAILED:
        raise RewardError(
            f"reward function {name} or its arguments could not be unpickled in the "
            f"worker process: {value} (is its module importable there?)"
        )
    if tag == _worker.INVALID:
        raise RewardError(f"reward function {name} returned {value}")
    assert tag == _worker.OK, tag
    return value


class Attempts:
    """The attempt kinds of one pool, over its worker slots.

    Attributes:
        slots: the pool's :class:`~rewards._slots.WorkerSlots`.
        batcher: the pool's :class:`~rewards._batch.Batcher` while it batches, else None.
    """

    def __init__(self, slots: WorkerSlots) -> None:
        self.slots = slots
        self.batcher: Batcher | None = None
        self._local_actors: dict[str, trio.Lock | None] = {}  # async actors set up here (None: done)

    async def in_worker(self, job: bytes, name: str, timeout: float, setup_timeout: float | None) -> float:
        slots = self.slots
        await slots.acquire()  # the slot is held outside the timeout: queueing is not timed
        try:
            if setup_timeout is None:
                tag, value = await slots.run_job(_worker.run_job, job, timeout=timeout)
            else:  # an actor: the call alone, then, if not set up there, setup + call
                tag, value = await slots.run_job(_worker.run_job, job, False, timeout=timeout)
                if tag == _worker.NOT_SET_UP:
                    tag, value = await slots.run_job(_worker.run_job, job, True, timeout=setup_timeout + timeout)
        finally:
            slots.release()
        return check_result(tag, value, name)

    async def in_process(self, fn: Any, name: str, args: tuple, data: dict, timeout: float) -> float:
        if isinstance(fn, RewardActor):
            await self._setup_local_actor(fn)
        with trio.move_on_after(timeout) as scope:
            tag, value = _worker.as_reward(await fn(*_worker.resolve_texts(args), **data))
        if scope.cancelled_caught:
            raise JobTimeout
        if tag == _worker.INVALID:
            raise RewardError(f"reward function {name} returned {value}")
        return value

    async def load(self, job: bytes, name: str, timeout: float) -> None:
        """Unpickle ``job`` in a worker, not calling it (:meth:`RewardPool.check_reward_fn`)."""
        tag, value = await self.slots.run(_worker.load_job, job, timeout=timeout)
        check_result(tag, value, name)

    async def _setup_local_actor(self, actor: RewardActor) -> None:
        """Run an in-process actor's setup() once per pool (sync or async)."""
        key = actor.actor_key
        if key in self._local_actors and self._local_actors[key] is None:
            return  # set up
        lock = self._local_actors.setdefault(key, trio.Lock())
        if lock is None:
            return  # set up
        async with lock:
            if self._local_actors.get(key) is None:
                return  # set up by a concurrent call while we waited
            with trio.move_on_after(float(actor.setup_timeout_seconds)) as scope:
                setup: Callable[[], object] = actor.setup  # sync, or async def in a subclass
                result = setup()
                if inspect.isawaitable(result):
                    await result
            if scope.cancelled_caught:
                raise JobTimeout
            self._local_actors[key] = None

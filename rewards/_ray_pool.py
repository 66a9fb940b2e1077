"""A reward pool whose workers are Ray actors (``reward_backend="ray"``).

Same API, options (:class:`~rewards.RewardPoolOptions`) and policy as
:func:`rewards.open_reward_pool` (see :mod:`rewards._policy`: per-attempt timeout,
``max_retries`` retries, flagged fallback after the last timeout,
:data:`~rewards._policy.DETERMINISTIC_ERRORS` raised at once, ``async def``
rewards in-process, micro-batching); the class is a :class:`~rewards.RewardPool`
whose worker slots (:class:`RaySlots`) run jobs in Ray actors instead of
trio-parallel processes:

* Each worker is a Ray actor (:class:`_RewardWorker`, ``max_concurrency=1``)
  running :func:`rewards._worker.run_job` on the same pickled jobs, so a
  :class:`~rewards.RewardActor`'s ``setup()`` runs once per Ray actor (its
  registry lives in the actor's process).  Actors are created when needed, up to
  ``max_workers``, each with ``num_cpus``/``num_gpus`` (Ray resources).
* Starting an actor is not timed by ``timeout_seconds`` (Ray actor start is
  0.1-3 s); it gets ``actor_start_timeout_s`` and raises
  :class:`~engine.errors.RewardError` past it (no node has the resources).
* A timed-out or cancelled attempt kills its actor's process (``ray.kill``,
  which also ends the running Ray task) and a fresh actor replaces it at the
  next job; a dead actor (``RayActorError``: crash, ``os._exit``, OOM) counts as
  a worker death and the call is retried like a dead local worker.
* trio never blocks on Ray: an object ref is awaited with
  ``trio.to_thread.run_sync(ray.get, ref, abandon_on_cancel=True)``; a
  cancelled wait kills the actor, which ends the abandoned ``ray.get``.

Ray is an optional extra (``pip install trio-rollout[ray]``); it is imported
only when a Ray pool is opened.  Without ``address``, ``ray.init`` starts a
local Ray (no dashboard, ``log_to_driver=False``, ``num_cpus`` just enough for
``max_workers`` actors, the workers' code search path set to this process's
``sys.path``) unless Ray is already initialised in this process; the pool shuts
down only a Ray it started itself.  On a cluster (``address``) the reward's
module must be importable in the workers (installed, or a Ray runtime env).
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import trio
import trio_parallel

from engine.errors import RewardError
from engine.ray_cluster import await_ref, import_ray as _import_ray, init_ray as _init_ray

from . import _worker
from ._options import RewardPoolOptions
from ._pool import RewardPool, serving
from ._slots import JobTimeout, WorkerSlots
from ._stats import Counters

__all__ = ["RayRewardPool", "RaySlots", "open_ray_reward_pool"]


class _RewardWorker:
    """The Ray actor body: runs pool jobs in its own process (one at a time)."""

    def __init__(self) -> None:
        _worker.init_worker()  # own process group + guardian: the reward's children die with the actor

    def ready(self) -> bool:
        return True

    def call(self, function: Any, *args: Any) -> tuple[bool, Any]:
        """``(True, function(*args))``, or ``(False, exception)`` if it raised
        (the exception made picklable, so its type survives for the policy)."""
        try:
            return True, function(*args)
        except Exception as exc:
            return False, _worker._portable(exc)


class _RayActors:
    """The pool's Ray actors: idle ones, running count; makes and kills them."""

    def __init__(self, ray: Any, actor_class: Any, options: dict[str, Any], start_timeout_s: float) -> None:
        self.ray = ray
        self._actor_class = actor_class
        self._options = options
        self._start_timeout_s = start_timeout_s
        self.idle: list[Any] = []
        self.running = 0
        self.started = 0  # actors created over the pool's life

    async def get(self) -> Any:
        """An idle actor, or a new one once it is ready (not timed by the attempt)."""
        if self.idle:
            return self.idle.pop()
        actor = self._actor_class.options(**self._options).remote()
        self.started += 1
        try:
            with trio.move_on_after(self._start_timeout_s) as scope:
                await await_ref(self.ray, actor.ready.remote())
        except BaseException:
            self.kill(actor)
            raise
        if scope.cancelled_caught:
            self.kill(actor)
            raise RewardError(
                f"no Ray reward actor started within {self._start_timeout_s} s (options {self._options}; "
                "does the Ray cluster have these resources free?)"
            )
        return actor

    def kill(self, actor: Any) -> None:
        try:
            self.ray.kill(actor, no_restart=True)
        except Exception:  # already dead
            pass

    def close(self) -> None:
        for actor in self.idle:
            self.kill(actor)
        self.idle.clear()


class RaySlots(WorkerSlots):
    """:class:`~rewards._slots.WorkerSlots` whose jobs run in Ray actors.

    Attributes:
        actors: the pool's Ray actors (``actors.started``: created over the pool's life).
    """

    def __init__(self, actors: _RayActors, max_workers: int, counters: Counters) -> None:
        super().__init__(None, max_workers, counters)
        self.actors = actors

    async def run_job(self, function: Any, *args: Any, timeout: float) -> Any:
        """``function(*args)`` in a Ray actor (slot already held); kill the actor on
        timeout or cancellation.

        Raises:
            JobTimeout: the job ran past ``timeout``; its actor was killed.
            trio_parallel.BrokenWorkerError: the actor's process died.
            Exception: what ``function`` raised in the actor.
        """
        actors, counters = self.actors, self.counters
        ray = actors.ray
        fresh = not actors.idle  # get() starts an actor: counted as starting, not running
        self.starting += fresh
        try:
            actor = await actors.get()
        except ray.exceptions.RayActorError as exc:  # died while starting
            counters.worker_deaths += 1
            raise trio_parallel.BrokenWorkerError(f"Ray reward actor died at start: {exc}") from None
        finally:
            self.starting -= fresh
        actors.running += 1
        keep = False
        try:
            ref = actor.call.remote(function, *args)
            with trio.move_on_after(timeout) as scope:
                try:
                    ok, value = await await_ref(ray, ref)
                except ray.exceptions.RayActorError as exc:
                    counters.worker_deaths += 1
                    raise trio_parallel.BrokenWorkerError(f"Ray reward actor died: {exc}") from None
                except trio.Cancelled:
                    if not scope.cancel_called:  # the caller was cancelled, not our timeout
                        counters.workers_killed += 1
                    raise
            if scope.cancelled_caught:
                counters.workers_killed += 1
                raise JobTimeout
            keep = True
        finally:
            actors.running -= 1
            if keep and not self.closed:
                actors.idle.append(actor)
            else:
                actors.kill(actor)
        if not ok:
            raise value
        return value

    def worker_counts(self) -> tuple[int, int]:
        """``(running, idle)`` Ray actors now; ``(0, 0)`` once closed."""
        if self.closed:
            return 0, 0
        return self.actors.running, len(self.actors.idle)


class RayRewardPool(RewardPool):
    """A :class:`~rewards.RewardPool` whose sync rewards run in Ray actors.

    Create it with :func:`open_ray_reward_pool`.  ``worker_type`` is ``"ray"``.
    """

    _slots: RaySlots

    @property
    def actors_started(self) -> int:
        """Ray actors created over the pool's life."""
        return self._slots.actors.started


@asynccontextmanager
async def open_ray_reward_pool(
    options: RewardPoolOptions | None = None,
    /,
    *,
    address: str | None = None,
    num_cpus: float = 1.0,
    num_gpus: float = 0.0,
    actor_start_timeout_s: float = 120.0,
    **overrides: Any,
) -> AsyncIterator[RayRewardPool]:
    """Open a :class:`RayRewardPool` whose actors live as long as the ``async with`` block.

    Args:
        options, overrides: as in :func:`rewards.open_reward_pool` (``max_workers``:
            Ray actors at most; ``worker_type`` is unused).
        address: a Ray cluster to connect to (``ray.init(address=...)``); None
            starts a local Ray, unless this process has initialised Ray already
            (then that one is used).
        num_cpus, num_gpus: Ray resources each actor holds (floats, >= 0).
        actor_start_timeout_s: seconds to wait for a new actor to start.

    Raises:
        ValueError: an argument is out of range (the message names it).
        TypeError: a keyword names no option.
        RuntimeError: Ray is not installed.

    On exit the pool is closed and its actors killed; a Ray started here is shut down.
    """
    options = (options or RewardPoolOptions()).with_changes("open_ray_reward_pool", **overrides).resolved()
    assert options.max_workers is not None
    for name, value in (("num_cpus", num_cpus), ("num_gpus", num_gpus)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0 or math.isinf(value):
            raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
    if not (isinstance(actor_start_timeout_s, (int, float)) and actor_start_timeout_s > 0):
        raise ValueError(f"actor_start_timeout_s must be a number > 0, got {actor_start_timeout_s!r}")
    ray = _import_ray()
    local_cpus = max(1, math.ceil(options.max_workers * num_cpus))
    started = await trio.to_thread.run_sync(_init_ray, ray, address, local_cpus)
    actor_class = ray.remote(_RewardWorker)
    actor_options = {"num_cpus": num_cpus, "num_gpus": num_gpus, "max_concurrency": 1, "max_restarts": 0}
    actors = _RayActors(ray, actor_class, actor_options, float(actor_start_timeout_s))
    pool = RayRewardPool(options, RaySlots(actors, options.max_workers, Counters()), "ray")
    try:
        async with serving(pool) as served:
            yield served
    finally:
        actors.close()
        if started:
            with trio.CancelScope(shield=True):
                await trio.to_thread.run_sync(ray.shutdown)

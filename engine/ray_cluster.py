"""Connecting to Ray, shared by the Ray reward pool (:mod:`rewards._ray_pool`) and Ray
engine shards (:mod:`engine.shards`): import it with a clear error, fail fast on an
unreachable address, and start a local Ray whose workers find this process's code.
Ray itself is imported only when called (the ``ray`` extra)."""

from __future__ import annotations

import math
import os
import sys
from typing import Any

import trio

__all__ = ["await_ref", "check_ray_address", "import_ray", "init_ray", "local_job_config"]

# one unbounded thread limiter per trio run for the ``ray.get`` waits: the callers' own slots
# (reward workers, shards) bound them already, so trio's default limit of 40 must not
_THREADS: trio.lowlevel.RunVar[trio.CapacityLimiter] = trio.lowlevel.RunVar("rollout_ray_threads")


async def await_ref(ray: Any, ref: Any) -> Any:
    """``ray.get(ref)`` in a thread, never blocking trio; a cancelled wait abandons the thread
    (the caller kills the actor, which ends that ``ray.get``)."""
    try:
        limiter = _THREADS.get()
    except LookupError:
        limiter = trio.CapacityLimiter(math.inf)
        _THREADS.set(limiter)
    return await trio.to_thread.run_sync(ray.get, ref, abandon_on_cancel=True, limiter=limiter)


def local_job_config(ray: Any) -> Any:
    """A ``JobConfig`` whose workers search this process's ``sys.path`` for code (the
    reward's module, ``rewards``): a local Ray's workers do not inherit it otherwise."""
    paths = [os.path.abspath(p or os.curdir) for p in sys.path]
    return ray.job_config.JobConfig(code_search_path=[p for p in dict.fromkeys(paths) if os.path.isdir(p)])


def check_ray_address(address: str, timeout_s: float = 5.0) -> None:
    """Fail fast on a Ray address nothing listens on: ``ray.init`` retries such an
    address for minutes, in a thread a signal cannot interrupt.  ``"auto"`` and
    addresses without a port are left to Ray.

    Raises:
        ConnectionError: no TCP connection to ``host:port`` within ``timeout_s`` seconds.
    """
    import socket

    target = address.split("://", 1)[-1].rstrip("/")
    host, sep, port = target.rpartition(":")
    if not sep or not port.isdigit() or not host:
        return
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except OSError as exc:
        raise ConnectionError(f"ray address {address!r}: cannot connect to {host}:{port} ({exc}); start the "
                              "cluster with `ray start --head` or pass the address it printed") from None


def init_ray(ray: Any, address: str | None, num_cpus: float) -> bool:
    """Initialise Ray unless it is; True if this call started it.

    Raises:
        ConnectionError: ``address`` is unreachable (:func:`check_ray_address`).
    """
    if ray.is_initialized():
        return False
    if address is not None:
        check_ray_address(address)
        ray.init(address=address, log_to_driver=False)
    else:
        ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=False, job_config=local_job_config(ray))
    return True


def import_ray() -> Any:
    try:
        import ray
    except ImportError as exc:
        raise RuntimeError(
            "Ray is needed (reward_backend='ray', shard_backend='ray'): pip install 'trio-rollout[ray]' (ray>=2.40)"
        ) from exc
    return ray

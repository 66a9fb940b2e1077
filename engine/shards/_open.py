"""``open_sharded_engine``: start N engine shards and the coordinator in front of them."""

from __future__ import annotations

import logging
import math
import pickle
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import replace
from typing import Any

import trio

from .._gc import gc_tuned
from .._portable import dumps
from ..dump import TrajectoryDumper
from ..errors import unwrap_single
from ..executor import EngineConfig
from ._coordinator import ShardedRolloutEngine, ShardStartError, _Shard
from ._protocol import ShardInit

if sys.version_info < (3, 11):  # pragma: no cover
    from exceptiongroup import BaseExceptionGroup

__all__ = ["SHARD_BACKENDS", "ShardStartError", "open_sharded_engine"]


logger = logging.getLogger(f"rollout.{__name__}")

SHARD_BACKENDS = ("process", "ray", "inline")


@asynccontextmanager
async def open_sharded_engine(backend: Any, config: EngineConfig | None = None, *, shards: int = 2,
                              shard_backend: str | None = None, ray_address: str | None = None,
                              tokenizer: Any = None, start_timeout_s: float = 600.0, max_reruns: int = 2,
                              stats_interval_s: float = 0.5, frame_interval_s: float = 0.005,
                              ray_num_cpus: float = 1.0, shard_timeout_s: float | None = None,
                              shard_gc_tuning: bool = True, track_episodes: int = 0,
                              torch_threads: int | None = None,
                              record_admissions: bool = False) -> AsyncIterator[ShardedRolloutEngine]:
    """Open a :class:`~engine.shards.ShardedRolloutEngine`: ``shards`` engine processes,
    each with its own trio loop, backend client and reward pool (the ``reward_*``
    settings of ``config``, per shard), behind one coordinator in this process that
    owns the version, the global staleness budget and the accounting.

    ``config`` means what it means for :func:`~engine.executor.open_rollout_engine`,
    for the whole engine: ``max_concurrent_rollouts``, ``consumer_batch_size`` and
    ``max_head_offpolicyness`` bound the sum over shards; dumps and the failure
    breaker are the coordinator's.

    Args:
        backend: what each shard generates with: an *unopened* picklable
            :class:`~engine.backends.base.InferenceBackend` (each shard gets its own
            copy: a ``SimBackend``, a remote client), or a picklable zero-argument
            callable that builds one in the shard (e.g.
            :class:`~engine.backends.hf.HFBackendFactory`: one model per shard).
        shards: number of engine shards (>= 1).
        shard_backend: ``"process"`` (local processes talking over pipes; the default),
            ``"ray"`` (Ray actors; the default when ``ray_address`` is given), or
            ``"inline"`` (in this trio loop, no parallelism: tests and debugging).
        ray_address: the Ray cluster of ``shard_backend="ray"``; None: the Ray this
            process has initialised, else a local one (``ray.init()``).
        tokenizer: used only to decode text in trajectory dumps.
        start_timeout_s: seconds each shard may take to open its backend and reward pool.
        max_reruns: times an episode is run again after its shard died before it
            ends as failed (reason ``"shard_died"``).
        stats_interval_s: how often shards send their engine statistics.
        frame_interval_s: under load, each side sends at most one frame per this
            many seconds (what is queued meanwhile joins it; an idle side sends at
            once): fewer, larger frames for at most this much added latency per hop.
        ray_num_cpus: Ray CPUs each shard actor holds.
        shard_timeout_s: a shard that sends no frame for this many seconds (a live
            shard sends its statistics at least every ``stats_interval_s``) is hung
            (stopped, deadlocked, its loop blocked): it is killed and treated as dead
            (its episodes run again elsewhere).  None (the default): never.  Must
            exceed ``stats_interval_s``.  Closing: a shard that answers ``close``
            with its last frame gets up to 10 s to close its engine and exit; one
            silent for ``shard_timeout_s`` after ``close`` is killed then (10 s
            without it).
        shard_gc_tuning: tune the garbage collector of each shard *process* as
            ``EngineConfig.gc_tuning`` does (those processes are this engine's own,
            not the caller's; measured -15% to -20% CPU per shard episode, README
            Performance).  False: they follow ``config.gc_tuning``.  Inline shards
            (``shard_backend="inline"``) run in the caller's process: they always
            follow ``config.gc_tuning``, as the coordinator does.
        track_episodes: when > 0, each shard times its episodes and counts their
            tokens (:class:`~engine.cli._monitor.EpisodeTracker`, a wrapper around each
            workflow: a little CPU per generation request) and sends its
            ``track_episodes`` longest running with its statistics, for
            :meth:`ShardedRolloutEngine.longest_running` (the live view's
            stragglers; ``rollout run --shards`` sets 5).  0 (the default): not tracked.
        torch_threads: ``torch.set_num_threads`` in each shard *process* (an ``hf``
            backend's CPU threads).  None (the default): 1, or the
            ``ROLLOUT_SHARD_TORCH_THREADS`` environment variable (N shards on one
            machine should not each take every core).  Inline shards run in the
            caller's process and leave it alone.
        record_admissions: keep an :class:`~engine.shards.AdmissionRecord` per
            admission in ``engine.admission_log`` (tests, audits; memory grows).

    Raises:
        ValueError: ``shards < 1``, ``track_episodes < 0``, an unknown ``shard_backend``, ``shard_timeout_s <=
            stats_interval_s``, ``config.scheduling`` other than ``"fcfs"``, a ``config.scheduling_max_segments``, or
            ``backend``
            cannot be pickled (the message names it).
        ShardStartError: (a ``RuntimeError``) a shard did not start (how it ended; its stderr is this
            process's), or Ray is missing for ``shard_backend="ray"``.
        ShardsDiedError: every shard died while the engine was open (names each).
    """
    config = config or EngineConfig()
    if config.scheduling != "fcfs":
        raise ValueError(f"EngineConfig.scheduling={config.scheduling!r}: a sharded engine schedules first come, first "
                         "served only; use scheduling='fcfs' here, or one engine (open_rollout_engine) for a policy")
    if config.scheduling_max_segments is not None:
        raise ValueError(f"EngineConfig.scheduling_max_segments={config.scheduling_max_segments!r}: a sharded engine "
                         "has no engine-wide dispatch bound (each shard would bound its own); leave it None here, or "
                         "use one engine (open_rollout_engine)")
    if isinstance(shards, bool) or not isinstance(shards, int) or shards < 1:
        raise ValueError(f"shards must be an int >= 1, got {shards!r}")
    kind = shard_backend or ("ray" if ray_address is not None else "process")
    if kind not in SHARD_BACKENDS:
        raise ValueError(f"shard_backend must be one of {SHARD_BACKENDS}, got {shard_backend!r}")
    if torch_threads is not None and (isinstance(torch_threads, bool) or not isinstance(torch_threads, int)
                                      or torch_threads < 1):
        raise ValueError(f"torch_threads must be None or an int >= 1, got {torch_threads!r}")
    if isinstance(track_episodes, bool) or not isinstance(track_episodes, int) or track_episodes < 0:
        raise ValueError(f"track_episodes must be an int >= 0, got {track_episodes!r}")
    if max_reruns < 0:
        raise ValueError(f"max_reruns must be >= 0, got {max_reruns}")
    for name, value in (("stats_interval_s", stats_interval_s), ("frame_interval_s", frame_interval_s)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
            raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
    if shard_timeout_s is not None and (isinstance(shard_timeout_s, bool) or not isinstance(
            shard_timeout_s, (int, float)) or not stats_interval_s < shard_timeout_s):
        raise ValueError(f"shard_timeout_s must be None or a number > stats_interval_s ({stats_interval_s}), "
                         f"got {shard_timeout_s!r}")
    try:  # sent as bytes: a factory defined in the caller's script travels by value
        backend_spec = dumps(backend)
    except Exception as exc:
        raise ValueError(f"open_sharded_engine: backend ({type(backend).__name__}) cannot be pickled, and each "
                         f"shard needs its own copy; pass a picklable factory instead: {exc}") from exc
    dumper = TrajectoryDumper(config.dump_dir, tokenizer) if config.dump_dir else None
    # the shard processes are ours, not the caller's: their GC is tuned unless told otherwise
    shard_config = replace(config, gc_tuning=True) if shard_gc_tuning and kind != "inline" else config
    init = {"config": shard_config, "backend": backend_spec, "tokenizer": tokenizer, "stats_interval_s": stats_interval_s,
            "frame_interval_s": frame_interval_s,
            "options": {"track_episodes": track_episodes,
                        "torch_threads": torch_threads if kind != "inline" else None}}
    options = {"kind": kind, "ray_address": ray_address, "ray_num_cpus": ray_num_cpus, "shards": shards,
               "start_timeout_s": start_timeout_s, "shard_timeout_s": shard_timeout_s, "config": config}
    try:
        with gc_tuned(config.gc_tuning):
            async with _open(init, options, dumper, max_reruns, record_admissions) as engine:
                yield engine
    except BaseExceptionGroup as group:
        single = unwrap_single(group)
        if single is group:
            raise
    else:
        return
    raise single


@asynccontextmanager
async def _open(init: dict[str, Any], options: dict[str, Any], dumper: TrajectoryDumper | None, max_reruns: int,
                record_admissions: bool) -> AsyncIterator[ShardedRolloutEngine]:
    async with trio.open_nursery() as services:
        if dumper is not None:
            await services.start(dumper.run)
        try:
            shards, ray_context = await _start_all(init, options, services)
            try:
                async with trio.open_nursery() as nursery:
                    engine = ShardedRolloutEngine(nursery, shards, options["config"], dumper=dumper,
                                                  max_reruns=max_reruns, record_admissions=record_admissions,
                                                  frame_interval_s=init["frame_interval_s"],
                                                  shard_timeout_s=options["shard_timeout_s"])
                    for shard in shards:
                        nursery.start_soon(engine._serve_shard, shard, name=f"engine-shard-{shard.index}")
                    nursery.start_soon(engine._admit_forever, name="admission")
                    await engine.refresh_statistics()  # statistics() has the shards' figures (and types) at once
                    try:
                        yield engine
                    finally:
                        engine._close()
                        engine._end_dispatched()
                        nursery.cancel_scope.cancel()
            finally:
                with trio.CancelScope(shield=True):
                    await _close_all(shards, ray_context, silence_s=options["shard_timeout_s"])
        finally:
            if dumper is not None:
                dumper.close()


async def _start_all(init: dict[str, Any], options: dict[str, Any],
                     services: trio.Nursery) -> tuple[list[_Shard], Any]:
    """Start every shard concurrently; if one fails, stop the others and raise."""
    links: list[Any] = [None] * options["shards"]
    infos: list[dict[str, Any]] = [{} for _ in links]
    ray_context = None
    if options["kind"] == "ray":
        from ._ray_shard import RayShards

        ray_context = await RayShards.connect(options["ray_address"], options["shards"], options["ray_num_cpus"],
                                              options["start_timeout_s"])

    async def start(index: int) -> None:
        link: Any
        if ray_context is not None:
            link = await ray_context.start(index)
        elif options["kind"] == "inline":
            from ._inline import start_inline_shard

            link = await start_inline_shard(index, services)
        else:
            from ._local import start_local_shard

            link = await start_local_shard(index)
        links[index] = link
        first: list[Any] | None = None
        try:  # a shard that dies before reading ``init`` breaks the pipe: say how it ended, below
            await link.channel.send([("init", ShardInit(index=index, **init))])
            with trio.move_on_after(options["start_timeout_s"]) as scope:
                first = await link.channel.receive()
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        else:
            if scope.cancelled_caught:
                raise ShardStartError(f"engine shard {index} did not start within {options['start_timeout_s']} s")
        if not first or first[0][0] != "ready":
            reason = await link.exit_reason()
            raise ShardStartError(f"engine shard {index} (pid {link.pid}) {reason} before it was ready "
                               "(its error is on this process's stderr)")
        infos[index] = first[0][1]

    try:
        async with trio.open_nursery() as nursery:
            for i in range(options["shards"]):
                nursery.start_soon(start, i)
    except BaseException as exc:
        with trio.CancelScope(shield=True):
            await _close_links([link for link in links if link is not None], grace_s=0.0)
            if ray_context is not None:
                await ray_context.aclose()
        if isinstance(exc, BaseExceptionGroup):  # several shards failed to start: one error naming each
            starts, rest = exc.split(ShardStartError)
            if starts is not None and rest is None:
                raise ShardStartError("; ".join(str(e) for e in _leaves(starts))) from exc
        raise
    return [_Shard(i, link, info) for i, (link, info) in enumerate(zip(links, infos))], ray_context


def _leaves(group: BaseExceptionGroup[Any]) -> list[BaseException]:
    return [leaf for e in group.exceptions for leaf in (_leaves(e) if isinstance(e, BaseExceptionGroup) else [e])]


async def _close_all(shards: list[_Shard], ray_context: Any, grace_s: float = 10.0,
                     silence_s: float | None = None) -> None:
    """Say ``close`` to every live shard and take in what each sends until its channel
    ends (its last results' counters and its final statistics: ``shard_statistics()``
    and ``statistics()`` are exact after the close), then end the links.

    A healthy shard answers ``close`` with its last frame (its final statistics) at
    once, then closes its engine and exits: it gets ``grace_s`` from now for all of
    it.  A shard that sends nothing for ``silence_s`` (``shard_timeout_s``) after
    ``close`` (stopped, deadlocked) is hung: it is killed then, not after ``grace_s``;
    one that sent its last frame is never cut short by ``silence_s`` (its engine's
    teardown, e.g. its reward workers', may take a few seconds on a busy machine).
    """
    deadline = trio.current_time() + grace_s
    silence = min(grace_s, silence_s) if silence_s is not None else grace_s
    answered: set[int] = set()  # shards whose last frame (with their final statistics) arrived

    async def say_close(shard: _Shard) -> None:
        with trio.move_on_after(min(2.0, silence)):
            try:
                await shard.link.channel.send([("close",)])
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                return
        try:
            while True:
                with trio.move_on_at(deadline if shard.index in answered else
                                     min(deadline, trio.current_time() + silence)) as waiting:
                    messages = await shard.link.channel.receive()
                if waiting.cancelled_caught or messages is None:
                    return
                for message in messages:
                    if message[0] == "stats":
                        shard.stats = message[1]
                    elif message[0] == "bye":  # its last frame: it is closing its engine, then exits
                        answered.add(shard.index)
                    elif message[0] == "ended":
                        shard.counters = message[2]
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError, EOFError, pickle.UnpicklingError):
            pass

    async with trio.open_nursery() as nursery:
        for shard in shards:
            if shard.alive:
                nursery.start_soon(say_close, shard)
    async with trio.open_nursery() as nursery:  # answered: the rest of grace_s to exit; hung: killed now
        for shard in shards:
            left = max(0.0, deadline - trio.current_time()) if shard.index in answered or not shard.alive else 0.0
            nursery.start_soon(shard.link.aclose, left)
    for shard in shards:
        if shard.alive:
            shard.alive, shard.exit = False, f"closed ({await shard.link.exit_reason(0.0)})"
    if ray_context is not None:
        await ray_context.aclose()


async def _close_links(links: list[Any], grace_s: float) -> None:
    async with trio.open_nursery() as nursery:
        for link in links:
            nursery.start_soon(link.aclose, grace_s)

"""One engine shard: a :class:`~engine.executor.RolloutEngine` with its own trio loop,
backend client and reward pool, driven by the coordinator over a :class:`Channel`.

The shard admits whatever the coordinator sends (the coordinator owns the global
staleness budget: the shard's engine runs without a staleness bound, with
``max_concurrent_rollouts`` as a safety cap only), forwards every ended episode
in batches (one frame per wake-up: whatever ended meanwhile), applies version
changes, pauses and weight updates in the order they were sent, and answers
calls.  It ends when the coordinator says ``close`` or its channel ends (the
coordinator is gone): leaving the engine cancels what is still running.

Run as a process: ``python -m engine.shards._shard_main READ_FD WRITE_FD`` (the
coordinator passes the two pipe ends); or in a Ray actor
(:mod:`engine.shards._ray_shard`) over in-memory channels.
"""

from __future__ import annotations

import logging
import os
import pickle
import sys
from dataclasses import asdict, is_dataclass, replace
from typing import Any

import trio

if sys.version_info < (3, 11):  # pragma: no cover
    from exceptiongroup import BaseExceptionGroup

from ..context import SHARD_INDEX
from ._protocol import Channel, FrameStream, ShardInit, encode_results

__all__ = ["build_backend", "run_shard", "shard_engine_config"]

logger = logging.getLogger(f"rollout.{__name__}")


def shard_engine_config(config: Any) -> Any:
    """The settings a shard's engine runs with: the coordinator's, without the
    staleness bound (the coordinator applies it globally, and checks staleness on
    arrival), dumps (the coordinator writes them) or breaker (the coordinator's
    counts failures over every shard)."""
    return replace(config, max_head_offpolicyness=None, dump_dir=None, failure_breaker_consecutive=None,
                   failure_breaker_rate=None)


def build_backend(spec: Any) -> Any:
    """An unopened :class:`~engine.backends.base.InferenceBackend` from a spec: the
    backend itself, or a zero-argument callable that returns one."""
    from ..backends.base import InferenceBackend

    if isinstance(spec, InferenceBackend):
        return spec
    if callable(spec):
        backend = spec()
        if not isinstance(backend, InferenceBackend):
            raise TypeError(f"the shard backend factory {spec!r} returned {type(backend).__name__}, "
                            "not an InferenceBackend")
        return backend
    raise TypeError(f"shard backend must be an InferenceBackend or a zero-argument factory, got {type(spec).__name__}")


def _picklable(obj: Any) -> bool:
    try:
        pickle.dumps(obj)
    except Exception:
        return False
    return True


async def run_shard(channel: Channel) -> None:
    """Serve one shard on ``channel`` until ``close`` or end of channel."""
    from ..executor import open_rollout_engine

    first = await channel.receive()
    if not first or first[0][0] != "init":
        raise RuntimeError(f"engine shard: expected an init message first, got {first!r:.200}")
    init: ShardInit = first[0][1]
    if init.options.get("torch_threads"):  # (process and Ray shards only: ours)
        import torch

        torch.set_num_threads(init.options["torch_threads"])
    SHARD_INDEX.set(init.index)  # (this task's context: inline shards share a process, each its own task)
    backend = build_backend(_loads(init.backend) if isinstance(init.backend, bytes) else init.backend)
    async with open_rollout_engine(backend, shard_engine_config(init.config), tokenizer=init.tokenizer) as engine:
        workflows: dict[int, tuple[Any, Any]] = {}
        outbox: list[Any] = []
        tracker, top = None, int(init.options.get("track_episodes") or 0)
        if top:  # for the coordinator's live view: each workflow wrapped, its longest running sent with the stats
            from .._tracker import EpisodeTracker

            tracker = EpisodeTracker()
        buffer, ledger = engine._buffer, engine._ledger

        def post(message: Any) -> None:
            outbox.append(message)
            buffer.wake_consumers()  # the sender waits on the buffer's arrivals

        closing = False

        async def sender() -> None:
            """One frame per wake-up: what was posted, what ended, and the engine's
            statistics every ``stats_interval_s``, when it goes idle and when closing
            (then the last frame: it returns)."""
            last_stats = last_send = trio.current_time()
            while True:
                if not len(buffer) and not outbox and not closing:
                    with trio.move_on_after(init.stats_interval_s):
                        await buffer.wait_until(lambda: len(buffer) > 0 or bool(outbox) or closing)
                # at most one frame per frame_interval_s: under load, what ends meanwhile joins this frame
                await trio.sleep_until(last_send + init.frame_interval_s)
                messages, outbox[:] = list(outbox), []
                idle = False
                if len(buffer):
                    results = [buffer.pop_oldest() for _ in range(len(buffer))]
                    engine._take(results)
                    messages.append(("ended", encode_results(results), ledger.counters()))
                    idle = not ledger.counts["running"] and not ledger.counts["queued"]
                now = trio.current_time()
                if idle or closing or now - last_stats >= init.stats_interval_s:
                    last_stats = now
                    messages.append(("stats", engine.statistics(),
                                     None if tracker is None else tracker.longest_running(top)))
                if closing:
                    messages.append(("bye",))  # the last frame: the coordinator waits for the exit now
                if messages:
                    last_send = trio.current_time()
                    await channel.send(messages)
                if closing:
                    return

        async def call(call_id: int, method: str, args: tuple[Any, ...]) -> None:
            try:
                if method == "update_weights":
                    source, version, mode = args
                    await engine.update_weights(source, version=version, mode=mode)
                    value: Any = None
                elif method in ("weights_pause", "weights_load", "weights_resume"):
                    await _weights_call(engine, method, args)
                    value = None
                elif method == "statistics":
                    value = engine.statistics()
                elif method == "backend_records":
                    value = [tuple(asdict(r).values()) if is_dataclass(r) and not isinstance(r, type) else r
                             for r in getattr(engine.backend, "requests", [])]
                else:
                    raise ValueError(f"unknown shard call {method!r}")
            except Exception as exc:
                post(("reply", call_id, False, exc if _picklable(exc) else RuntimeError(f"{type(exc).__name__}: {exc}")))
                return
            post(("reply", call_id, True, value))

        await channel.send([("ready", {"pid": os.getpid(), "index": init.index, "weights_shared": bool(
            backend.weights_shared_across_clients)})])  # the first frame, before the sender's
        async with trio.open_nursery() as outer:
            outer.start_soon(sender)
            async with trio.open_nursery() as nursery:  # the calls in flight
                while not closing:
                    messages = await channel.receive()
                    if messages is None:
                        break
                    for message in messages:
                        kind = message[0]
                        if kind == "submit":
                            for task_id, key, group_size, data in message[1]:
                                wf, fn = workflows[key]
                                engine.submit(_loads(data), wf, should_accept_fn=fn, group_size=group_size,
                                              task_id=task_id)
                        elif kind == "workflow":
                            wf, fn = _loads(message[2])
                            workflows[message[1]] = (wf if tracker is None else tracker.track(wf), fn)
                        elif kind == "version":
                            engine.set_version(message[1])
                        elif kind == "pause":
                            engine.pause()
                        elif kind == "resume":
                            engine.resume()
                        elif kind == "call":
                            nursery.start_soon(call, *message[1:])
                        elif kind == "close":
                            closing = True
                        else:
                            raise RuntimeError(f"engine shard: unknown message {kind!r}")
                nursery.cancel_scope.cancel()
            if closing:  # the sender sends a last frame (final statistics) and returns
                buffer.wake_consumers()
            else:  # the coordinator is gone
                outer.cancel_scope.cancel()


async def _weights_call(engine: Any, method: str, args: tuple[Any, ...]) -> None:
    """One step of a weight update whose weights live in servers every shard shares
    (:mod:`engine.shards._weights`): pause this shard's backend, load (one shard only),
    or set the version (None: keep it) and resume."""
    from ..backends.base import WeightSync
    from ..errors import BackendError

    sync = engine.backend
    if not isinstance(sync, WeightSync):
        if method == "weights_resume":
            return
        raise BackendError(f"{type(sync).__name__} does not support weight updates "
                           "(it does not implement engine.backends.base.WeightSync: pause, resume, update_weights)")
    if method == "weights_pause":
        await sync.pause(args[0])
    elif method == "weights_load":
        source, version, mode = args
        await sync.update_weights(source, version=version, mode=mode)
    else:
        if args[0] is not None:
            engine.set_version(args[0])  # before the backend resumes: queued segments start tagged with it
        await sync.resume()


_loads = pickle.loads


async def _serve_fds(read_fd: int, write_fd: int) -> None:
    channel = FrameStream(trio.lowlevel.FdStream(write_fd), trio.lowlevel.FdStream(read_fd))
    try:
        await run_shard(channel)
    except BaseException as exc:
        if not _coordinator_gone(exc):
            raise
    finally:
        await channel.aclose()


def _coordinator_gone(exc: BaseException) -> bool:
    """The exception (or every leaf of a group) says the channel to the coordinator broke."""
    if isinstance(exc, BaseExceptionGroup):
        return all(_coordinator_gone(e) for e in exc.exceptions)
    return isinstance(exc, (trio.BrokenResourceError, BrokenPipeError, ConnectionResetError))


def main(argv: list[str] | None = None) -> int:
    """Process entry point: ``READ_FD WRITE_FD`` (inherited pipe ends)."""
    argv = sys.argv[1:] if argv is None else argv
    logging.basicConfig(level=os.environ.get("ROLLOUT_SHARD_LOG_LEVEL", "WARNING"),  # (the coordinator's format)
                        format="%(levelname)s %(asctime)s shard pid %(process)d %(name)s: %(message)s",
                        datefmt="%H:%M:%S")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # one "Loading weights" bar per shard: none
    import torch

    torch.set_num_threads(int(os.environ.get("ROLLOUT_SHARD_TORCH_THREADS", "1")))
    trio.run(_serve_fds, int(argv[0]), int(argv[1]))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The coordinator <-> shard wire: length-prefixed pickled frames over a byte stream,
and the compact encoding of episode results.

A frame is an 8-byte little-endian length followed by that many bytes holding a
pickle (protocol 5) of a list of messages, numpy arrays out of band; each message
is a tuple whose first item names it.  One frame carries everything one side
queued since its last send (submits, versions, results), so the coordinator pays
one write and one read per batch, not per episode.  Under load each side sends at
most one frame per ``frame_interval_s`` (5 ms by default; an idle side sends at once),
so frames grow with the load instead of carrying one episode each (a frame costs
~0.1 ms on each side).

Coordinator -> shard::

    ("init", ShardInit)                       first frame only
    ("workflow", key, bytes)                  a pickled (workflow, should_accept_fn), once per shard
    ("submit", [(task_id, key, group_size, data_bytes), ...])
    ("version", v)      ("pause",)      ("resume",)
    ("call", call_id, method, args)           update_weights, statistics, backend_records
    ("close",)

Shard -> coordinator::

    ("ready", {"pid": int, "index": int})
    ("ended", encode_results(...), counters)       counters: see _shard_main._counters
    ("reply", call_id, ok, value)
    ("stats", EngineStatistics)                    the shard engine's, every stats_interval_s

Trajectories travel in columns (:func:`encode_results`): one flat buffer per field
and dtype for all the results of a frame, out of band; pickling a TensorDict costs
~1 ms (measured on the 2-core box).  The tensors are rebuilt with ``torch.frombuffer``
as writable views of the received frame (no copy).
"""

from __future__ import annotations

import math
import pickle
import struct
from dataclasses import dataclass, field
from typing import Any, Protocol

import trio

__all__ = ["Channel", "FrameStream", "ShardInit", "decode_results", "dumps", "encode_results", "pack_frame",
           "result_record", "unpack_frame"]

_HEADER = struct.Struct("<Q")
#: a frame larger than this is refused as corrupt (a stray write on the pipe)
MAX_FRAME_BYTES = 1 << 34


def dumps(obj: Any) -> bytes:
    return pickle.dumps(obj, protocol=5)


@dataclass(frozen=True)
class ShardInit:
    """What a shard needs to start: its index, the engine settings it runs with, and a
    picklable backend spec (an unopened backend or a zero-argument factory)."""

    index: int
    config: Any  # EngineConfig (the coordinator's; the shard derives its own: shard_engine_config)
    backend: Any
    tokenizer: Any = None
    stats_interval_s: float = 0.5
    frame_interval_s: float = 0.005
    options: dict[str, Any] = field(default_factory=dict)


class Channel(Protocol):
    """A message channel to and from one shard: frames in order, ``None`` at the end."""

    async def send(self, messages: list[Any]) -> None: ...

    async def receive(self) -> list[Any] | None: ...

    async def aclose(self) -> None: ...


class FrameStream:
    """A :class:`Channel` over a pair of trio byte streams (pipes).

    ``send`` is safe from several tasks (a lock keeps frames whole); ``receive``
    belongs to one task and returns ``None`` at end of stream.

    Raises (``receive``):
        trio.BrokenResourceError: the stream ended inside a frame, or a header is corrupt.
    """

    def __init__(self, send_stream: Any, receive_stream: Any) -> None:
        self._out = send_stream
        self._in = receive_stream
        self._lock = trio.Lock()
        self._buf = bytearray()

    async def send(self, messages: list[Any]) -> None:
        frame = pack_frame(messages)
        async with self._lock:
            await self._out.send_all(frame)

    async def _fill(self, n: int) -> bool:
        while len(self._buf) < n:
            chunk = await self._in.receive_some(max(1 << 16, min(n - len(self._buf), 1 << 24)))
            if not chunk:
                return False
            self._buf += chunk
        return True

    async def receive(self) -> list[Any] | None:
        if not await self._fill(_HEADER.size):
            if self._buf:
                raise trio.BrokenResourceError(f"the stream ended inside a frame header ({len(self._buf)} bytes)")
            return None
        total = _HEADER.unpack_from(self._buf)[0]
        if total > MAX_FRAME_BYTES:
            raise trio.BrokenResourceError(f"corrupt frame header (length {total})")
        end = _HEADER.size + total
        if not await self._fill(end):
            raise trio.BrokenResourceError(f"the stream ended inside a frame ({len(self._buf)} of {end} bytes)")
        frame = self._buf[:end]  # a new bytearray: the arrays decoded from it are views of it
        del self._buf[:end]
        return unpack_frame(frame)

    async def aclose(self) -> None:
        for stream in (self._out, self._in):
            try:
                await stream.aclose()
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                pass


def pack_frame(messages: list[Any]) -> bytes:
    """One frame (header included) holding ``messages``.

    Layout: ``total`` (u64: the bytes after it), ``n`` (u64), the pickle's length
    and the ``n`` out-of-band buffer lengths (u64 each), the pickle, the buffers."""
    buffers: list[pickle.PickleBuffer] = []
    payload = pickle.dumps(messages, protocol=5, buffer_callback=buffers.append)
    raws = [b.raw() for b in buffers]
    lengths = [len(payload), *(r.nbytes for r in raws)]
    head = struct.pack(f"<{len(lengths) + 1}Q", len(raws), *lengths)
    return b"".join([_HEADER.pack(len(head) + sum(lengths)), head, payload, *raws])


def unpack_frame(frame: bytearray) -> list[Any]:
    """The messages of a whole frame (header included).  Pass a ``bytearray``: the
    numpy arrays come back as writable views of it."""
    view = memoryview(frame)
    n = _HEADER.unpack_from(view, _HEADER.size)[0]
    lengths = struct.unpack_from(f"<{n + 1}Q", view, 2 * _HEADER.size)
    offset = _HEADER.size * (n + 3)
    pieces = []
    for length in lengths:
        pieces.append(view[offset:offset + length])
        offset += length
    messages: list[Any] = pickle.loads(pieces[0], buffers=pieces[1:])
    return messages


# -- results -------------------------------------------------------------------------------------
def encode_results(results: list[Any]) -> tuple[list[Any], list[Any], list[pickle.PickleBuffer]]:
    """:class:`~engine.executor.EpisodeResult` s as plain values, without their ``data``
    (the coordinator holds the dataset items), trajectories in columns: each
    ``(key, dtype)`` of every trajectory in the batch is one flat buffer sent out of
    band, so a frame costs a few buffers whatever the episodes in it.  A trajectory
    holding anything but tensors is pickled whole instead (slower)."""
    import torch

    columns: dict[tuple[str, Any], list[Any]] = {}
    metas = []
    for r in results:
        traj, packed = r.trajectory, None
        if traj is not None:
            values = list(traj.items())
            if all(type(v) is torch.Tensor for _, v in values):
                spec = []
                for k, v in values:
                    columns.setdefault((k, v.dtype), []).append(v.reshape(-1))
                    spec.append((k, v.dtype, tuple(v.shape)))
                packed = (int(traj.batch_size[0]), spec)
            else:
                packed = traj
        metas.append((r.task_id, r.status, packed, r.reason, r.error_type, r.error_message, r.member_errors,
                      r.elapsed_s))
    keys = list(columns)
    arrays: list[Any] = [torch.cat(columns[key]).numpy() for key in keys]
    buffers = [pickle.PickleBuffer(a) for a in arrays]
    return metas, keys, buffers


def decode_results(payload: tuple[list[Any], list[Any], list[Any]]) -> list[tuple[tuple[Any, ...], Any]]:
    """``(values, trajectory)`` per result of :func:`encode_results`; the tensors are
    writable views of the received frame (no copy).  Build each record with
    :func:`result_record`."""
    import torch
    from tensordict import TensorDict

    metas, keys, buffers = payload
    columns = {}
    for key, buf in zip(keys, buffers):
        view = memoryview(buf)
        columns[key] = torch.frombuffer(view, dtype=key[1]) if view.nbytes else torch.empty(0, dtype=key[1])
    offsets = dict.fromkeys(keys, 0)
    out = []
    for values in metas:
        packed = values[2]
        traj = packed
        if type(packed) is tuple:
            rows, spec = packed
            fields = {}
            for k, dtype, shape in spec:
                key = (k, dtype)
                n = math.prod(shape)
                start = offsets[key]
                fields[k] = columns[key][start:start + n].view(shape)
                offsets[key] = start + n
            traj = TensorDict(fields, batch_size=[rows])
        out.append((values, traj))
    return out


def result_record(values: tuple[Any, ...], trajectory: Any, data: Any) -> Any:
    """The :class:`~engine.executor.EpisodeResult` of one decoded result, with ``data`` put back."""
    from ..executor import EpisodeResult

    task_id, status, _, reason, error_type, error_message, member_errors, elapsed_s = values
    return EpisodeResult(task_id, status, trajectory=trajectory, reason=reason, error_type=error_type,
                         error_message=error_message, member_errors=member_errors, data=data, elapsed_s=elapsed_s)

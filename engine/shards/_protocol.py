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
    ("call", call_id, method, args)           update_weights, statistics, backend_records,
                                              weights_pause / weights_load / weights_resume (_weights)
    ("close",)

Shard -> coordinator::

    ("ready", {"pid": int, "index": int, "weights_shared": bool})   (its backend's weights_shared_across_clients)
    ("ended", encode_results(...), counters)       counters: see _shard_main._counters
    ("reply", call_id, ok, value)
    ("bye",)                                       in its last frame, after ``close`` (then it closes
                                                   its engine and exits)
    ("stats", EngineStatistics, longest)           the shard engine's, every stats_interval_s, in the
                                                   frame where it goes idle, and in its last frame
                                                   (after ``close``; then its channel ends); longest:
                                                   its EpisodeTracker's longest running (EpisodeTiming,
                                                   seconds as of sending), or None when not tracking

Trajectories travel in columns (:func:`encode_results`): the trajectories of a frame
that have the same fields (names, dtypes) form a layout, and each field of a layout
is one flat buffer, out of band, with the sizes to cut it by; per trajectory only an
int is pickled (pickling a TensorDict costs ~1 ms on the 2-core box).  The receiver
cuts each buffer back with one ``split`` per field (``[1, T]`` fields along dim 1,
1-D ones along dim 0), as writable views of the received frame (no copy), and wraps
each trajectory's views in a TensorDict without re-checking them
(``TensorDict._new_unsafe``): ~9 us per trajectory where a slice and view per field
and a checked TensorDict cost ~35 us.
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
    backend spec (an unopened backend or a zero-argument factory), pickled to bytes by
    :func:`engine._portable.dumps` (by value when it comes from the caller's script)."""

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
def _tensor_fields(traj: Any) -> dict[str, Any] | None:
    """The fields of a flat trajectory of plain tensors (a dict), else None."""
    import torch
    from tensordict import TensorDict

    fields = traj._tensordict if type(traj) is TensorDict else dict(traj.items())
    if not all(type(v) is torch.Tensor for v in fields.values()):
        return None
    return fields


#: how a column is cut back into tensors: ROWS (every tensor ``[1, T]``: split along
#: dim 1 by the ``T`` s), FLAT (every tensor 1-D: split by lengths), SHAPED (anything
#: else: split by element counts, then view as each shape)
ROWS, FLAT, SHAPED = 0, 1, 2


def _column(tensors: list[Any]) -> tuple[int, list[Any], Any]:
    """One field of one layout: how to cut it back, the sizes to cut it by, and its
    tensors as one contiguous array (numpy, to pickle out of band; its bytes for a
    dtype numpy lacks, e.g. bfloat16)."""
    import torch

    shapes = [t.shape for t in tensors]
    if all(len(s) == 2 and s[0] == 1 for s in shapes):
        mode, sizes, flat = ROWS, [s[1] for s in shapes], torch.cat(tensors, dim=1)  # no per-tensor reshape
    elif all(len(s) == 1 for s in shapes):
        mode, sizes, flat = FLAT, [s[0] for s in shapes], torch.cat(tensors)
    else:
        mode, sizes, flat = SHAPED, [tuple(s) for s in shapes], torch.cat([t.reshape(-1) for t in tensors])
    try:
        return mode, sizes, flat.numpy()
    except TypeError:
        return mode, sizes, flat.view(-1).view(torch.uint8).numpy()


def encode_results(results: list[Any]) -> tuple[list[Any], list[Any], list[pickle.PickleBuffer]]:
    """:class:`~engine.executor.EpisodeResult` s as plain values, without their ``data``
    (the coordinator holds the dataset items), trajectories in columns.

    Trajectories with the same fields (names and dtypes, in order) share a layout;
    each field of each layout is one flat buffer for the whole frame, sent out of
    band with the sizes to cut it by, so a trajectory costs nothing on the wire but
    its tensors' bytes and an int.  A trajectory holding anything but plain tensors
    is pickled whole instead (slower).

    Returns ``(metas, layouts, buffers)``: per result ``(task_id, status, packed,
    reason, error_type, error_message, member_errors, elapsed_s)`` with ``packed``
    None (no trajectory), the index of its layout (an int; its place in the layout is
    its rank among the results of that layout) or the trajectory itself; per layout
    ``(names, dtypes, batch_sizes, modes, sizes)`` (per trajectory its batch size; per
    field :data:`ROWS`, :data:`FLAT` or :data:`SHAPED` and the sizes to cut by); the
    buffers, layout by layout, field by field.
    """
    layouts: dict[tuple[Any, ...], int] = {}
    tensors: list[list[list[Any]]] = []  # per layout, per field
    batches: list[list[tuple[int, ...]]] = []  # per layout, per trajectory
    same: dict[tuple[int, ...], tuple[int, ...]] = {}  # one object per batch size: pickled once
    metas = []
    for r in results:
        traj = packed = r.trajectory
        if traj is not None:
            fields = _tensor_fields(traj)
            if fields is not None:
                values = tuple(fields.values())
                key = (tuple(fields), tuple(v.dtype for v in values))
                packed = layouts.get(key)
                if packed is None:
                    packed = layouts[key] = len(tensors)
                    tensors.append([[] for _ in values])
                    batches.append([])
                for column, v in zip(tensors[packed], values):
                    column.append(v)
                size = tuple(traj.batch_size)
                batches[packed].append(same.setdefault(size, size))
        metas.append((r.task_id, r.status, packed, r.reason, r.error_type, r.error_message, r.member_errors,
                      r.elapsed_s))
    described, buffers = [], []
    for (names, dtypes), columns, batch_sizes in zip(layouts, tensors, batches):
        modes, sizes = [], []
        for column in columns:
            mode, cut, array = _column(column)
            modes.append(mode)
            sizes.append(cut)
            buffers.append(pickle.PickleBuffer(array))
        described.append((names, dtypes, batch_sizes, tuple(modes), sizes))
    return metas, described, buffers


def _split(column: Any, mode: int, sizes: list[Any]) -> Any:
    """``column`` cut into views (one call but for :data:`SHAPED`)."""
    if mode == ROWS:
        return column.view(1, -1).split_with_sizes(sizes, 1)
    if mode == FLAT:
        return column.split_with_sizes(sizes)
    return [piece.view(s) for piece, s in zip(column.split_with_sizes([math.prod(s) for s in sizes]), sizes)]


def decode_results(payload: tuple[list[Any], list[Any], list[Any]]) -> list[tuple[tuple[Any, ...], Any]]:
    """``(values, trajectory)`` per result of :func:`encode_results`; the tensors are
    writable views of the received frame (no copy).  Build each record with
    :func:`result_record`."""
    import torch
    from tensordict import TensorDict

    metas, layouts, buffers = payload
    new = getattr(TensorDict, "_new_unsafe", None) or TensorDict  # (tensordict >= 0.5: no per-field checks)
    built: list[Any] = []  # per layout, its trajectories in order
    b = 0
    for names, dtypes, batch_sizes, modes, sizes in layouts:
        per_field = []
        for dtype, mode, cut in zip(dtypes, modes, sizes):
            view = memoryview(buffers[b])
            b += 1
            column = torch.frombuffer(view, dtype=dtype) if view.nbytes else torch.empty(0, dtype=dtype)
            per_field.append(_split(column, mode, cut))
        known: dict[tuple[int, ...], torch.Size] = {}
        trajectories = []
        for batch_size, fields in zip(batch_sizes, zip(*per_field) if per_field else [()] * len(batch_sizes)):
            size = known.get(batch_size)
            if size is None:
                size = known[batch_size] = torch.Size(batch_size)
            trajectories.append(new(dict(zip(names, fields)), batch_size=size))
        built.append(iter(trajectories))
    return [(values, next(built[values[2]]) if type(values[2]) is int else values[2]) for values in metas]


def result_record(values: tuple[Any, ...], trajectory: Any, data: Any) -> Any:
    """The :class:`~engine.executor.EpisodeResult` of one decoded result, with ``data`` put back."""
    from ..executor import EpisodeResult

    task_id, status, _, reason, error_type, error_message, member_errors, elapsed_s = values
    return EpisodeResult(task_id, status, trajectory=trajectory, reason=reason, error_type=error_type,
                         error_message=error_message, member_errors=member_errors, data=data, elapsed_s=elapsed_s)

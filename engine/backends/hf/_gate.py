"""Weight-sync coordination of the ``hf`` batchers.

:class:`Gate` is the trio side: open unless a weight sync holds it; batches (static) and
requests (continuous) start only while it is open.

:class:`StepGate` adds what the static batcher needs to reach into a ``generate`` call
running in a worker thread: an *abort* flag (the running batch stops at its next decoding
step), a *hold* flag (the generate thread parks between two steps until :meth:`StepGate.resume`),
and the version boundary recorded while parked.  The generate thread calls
:meth:`StepGate.at_step` after every decoding step; the trio side waits in
:meth:`StepGate.pause` until the batch ended or parked.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

import trio

__all__ = ["Gate", "StepGate"]

T = TypeVar("T")


class Gate:
    """Open unless a weight sync holds it (see the module docstring)."""

    def __init__(self) -> None:
        self._open = trio.Event()
        self._open.set()

    def close(self) -> None:
        if self._open.is_set():
            self._open = trio.Event()

    def open(self) -> None:
        self._open.set()

    async def wait_open(self) -> None:
        """Return once open (always a checkpoint; re-checked after it, so a close
        during the checkpoint holds the caller)."""
        while True:
            await self._open.wait()
            if self._open.is_set():
                return


class StepGate(Gate):
    """A :class:`Gate` that also stops or parks a batch decoding in a worker thread.

    Attributes:
        abort: read by the generate thread after each step: stop every row now.
        hold: read by the generate thread after each step: park until resumed.
    """

    def __init__(self) -> None:
        super().__init__()
        self.abort = False
        self.hold = False
        self._boundary: int | None = None  # the version of weights loaded while parked
        self._parked = threading.Event()  # set by the generate thread while held
        self._release = threading.Event()
        self._running = False  # a batch is in its worker thread
        self._changed = trio.lowlevel.ParkingLot()  # unparked when a batch ends or parks
        self._token: trio.lowlevel.TrioToken | None = None

    # -- trio side ----------------------------------------------------------------------
    async def run_batch(self, fn: Callable[..., T], *args: object) -> T:
        """Run ``fn(*args)`` (a batch's ``generate``) in a worker thread, as the batch
        :meth:`pause` waits for."""
        self._token = trio.lowlevel.current_trio_token()
        self._running = True
        try:
            return await trio.to_thread.run_sync(fn, *args)
        finally:
            self._running = False
            self._changed.unpark_all()

    async def pause(self, mode: str) -> None:
        """Close the gate; ``"abort"``: stop the running batch at its next step;
        ``"in_place"``: park it between two steps.  Returns once it ended or parked."""
        self.close()
        self._boundary = None
        if mode == "abort":
            self.abort = True
        else:
            self._release.clear()
            self.hold = True
        try:
            while self._running and not (mode == "in_place" and self._parked.is_set()):
                await self._changed.park()
        finally:
            self.abort = False

    def mark_boundary(self, version: int) -> None:
        """The parked batch's later tokens come from weights of ``version``."""
        self._boundary = version

    def resume(self) -> None:
        """Release a parked batch and open the gate."""
        self.hold = False
        self._release.set()
        self.open()

    # -- generate thread side ---------------------------------------------------------------
    def at_step(self, step: int, boundaries: list[tuple[int, int]]) -> bool:
        """After decoding step ``step`` (1-based): park here while held (then append
        ``(step, version)`` to ``boundaries`` if the weights changed meanwhile); return
        whether the batch must stop now (abort)."""
        if self.hold:
            self._parked.set()
            if self._token is not None:
                trio.from_thread.run_sync(self._changed.unpark_all, trio_token=self._token)
            self._release.wait()
            self._parked.clear()
            if self._boundary is not None:
                boundaries.append((step, self._boundary))
        return self.abort

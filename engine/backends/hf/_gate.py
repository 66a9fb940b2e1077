"""Weight-sync coordination of the ``hf`` batchers.

:class:`Gate` is the trio side: open unless a weight sync holds it; batches (static) and
requests (continuous) start only while it is open.

:class:`StepGate` adds what the static batcher needs to reach into a ``generate`` call
running in a worker thread: an *abort* flag (the running batch stops at its next decoding
step), a *hold* flag (the generate thread parks between two steps until :meth:`StepGate.resume`),
and the version boundary recorded while parked.  The generate thread calls
:meth:`StepGate.at_step` after every decoding step; the trio side waits in
:meth:`StepGate.pause` until the batch ended or parked.

:meth:`StepGate.exclusive` is the one way to change the model outside a weight sync (a
named LoRA adapter loaded into it): one change at a time; the running batch parks at its
next step (and continues after, on what it computed with: its tokens keep their version)
and no batch starts until the change is done.  It composes with a sync's pause: a batch
parked by either waits for both to end.
"""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
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
        self._changed = trio.lowlevel.ParkingLot()  # unparked when a batch ends or parks, or a change ends
        self._token: trio.lowlevel.TrioToken | None = None
        self.steps_run = 0  # decoding steps that reached the gate (a live progress count)
        self._free = threading.Event()  # cleared while exclusive() changes the model
        self._free.set()
        self._mutex = trio.Lock()  # one change at a time

    @property
    def running(self) -> bool:
        """A batch is in its worker thread (computing or parked)."""
        return self._running

    @property
    def free(self) -> bool:
        """No :meth:`exclusive` change is under way (a batch may start)."""
        return self._free.is_set()

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

    async def wait_startable(self) -> None:
        """Return once a batch may start: the gate is open and no change is under way (both
        true on return, with no checkpoint after: start the batch before the next one)."""
        while True:
            await self.wait_open()
            if self._free.is_set():
                return
            while not self._free.is_set():
                await self._changed.park()

    @asynccontextmanager
    async def exclusive(self) -> AsyncIterator[None]:
        """Hold the model for a change (see the module docstring): enter once no batch
        computes (none runs, or the running one is parked); no batch computes until exit."""
        async with self._mutex:
            self._free.clear()
            try:
                while self._running and not self._parked.is_set():
                    await self._changed.park()
                yield
            finally:
                self._free.set()
                self._changed.unpark_all()

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
        """After decoding step ``step`` (1-based): park here while held or while a change
        is under way (then, if a sync held it, append ``(step, version)`` to ``boundaries``
        if the weights changed meanwhile); return whether the batch must stop now (abort)."""
        self.steps_run += 1
        if self.hold or not self._free.is_set():
            held = self.hold  # read first: a resume may come before the loop below looks
            self._parked.set()
            if self._token is not None:
                trio.from_thread.run_sync(self._changed.unpark_all, trio_token=self._token)
            while self.hold or not self._free.is_set():
                if self.hold:
                    held = True
                    self._release.wait()
                else:
                    self._free.wait()
            self._parked.clear()
            if held and self._boundary is not None:
                boundaries.append((step, self._boundary))
        return self.abort

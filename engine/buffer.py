"""The bounded result buffer between episodes and the trainer.

Ended episodes deposit their :class:`~engine.executor.EpisodeResult` here in
completion order.  Capacity is counted in trajectories (rows of accepted
results; rejected and failed results take no room), so memory stays bounded:
when the buffer is full, :meth:`ResultBuffer.put` waits (backpressure) until a
consumer takes results out.  A result larger than the whole capacity is let in
when the buffer is empty, so a big group can never deadlock.

The staleness policy (what to do with a trajectory whose oldest generated token
is more than ``eta`` versions behind) lives in the executor's admission part
(:mod:`engine._admission`), which checks each result before it is deposited and the
buffered ones again at each version change.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import trio

__all__ = ["ResultBuffer"]


class ResultBuffer:
    """Completion-ordered results, bounded in trajectories.

    Args:
        capacity: maximum trajectories held (``math.inf`` for unbounded).
    """

    def __init__(self, capacity: float) -> None:
        if not capacity >= 1:
            raise ValueError(f"buffer capacity must be >= 1 trajectory, got {capacity}")
        self.capacity = capacity
        self._items: OrderedDict[int, Any] = OrderedDict()
        self.rows = 0
        self.peak_rows = 0
        self.accepted_results = 0
        self._space = trio.lowlevel.ParkingLot()  # producers waiting for room
        self._arrivals = trio.lowlevel.ParkingLot()  # consumers waiting for results

    @staticmethod
    def _rows(result: Any) -> int:
        traj = result.trajectory
        return 0 if traj is None else int(traj.batch_size[0])

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, task_id: int) -> bool:
        return task_id in self._items

    def has_room_for(self, rows: int) -> bool:
        return rows == 0 or self.rows == 0 or self.rows + rows <= self.capacity

    async def put(self, result: Any) -> None:
        """Deposit ``result``; waits while it does not fit."""
        rows = self._rows(result)
        while not self.has_room_for(rows):
            await self._space.park()
        self._put_now(result, rows)

    def deposit(self, result: Any) -> None:
        """Deposit ``result`` now, even past the capacity (sync: an episode that was
        cancelled, or ended without running, is never held back)."""
        self._put_now(result, self._rows(result))

    def _put_now(self, result: Any, rows: int) -> None:
        self._items[result.task_id] = result
        self.rows += rows
        self.peak_rows = max(self.peak_rows, self.rows)
        if result.trajectory is not None:
            self.accepted_results += 1
        if self._arrivals:  # (a ParkingLot is falsy when empty: no list, no generator per result)
            self._arrivals.unpark_all()

    def _taken(self, result: Any) -> Any:
        self.rows -= self._rows(result)
        if result.trajectory is not None:
            self.accepted_results -= 1
        if self._space:
            self._space.unpark_all()
        return result

    def pop_oldest(self) -> Any:
        """Take the oldest result out (``IndexError`` when empty)."""
        if not self._items:
            raise IndexError("the result buffer is empty")
        return self._taken(self._items.popitem(last=False)[1])

    def pop(self, task_id: int) -> Any:
        return self._taken(self._items.pop(task_id))

    def replace(self, task_id: int, result: Any) -> None:
        """Swap a held result in place (same position), e.g. to re-classify it."""
        old = self._items[task_id]
        self.rows += self._rows(result) - self._rows(old)
        self.accepted_results += (result.trajectory is not None) - (old.trajectory is not None)
        self._items[task_id] = result
        self._space.unpark_all()

    def results(self) -> list[Any]:
        return list(self._items.values())

    async def wait_until(self, predicate: Callable[[], bool]) -> None:
        """Wait until ``predicate()`` holds; re-checked after every deposit."""
        while not predicate():
            await self._arrivals.park()

    def wake_consumers(self) -> None:
        self._arrivals.unpark_all()

"""Unit tier: the ``hf`` static batcher's weight-sync gate (:class:`StepGate`) against a
stand-in for ``generate`` in a worker thread (no model), and the version tags."""

from __future__ import annotations

import threading

import trio
import trio.testing

from engine.backends.hf._gate import StepGate
from engine.backends.hf._model import tag_versions


class FakeBatch:
    """``steps`` decoding steps in a worker thread: each takes a permit, records itself,
    calls :meth:`StepGate.at_step`, then signals ``stepped``."""

    def __init__(self, gate: StepGate, steps: int) -> None:
        self.gate, self.steps = gate, steps
        self.permits, self.stepped = threading.Semaphore(0), threading.Semaphore(0)
        self.done: list[int] = []
        self.boundaries: list[tuple[int, int]] = []
        self.result: str | None = None

    def _decode(self) -> str:
        for step in range(1, self.steps + 1):
            self.permits.acquire()
            self.done.append(step)
            if self.gate.at_step(step, self.boundaries):
                return "aborted"
            self.stepped.release()
        return "finished"

    async def run(self) -> None:
        self.result = await self.gate.run_batch(self._decode)

    async def advance(self, n: int) -> None:
        """Let ``n`` steps run and wait until they passed the gate."""
        for _ in range(n):
            self.permits.release()
            await trio.to_thread.run_sync(self.stepped.acquire)


async def _is_held(gate: StepGate) -> bool:
    opened = trio.Event()

    async def wait() -> None:
        await gate.wait_open()
        opened.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(wait)
        await trio.testing.wait_all_tasks_blocked()
        held = not opened.is_set()
        nursery.cancel_scope.cancel()
    return held


async def test_abort_pause_stops_the_batch_at_its_next_step_and_holds_new_batches():
    gate = StepGate()
    batch = FakeBatch(gate, 10)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(batch.run)
        await batch.advance(2)
        async with trio.open_nursery() as pausing:
            pausing.start_soon(gate.pause, "abort")
            await trio.testing.wait_all_tasks_blocked()  # pause waits for the batch to end
            batch.permits.release()  # the next step sees the abort
    assert batch.result == "aborted" and batch.done == [1, 2, 3]
    assert not gate.abort  # cleared once the batch ended
    assert await _is_held(gate)  # no new batch until resume
    gate.resume()
    assert not await _is_held(gate)


async def test_in_place_pause_parks_the_batch_and_tags_the_boundary_step():
    gate = StepGate()
    batch = FakeBatch(gate, 6)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(batch.run)
        await batch.advance(3)
        async with trio.open_nursery() as pausing:
            pausing.start_soon(gate.pause, "in_place")
            await trio.testing.wait_all_tasks_blocked()
            batch.permits.release()  # step 4 parks inside at_step; then pause returns
        assert batch.result is None and batch.done == [1, 2, 3, 4]
        assert await _is_held(gate)
        gate.mark_boundary(7)  # the weights changed while parked
        batch.permits.release()
        batch.permits.release()
        gate.resume()
    assert batch.result == "finished" and batch.done == [1, 2, 3, 4, 5, 6]
    assert batch.boundaries == [(4, 7)]
    assert tag_versions(3, 6, batch.boundaries) == [3, 3, 3, 3, 7, 7]  # tokens after step 4: new weights


async def test_pause_with_no_batch_running_returns_at_once_and_resume_reopens():
    gate = StepGate()
    await gate.pause("in_place")
    assert await _is_held(gate)
    gate.resume()
    assert not await _is_held(gate) and not gate.hold


def test_tag_versions_applies_each_boundary_in_order():
    assert tag_versions(0, 5, []) == [0] * 5
    assert tag_versions(0, 5, [(2, 1), (4, 2)]) == [0, 0, 1, 1, 2]
    assert tag_versions(0, 3, [(5, 1)]) == [0, 0, 0]  # a boundary past the end tags nothing

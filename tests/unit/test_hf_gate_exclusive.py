"""Unit tier: :meth:`StepGate.exclusive`, the one way to change the ``hf`` model outside a
weight sync (a named LoRA adapter loaded while a batch decodes), against the stand-in
batch of ``test_hf_gate`` (a ``generate`` in a worker thread, no model)."""

from __future__ import annotations

import trio
import trio.testing

from engine.backends.hf._gate import StepGate
from test_hf_gate import FakeBatch


async def test_a_change_parks_the_running_batch_which_then_continues_with_no_boundary():
    gate = StepGate()
    batch = FakeBatch(gate, 5)
    inside = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(batch.run)
        await batch.advance(2)

        async def change():
            async with gate.exclusive():
                inside.append(list(batch.done))  # the batch does not move while the change runs
                batch.permits.release()  # (a step could only run after the change)
                await trio.testing.wait_all_tasks_blocked()
                inside.append(list(batch.done))

        async with trio.open_nursery() as changing:
            changing.start_soon(change)
            await trio.testing.wait_all_tasks_blocked()
            assert inside == []  # it waits for the batch to reach its next step
            batch.permits.release()  # step 3 parks for the change
        for _ in range(2):
            batch.permits.release()
    assert inside == [[1, 2, 3], [1, 2, 3]] and gate.free
    assert batch.result == "finished" and batch.done == [1, 2, 3, 4, 5] and batch.boundaries == []


async def test_no_batch_starts_while_a_change_runs():
    gate = StepGate()
    started = trio.Event()

    async def start_a_batch():
        await gate.wait_startable()
        started.set()

    async with trio.open_nursery() as nursery:
        async with gate.exclusive():  # no batch running: entered at once
            nursery.start_soon(start_a_batch)
            await trio.testing.wait_all_tasks_blocked()
            assert not started.is_set() and not gate.free
        await trio.testing.wait_all_tasks_blocked()
        assert started.is_set()


async def test_a_change_inside_an_in_place_pause_enters_at_once_and_the_batch_waits_for_both():
    gate = StepGate()
    batch = FakeBatch(gate, 4)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(batch.run)
        await batch.advance(1)
        async with trio.open_nursery() as pausing:
            pausing.start_soon(gate.pause, "in_place")
            await trio.testing.wait_all_tasks_blocked()
            batch.permits.release()  # step 2 parks for the pause
        async with gate.exclusive():  # the batch is parked: no wait
            gate.mark_boundary(9)
            gate.resume()  # the sync ends first ...
            batch.permits.release()
            await trio.testing.wait_all_tasks_blocked()
            assert batch.done == [1, 2]  # ... the batch still waits for the change
        batch.permits.release()
        batch.permits.release()
    assert batch.result == "finished" and batch.boundaries == [(2, 9)]


async def test_an_abort_pause_during_a_change_stops_the_batch_once_the_change_is_done():
    gate = StepGate()
    batch = FakeBatch(gate, 10)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(batch.run)
        await batch.advance(1)
        async with trio.open_nursery() as changing:
            entered, done = trio.Event(), trio.Event()

            async def change():
                async with gate.exclusive():
                    entered.set()
                    await done.wait()

            changing.start_soon(change)
            await trio.testing.wait_all_tasks_blocked()  # the change waits for the batch's next step
            batch.permits.release()  # step 2 parks for the change
            await entered.wait()
            changing.start_soon(gate.pause, "abort")
            await trio.testing.wait_all_tasks_blocked()
            assert batch.result is None  # the pause waits: the batch is parked for the change
            done.set()
    assert batch.result == "aborted" and batch.done == [1, 2]

"""Issue 13, class 3: a reward that starts a child process (``sleep 1000``: a compiler, a
test runner) and hangs.  On timeout, on cancellation and when the pool closes, the reward
worker's whole process tree dies, not only the worker.

The reward writes its child's pid into a named pipe; the test holds a pidfd of that child
and waits for it to become readable (the process ended), with a deadline.
"""

from __future__ import annotations

import os
import signal
import sys

import pytest
import trio

import reward_fixtures as fx
from rewards import open_reward_pool

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not sys.platform.startswith("linux") or not hasattr(os, "pidfd_open"),
                       reason="pidfd (Linux) needed to watch the child"),
]

ARGS = ("prompt", "completion", [1, 2], [3])
DEADLINE_S = 10.0


class Child:
    """The reward's ``sleep`` child: its pid, read from the FIFO, and a pidfd to wait on."""

    def __init__(self, fifo):
        self.fifo = fifo
        self.pid = None
        self.pidfd = None
        self.known = trio.Event()

    async def read(self):
        async with await trio.open_file(self.fifo) as f:  # returns once the worker opened it
            self.pid = int(await f.read())
        self.pidfd = os.pidfd_open(self.pid)
        self.known.set()

    def alive(self):
        try:
            with open(f"/proc/{self.pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
        except FileNotFoundError:
            return False

    async def ended(self):
        """True once the child has exited (zombies count), within the deadline."""
        with trio.move_on_after(DEADLINE_S):
            await trio.lowlevel.wait_readable(self.pidfd)
            return True
        return False

    def cleanup(self):
        if self.pidfd is not None:
            if self.alive():
                os.kill(self.pid, signal.SIGKILL)
            os.close(self.pidfd)


@pytest.fixture
def child(tmp_path):
    fifo = tmp_path / "pid.fifo"
    os.mkfifo(fifo)
    c = Child(str(fifo))
    yield c
    c.cleanup()


async def test_the_child_dies_with_the_worker_on_timeout(child):
    async with open_reward_pool(max_workers=1, timeout_seconds=5.0, max_retries=0) as pool:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(child.read)
            outcome = await pool.score(fx.spawn_sleep, *ARGS, fifo=child.fifo, hang=True)
        assert outcome.is_fallback  # timed out; the worker was killed
        assert await child.ended(), f"sleep (pid {child.pid}) outlived its killed worker"
        assert pool.statistics().workers_killed == 1


async def test_the_child_dies_with_the_worker_on_cancellation(child):
    async with open_reward_pool(max_workers=1, timeout_seconds=60.0, max_retries=0) as pool:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(child.read)

            async def score():
                await pool.score(fx.spawn_sleep, *ARGS, fifo=child.fifo, hang=True)

            nursery.start_soon(score)
            await child.known.wait()
            assert child.alive()
            nursery.cancel_scope.cancel()
        assert await child.ended(), f"sleep (pid {child.pid}) outlived its cancelled worker"


async def test_a_background_child_dies_when_the_pool_closes(child):
    async with open_reward_pool(max_workers=1, timeout_seconds=60.0, max_retries=0) as pool:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(child.read)
            outcome = await pool.score(fx.spawn_sleep, *ARGS, fifo=child.fifo, hang=False)
        assert outcome.reward == 1.0
        assert child.alive()  # the reward returned and left it running; the worker lives on
    assert await child.ended(), f"sleep (pid {child.pid}) outlived the closed pool"


_ENGINE = """
import sys, trio
sys.path[:0] = {paths!r}
import reward_fixtures as fx
from rewards import open_reward_pool

async def main():
    async with open_reward_pool(max_workers=1, timeout_seconds=600.0, max_retries=0) as pool:
        await pool.score(fx.spawn_sleep, "p", "c", [1], [2], fifo={fifo!r}, hang=True)

trio.run(main)
"""


async def test_the_tree_dies_when_the_engine_process_is_killed(child):
    import subprocess
    from pathlib import Path

    paths = [str(Path(fx.__file__).parent), str(Path(__file__).resolve().parents[2])]
    engine = subprocess.Popen([sys.executable, "-c", _ENGINE.format(paths=paths, fifo=child.fifo)])
    try:
        with trio.fail_after(120):  # a cold interpreter and a spawned worker on a busy machine
            await child.read()
        assert child.alive()
        engine.kill()  # SIGKILL: no clean-up runs in the engine
        assert await child.ended(), f"sleep (pid {child.pid}) outlived the SIGKILLed engine process"
    finally:
        engine.kill()
        engine.wait()

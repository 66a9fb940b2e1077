"""Issue 13, class 3 and issue 24, class 5: a reward that starts a child process (``sleep
1000``: a compiler, a test runner) and hangs.  On timeout, on cancellation, when the pool or
the engine closes and when a worker retires, the reward worker's whole process tree dies,
not only the worker: also a child in its own session (``start_new_session=True``, as
sandboxes start programs) and an orphan in its own session whose parent exited at once.

Tier: contract (real worker processes).  The reward writes its child's pid into a named
pipe; the test holds a pidfd of that child and waits for it to become readable (the process
ended), with a deadline.
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
        def read_fifo():
            with open(self.fifo) as f:  # returns once the worker opened it
                return f.read()

        with trio.fail_after(120):  # a cold spawn worker on a busy machine; then the reward writes at once
            self.pid = int(await trio.to_thread.run_sync(read_fifo, abandon_on_cancel=True))
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
        try:  # a reader given up on still waits in open(): let it return
            os.close(os.open(self.fifo, os.O_WRONLY | os.O_NONBLOCK))
        except OSError:  # no reader left
            pass
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


#: how the reward starts its ``sleep``: in the worker's session, in its own session, or in its
#: own session through a parent that exits at once (an orphan)
STARTERS = {
    "same-session": (fx.spawn_sleep, {}),
    "own-session": (fx.spawn_sleep, {"new_session": True}),
    "orphan": (fx.spawn_orphan, {}),
}
starters = pytest.mark.parametrize("starter", sorted(STARTERS))


def _reward(starter: str, child: Child, hang: bool):
    fn, kwargs = STARTERS[starter]
    return fn, {"fifo": child.fifo, "hang": hang, **kwargs}


def _subreaper(pid: int) -> int:
    """PR_GET_CHILD_SUBREAPER of this process (``pid`` must be ours): 1 if it is one."""
    import ctypes

    assert pid == os.getpid()
    flag = ctypes.c_int(-1)
    assert ctypes.CDLL(None, use_errno=True).prctl(37, ctypes.byref(flag), 0, 0, 0) == 0
    return flag.value


@starters
async def test_the_child_dies_with_the_worker_on_timeout(child, starter):
    fn, kwargs = _reward(starter, child, hang=True)
    async with open_reward_pool(max_workers=1, timeout_seconds=5.0, max_retries=0) as pool:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(child.read)
            outcome = await pool.score(fn, *ARGS, **kwargs)
        assert outcome.is_fallback  # timed out; the worker was killed
        assert await child.ended(), f"sleep (pid {child.pid}) outlived its killed worker"
        assert pool.statistics().workers_killed == 1
    assert _subreaper(os.getpid()) == 0  # the host changed nothing process-wide


@starters
async def test_the_child_dies_with_the_worker_on_cancellation(child, starter):
    fn, kwargs = _reward(starter, child, hang=True)
    async with open_reward_pool(max_workers=1, timeout_seconds=60.0, max_retries=0) as pool:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(child.read)

            async def score():
                await pool.score(fn, *ARGS, **kwargs)

            nursery.start_soon(score)
            await child.known.wait()
            assert child.alive()
            nursery.cancel_scope.cancel()
        assert await child.ended(), f"sleep (pid {child.pid}) outlived its cancelled worker"


@starters
async def test_a_background_child_dies_when_the_pool_closes(child, starter):
    fn, kwargs = _reward(starter, child, hang=False)
    async with open_reward_pool(max_workers=1, timeout_seconds=60.0, max_retries=0) as pool:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(child.read)
            outcome = await pool.score(fn, *ARGS, **kwargs)
        assert outcome.reward == 1.0
        assert child.alive()  # the reward returned and left it running; the worker lives on
    assert await child.ended(), f"sleep (pid {child.pid}) outlived the closed pool"


async def test_a_hung_rewards_child_in_its_own_session_dies_when_the_engine_closes(child):
    from engine import EngineConfig, SimBackend, SimConfig, open_rollout_engine
    from engine.datasets import builtin_arith, to_item
    from engine.testing import build_tiny_tokenizer
    from engine.types import GenerationHyperparameters
    from workflows.rlvr import RLVRWorkflow

    tok = build_tiny_tokenizer()
    sim = SimBackend(SimConfig(vocab_size=len(tok), eos_token_id=tok.eos_token_id, first_token_id=0,
                               out_len_median=4, seed=1))
    item = {**to_item(builtin_arith(1)[0]), "fifo": child.fifo, "hang": True, "new_session": True}
    workflow = RLVRWorkflow(fx.spawn_sleep, GenerationHyperparameters(max_new_tokens=4), tok)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(child.read)
        async with open_rollout_engine(sim, EngineConfig(reward_max_workers=1, reward_timeout_seconds=600.0)) as engine:
            engine.submit(item, workflow)
            await child.known.wait()  # the reward runs, its child is started
            assert child.alive()
    assert await child.ended(), f"sleep (pid {child.pid}) outlived the closed engine"


async def test_a_background_child_in_its_own_session_dies_when_its_worker_retires(child):
    from rewards import _worker

    async with open_reward_pool(max_workers=1, timeout_seconds=60.0, max_retries=0, batch_size=1) as pool:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(child.read)
            await pool.score(fx.spawn_sleep, *ARGS, fifo=child.fifo, hang=False, new_session=True)
        first = await pool.score(fx.return_pid, *ARGS)
        assert child.alive()  # the worker lives on, and so does what its reward left running
        left = await pool.score(fx.leave_zombies, *ARGS, count=_worker.MAX_ZOMBIE_CHILDREN)
        assert left.reward >= _worker.MAX_ZOMBIE_CHILDREN  # so the worker retires after this job
        assert await child.ended(), f"sleep (pid {child.pid}) outlived its retired worker"
        second = await pool.score(fx.return_pid, *ARGS)  # a fresh worker took over
        assert second.reward != first.reward
        assert pool.statistics().worker_deaths == 0  # retired, not died


_ENGINE = """
import sys, trio
sys.path[:0] = {paths!r}
import reward_fixtures as fx
from rewards import open_reward_pool

async def main():
    async with open_reward_pool(max_workers=1, timeout_seconds=600.0, max_retries=0) as pool:
        print(pool._slots.board.path, flush=True)
        await pool.score(fx.{fn}, "p", "c", [1], [2], fifo={fifo!r}, hang=True, **{kwargs!r})

trio.run(main)
"""


@starters
async def test_the_tree_dies_when_the_engine_process_is_killed(child, starter):
    import subprocess
    from pathlib import Path

    fn, kwargs = STARTERS[starter]
    paths = [str(Path(fx.__file__).parent), str(Path(__file__).resolve().parents[2])]
    script = _ENGINE.format(paths=paths, fifo=child.fifo, fn=fn.__name__, kwargs=kwargs)
    engine = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        with trio.fail_after(120):  # a cold interpreter and a spawned worker on a busy machine
            board = Path((await trio.to_thread.run_sync(engine.stdout.readline)).strip())
            await child.read()
        assert child.alive() and board.exists()
        engine.kill()  # SIGKILL: no clean-up runs in the engine
        assert await child.ended(), f"sleep (pid {child.pid}) outlived the SIGKILLed engine process"
        with trio.move_on_after(DEADLINE_S):  # the worker's guardian deletes the pool's board file
            while board.parent.exists():
                await trio.sleep(0.05)
        assert not board.parent.exists(), f"{board} outlived the SIGKILLed engine process"
    finally:
        engine.kill()
        engine.wait()
        engine.stdout.close()

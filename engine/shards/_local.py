"""Shards as plain local processes: ``python -m engine.shards._shard_main`` spawned
with ``trio.lowlevel.open_process``, talking over two pipes (:class:`FrameStream`).

The child gets its own session (a Ctrl-C in the terminal reaches the coordinator,
which closes the shards in order) and this process's ``sys.path`` as
``PYTHONPATH`` (it imports the same code, and the modules of the workflow and
reward).  Its stdout and stderr are this process's.  It ends on ``close``, on end
of its input pipe (the coordinator is gone, even SIGKILLed), or when killed.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from typing import Any

import trio

from ._protocol import FrameStream

__all__ = ["LocalShardLink", "start_local_shard"]


class LocalShardLink:
    """A shard process and its channel."""

    kind = "process"

    def __init__(self, process: Any, channel: FrameStream) -> None:
        self.process = process
        self.channel = channel
        self.pid: int | None = process.pid

    async def exit_reason(self, wait_s: float = 5.0) -> str:
        """How the process ended, after waiting up to ``wait_s`` for it to end."""
        with trio.move_on_after(wait_s):
            await self.process.wait()
        code = self.process.returncode
        if code is None:
            return "its channel closed but the process is still running"
        if code < 0:
            try:
                return f"killed by {signal.Signals(-code).name}"
            except ValueError:
                return f"killed by signal {-code}"
        return f"exited with status {code}"

    def kill(self) -> None:
        if self.process.returncode is None:
            try:
                self.process.kill()
            except ProcessLookupError:
                pass

    async def aclose(self, grace_s: float = 10.0) -> None:
        """Wait up to ``grace_s`` for the process to end (after ``close``), kill it if
        it has not, then close the pipes."""
        with trio.move_on_after(grace_s):
            await self.process.wait()
        if self.process.returncode is None:
            self.kill()
            await self.process.wait()
        await self.channel.aclose()


def _child_env() -> dict[str, str]:
    paths = [os.path.abspath(p or os.curdir) for p in sys.path]
    paths = [p for p in dict.fromkeys(paths) if os.path.isdir(p)]
    return dict(os.environ, PYTHONPATH=os.pathsep.join(paths), TOKENIZERS_PARALLELISM="false")


#: pipe capacity asked for (Linux ``F_SETPIPE_SZ``; 1 MiB is the unprivileged maximum by default): a frame of
#: ~100 results is ~0.5-1 MB, written and read in one or two system calls instead of one per 64 KiB
PIPE_BYTES = 1 << 20


def _widen(fd: int) -> None:
    """Ask for a :data:`PIPE_BYTES` pipe (where the platform allows; the default size otherwise)."""
    import fcntl

    set_size = getattr(fcntl, "F_SETPIPE_SZ", None)
    if set_size is not None:
        try:
            fcntl.fcntl(fd, set_size, PIPE_BYTES)
        except OSError:  # above /proc/sys/fs/pipe-max-size, or out of the user's pipe budget: keep the default
            pass


async def start_local_shard(index: int) -> LocalShardLink:
    """Spawn shard ``index``; returns once the process exists (the caller sends ``init``)."""
    to_child_r, to_child_w = os.pipe()
    from_child_r, from_child_w = os.pipe()
    for fd in (to_child_w, from_child_w):
        _widen(fd)
    try:
        process = await trio.lowlevel.open_process(
            [sys.executable, "-m", "engine.shards._shard_main", str(to_child_r), str(from_child_w)],
            pass_fds=(to_child_r, from_child_w), env=_child_env(), start_new_session=True,
            stdin=subprocess.DEVNULL)
    except BaseException:
        for fd in (to_child_r, to_child_w, from_child_r, from_child_w):
            os.close(fd)
        raise
    os.close(to_child_r)
    os.close(from_child_w)
    channel = FrameStream(trio.lowlevel.FdStream(to_child_w), trio.lowlevel.FdStream(from_child_r))
    return LocalShardLink(process, channel)

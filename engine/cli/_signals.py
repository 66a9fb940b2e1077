"""SIGINT / SIGTERM handling for the ``rollout`` application.

Only the command line uses this module: it is the application, so it may own
the process's signals (the engine, a library, never touches them).
:func:`watch_signals` runs inside ``trio.run`` and holds a
``trio.open_signal_receiver`` for both signals while the run lasts:

- the first signal is recorded on an :class:`Interrupt` and cancels the given
  cancel scope (the CLI wraps engine start-up and the collection loop in it), so
  admission stops, episodes in flight are cancelled and the CLI writes what has
  completed;
- a second signal, while that shutdown is still running, writes one line on
  stderr and ends the process at once (``os._exit``, exit status ``128 +
  signum``), as a user pressing Ctrl-C twice expects.  Outputs stay consistent
  (the commit protocol of :mod:`engine.cli.outputs` survives any kill).

Exit statuses follow the shell convention: 130 for SIGINT, 143 for SIGTERM.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass

import trio

__all__ = ["Interrupt", "exit_at_once", "watch_signals"]

SIGNALS = (signal.SIGINT, signal.SIGTERM)


@dataclass
class Interrupt:
    """The first signal received (``None`` while none was)."""

    signum: int | None = None

    @property
    def name(self) -> str | None:
        return None if self.signum is None else signal.Signals(self.signum).name

    @property
    def exit_code(self) -> int:
        """``128 + signum`` (130 SIGINT, 143 SIGTERM); 0 when not interrupted."""
        return 0 if self.signum is None else 128 + self.signum


def exit_at_once(signum: int) -> None:
    """The second signal: one line on stderr, then ``os._exit(128 + signum)``."""
    name = signal.Signals(signum).name
    try:
        sys.stderr.write(f"rollout: second {name}: exiting at once (completed work is kept; "
                         "continue with --resume)\n")
        sys.stderr.flush()
    finally:
        os._exit(128 + signum)


async def watch_signals(interrupt: Interrupt, scope: trio.CancelScope, *,
                        on_second: Callable[[int], None] = exit_at_once,
                        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    """Receive SIGINT and SIGTERM until cancelled: the first cancels ``scope``,
    the next calls ``on_second(signum)``.  Must run in the main thread (trio's
    rule for signal receivers); previous handlers are restored on exit."""
    with trio.open_signal_receiver(*SIGNALS) as signals:
        task_status.started()
        async for signum in signals:
            if interrupt.signum is None:
                interrupt.signum = signum
                scope.cancel()
            else:
                on_second(signum)

"""Unit tier: the CLI's signal watcher (real signals sent to this process while
trio's receiver holds them), and the second signal's immediate exit (a child
process)."""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys
from pathlib import Path

import trio

from engine.cli._signals import Interrupt, watch_signals

ROOT = Path(__file__).resolve().parents[2]


async def test_the_first_signal_cancels_the_scope_and_the_second_is_handed_on():
    interrupt, seconds, got_second = Interrupt(), [], trio.Event()

    def on_second(signum):
        seconds.append(signum)
        got_second.set()

    async with trio.open_nursery() as nursery:
        with trio.CancelScope() as scope:
            await nursery.start(functools.partial(watch_signals, interrupt, scope, on_second=on_second))
            os.kill(os.getpid(), signal.SIGTERM)
            with trio.fail_after(10):
                await trio.sleep_forever()  # until the watcher cancels the scope
        assert scope.cancelled_caught
        assert (interrupt.name, interrupt.exit_code, seconds) == ("SIGTERM", 143, [])
        os.kill(os.getpid(), signal.SIGINT)
        with trio.fail_after(10):
            await got_second.wait()
        nursery.cancel_scope.cancel()
    assert seconds == [signal.SIGINT] and interrupt.signum == signal.SIGTERM  # the first one decides the exit


def test_a_second_signal_exits_at_once_with_one_line():
    code = "from engine.cli._signals import exit_at_once; import signal; exit_at_once(signal.SIGINT); print('not here')"
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 130 and proc.stdout == ""
    assert proc.stderr.splitlines() == [
        "rollout: second SIGINT: exiting at once (completed work is kept; continue with --resume)"]

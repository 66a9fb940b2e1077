"""Reward functions and actors used by tests/test_rewards*.py, run in real worker processes.

They live in their own importable module (``tests/`` is on ``sys.path`` under
pytest's default "prepend" import mode, and spawn workers inherit the parent's
``sys.path``) so that they are pickled by reference and behave like a user's
module-level reward functions.  Every function has the reward signature
``(prompt, completions, prompt_ids, completion_ids, **data)``.
"""

from __future__ import annotations

import os
import time
from typing import Any

from rewards import RewardActor


def _log(path: str | None) -> None:
    """Append one line per call, so a test can count attempts across processes."""
    if path is not None:
        with open(path, "a") as f:
            f.write(f"{os.getpid()}\n")


def return_pid(prompt, completions, prompt_ids, completion_ids, **data) -> int:
    """The worker's pid (an int, so it also checks int -> float conversion)."""
    return os.getpid()


def return_value(prompt, completions, prompt_ids, completion_ids, *, value: Any, log=None, **data):
    """Return ``value`` unchanged (None, NaN, "x", numpy arrays, ...)."""
    _log(log)
    return value


def sleep_then_return(prompt, completions, prompt_ids, completion_ids, *, seconds: float, **data):
    """Work for ``seconds`` (a workload, not synchronisation), then return 1.0."""
    time.sleep(seconds)
    return 1.0


def sleep_forever(prompt, completions, prompt_ids, completion_ids, *, log=None, **data):
    """Hang (30 s, far beyond any test timeout)."""
    _log(log)
    time.sleep(30)
    return 1.0


def announce_pid_then_sleep(prompt, completions, prompt_ids, completion_ids, *, fifo: str, **data):
    """Write this worker's pid into the named pipe ``fifo``, then hang.

    Opening a FIFO for writing blocks until the test opens it for reading, so
    the test learns the pid exactly when the job is running.
    """
    with open(fifo, "w") as f:
        f.write(str(os.getpid()))
    time.sleep(30)
    return 1.0


def crash_once(prompt, completions, prompt_ids, completion_ids, *, marker: str, **data):
    """Kill the worker (``os._exit``) the first time, then return 1.0."""
    if not os.path.exists(marker):
        open(marker, "w").close()
        os._exit(3)
    return 1.0


def crash_always(prompt, completions, prompt_ids, completion_ids, **data):
    """Kill the worker on every call."""
    os._exit(3)


def raise_value_error(prompt, completions, prompt_ids, completion_ids, *, log=None, **data):
    """Raise ValueError('bad input 42'), logging the attempt."""
    _log(log)
    raise ValueError("bad input 42")


def explode_outside(parent_pid: int) -> str:
    """Unpickling helper: fails in any process other than ``parent_pid``."""
    if os.getpid() != parent_pid:
        raise RuntimeError("this object cannot be loaded in a worker")
    return "loaded"


class LoadsOnlyInParent:
    """Picklable, but unpickling it in a worker process raises."""

    def __reduce__(self):
        return explode_outside, (os.getpid(),)


# ------------------------------------------------------------------ reward actors


class CountingActor(RewardActor):
    """Logs each setup() (one pid per line in ``setup_log``); ``__call__`` returns
    how many calls this instance has served in this process (state survives),
    or hangs with ``hang=True``."""

    def __init__(self, setup_log: str) -> None:
        self.setup_log = setup_log

    def setup(self) -> None:
        _log(self.setup_log)
        self.served = 0

    def __call__(self, prompt, completions, prompt_ids, completion_ids, *, hang=False, **data):
        if hang:
            time.sleep(30)
        self.served += 1
        return self.served


class PidActor(CountingActor):
    """Like CountingActor, but returns the worker's pid."""

    def __call__(self, prompt, completions, prompt_ids, completion_ids, **data):
        time.sleep(data.get("seconds", 0.0))
        return os.getpid()


class SlowSetupActor(RewardActor):
    """setup() works for ``setup_s`` seconds (a workload: loading a model)."""

    def __init__(self, setup_s: float) -> None:
        self.setup_s = setup_s

    def setup(self) -> None:
        time.sleep(self.setup_s)

    def __call__(self, prompt, completions, prompt_ids, completion_ids, **data):
        return 1.0


class BrokenSetupActor(RewardActor):
    """setup() raises ValueError (logging the attempt)."""

    def __init__(self, setup_log: str) -> None:
        self.setup_log = setup_log

    def setup(self) -> None:
        _log(self.setup_log)
        raise ValueError("no grader today")

    def __call__(self, prompt, completions, prompt_ids, completion_ids, **data):
        return 1.0


class LockInSetupActor(RewardActor):
    """Unpicklable state made in setup(): fine, setup runs in the worker."""

    def setup(self) -> None:
        import threading

        self.lock = threading.Lock()

    def __call__(self, prompt, completions, prompt_ids, completion_ids, **data):
        with self.lock:
            return 0.5


class LockInInitActor(LockInSetupActor):
    """Unpicklable state made in __init__: reported clearly."""

    def __init__(self) -> None:
        import threading

        self.lock = threading.Lock()


def length_reward(prompt, completions, prompt_ids, completion_ids, **data) -> float:
    return float(len(completions))


def raise_key_error(prompt, completions, prompt_ids, completion_ids, *, log=None, **data):
    """Read a data key that is not there (KeyError), logging the attempt."""
    _log(log)
    return float(data["answer"])


def wrong_signature(prompt, completions, log=None):
    """A reward written with the wrong signature (no prompt_ids/completion_ids/**data)."""
    _log(log)
    return 1.0


def spawn_sleep(prompt, completions, prompt_ids, completion_ids, *, fifo: str, hang: bool, **data):
    """Start ``sleep 1000`` (a child process: a compiler, a test runner), write its pid into
    the named pipe ``fifo``, then wait for it (``hang``) or return 1.0 leaving it running."""
    import subprocess

    child = subprocess.Popen(["sleep", "1000"])
    with open(fifo, "w") as f:
        f.write(str(child.pid))
    if hang:
        child.wait()
    return 1.0


def text_digest(prompt, completions, prompt_ids, completion_ids, **data) -> float:
    """A digest of the texts the reward received (exact in float32): checks that
    text decoded in the worker is what ``tokenizer.decode`` gives."""
    import zlib

    assert isinstance(prompt, str) and isinstance(completions, str)
    return float(zlib.crc32(f"{prompt}\x00{completions}".encode()) % (1 << 24))


async def async_text_digest(prompt, completions, prompt_ids, completion_ids, **data) -> float:
    """:func:`text_digest`, in-process (an ``async def`` reward)."""
    return text_digest(prompt, completions, prompt_ids, completion_ids, **data)


def slow_init_worker() -> None:
    """A worker start as slow as a spawn worker re-importing a training script's
    ``__main__`` (torch, transformers): 3 s, then the pool's real init hook."""
    from rewards import _worker

    time.sleep(3.0)
    _worker.init_worker()

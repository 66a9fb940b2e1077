"""A reward worker's process tree: find every process it started, and kill them all.

Standard library only (reward worker processes import it through
:mod:`rewards._worker`); Linux only where it matters (``/proc``, ``prctl``), a
no-op elsewhere.

A reward may start processes in their own session or process group
(``subprocess.Popen(..., start_new_session=True)``: how sandboxed code-execution
rewards start programs), which a kill of the worker's process group misses, and
a process whose parent exited is re-parented away from the worker.  So
(issue 24, class 5):

* :func:`become_subreaper` makes a worker a *child subreaper*
  (``prctl(PR_SET_CHILD_SUBREAPER)``, Linux >= 3.4): a descendant whose parent
  exits is re-parented to the worker instead of to init, so every process the
  worker's rewards started, in whatever session, stays below the worker while
  the worker lives.  Called in the worker process only, never in the host.
* :func:`kill_tree` freezes the tree below a process (``SIGSTOP``, top down,
  walking ``/proc/<pid>/task/<tid>/children`` until no new process shows up: a
  stopped process cannot fork) and then kills every process in it with
  ``SIGKILL``.  The host calls it on a worker just before trio-parallel kills the
  worker (:mod:`rewards._slots`); the worker calls it on itself when it exits
  (pool closed, retired, idle).
* :func:`zombie_children` counts exited children nobody reaped: under a
  subreaper, an adopted process that exits stays a zombie of the worker (the
  worker cannot tell it from a child its reward still means to wait for), so a
  worker with many is retired (:func:`rewards._worker.retire_worker`).
"""

from __future__ import annotations

import os
import signal
import sys
import time

__all__ = ["become_subreaper", "descendants", "has_zombie_child", "kill_tree", "zombie_children"]

_PR_SET_CHILD_SUBREAPER = 36
#: Walks of the tree while freezing it (each finds the children of newly stopped processes).
_FREEZE_ROUNDS = 100
#: Seconds to wait for a stopped process to show as stopped, at most, per kill (a SIGSTOP
#: takes effect before the process runs any more code of its own: this is only for one
#: that was running on another CPU at that moment).
_FREEZE_WAIT_S = 0.1
#: States of a process that cannot fork any more (stopped, traced, dead) or that will
#: stop before it returns to its own code (``D``: inside the kernel, the SIGSTOP pending).
_FROZEN = (None, "T", "t", "Z", "X", "D")


def become_subreaper() -> bool:
    """Make this process a child subreaper (Linux); True if it is one now."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _state(pid: int) -> str | None:
    """The process state letter (``R``, ``S``, ``T``, ``Z``, ...), or None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0].decode()
    except (OSError, IndexError):
        return None


def _children(pid: int) -> list[int]:
    """The children of ``pid`` (every thread's), [] if it is gone."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return []
    found: list[int] = []
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/children", "rb") as f:
                found.extend(int(c) for c in f.read().split())
        except FileNotFoundError:  # no CONFIG_PROC_CHILDREN: scan every process's parent
            return _children_by_scan(pid)
        except OSError:
            continue
    return found


def _children_by_scan(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", "rb") as f:
                    if int(f.read().rsplit(b")", 1)[1].split()[1]) == pid:
                        found.append(int(entry))
            except (OSError, IndexError, ValueError):
                continue
    return found


def descendants(pid: int) -> list[int]:
    """Every live (not zombie) process below ``pid``, parents before children."""
    found: list[int] = []
    todo = [pid]
    while todo:
        for child in _children(todo.pop()):
            if _state(child) not in (None, "Z", "X"):
                found.append(child)
                todo.append(child)
    return found


def _signal(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except OSError:  # gone, or not ours to signal
        pass


def kill_tree(root: int, *, stop_root: bool, spare: int | None = None) -> int:
    """Freeze and kill every process below ``root`` but ``spare`` (``root`` itself is
    left alive; with ``stop_root`` it is stopped first, so that it starts nothing
    meanwhile: kill it after).  Returns how many processes were killed.  Never raises."""
    if not os.path.isdir("/proc/self/task"):  # no /proc: nothing to walk
        return 0
    if stop_root:
        _signal(root, signal.SIGSTOP)
    stopped: dict[int, None] = {}
    deadline = time.monotonic() + _FREEZE_WAIT_S
    for _ in range(_FREEZE_ROUNDS):
        found = [pid for pid in descendants(root) if pid != spare]
        new = [pid for pid in found if pid not in stopped]
        for pid in new:
            _signal(pid, signal.SIGSTOP)
            stopped[pid] = None
        if not new and all(_state(pid) in _FROZEN for pid in found):
            break  # frozen: nobody below root can fork any more
        if not new:
            if time.monotonic() > deadline:
                break
            time.sleep(0.001)  # a SIGSTOP is delivered asynchronously: wait for it to take effect
    for pid in stopped:
        _signal(pid, signal.SIGKILL)
    return len(stopped)


def has_zombie_child() -> bool:
    """True if a child of this process has exited and not been reaped (one
    ``waitid`` that reaps nothing)."""
    if not hasattr(os, "waitid"):
        return False
    try:
        return os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:  # no children at all
        return False


def zombie_children() -> int:
    """How many children of this process have exited and not been reaped."""
    if not has_zombie_child():
        return 0
    return sum(_state(pid) == "Z" for pid in _children(os.getpid()))

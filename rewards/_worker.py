"""Worker-side half of the reward pool: unpickle one job, run it, check the value.

This module is imported inside every reward worker process, so it imports only
the standard library.  :func:`run_job` is module-level so that trio-parallel can
pickle it by reference.

The parent pickles ``(reward_fn, args, kwargs)`` itself (see
:mod:`rewards._pickling`) so that an unpicklable function or argument is reported
with a clear message before any process is involved, and so that the bytes are
made once per call, not once per attempt.  A :class:`~rewards.RewardActor`
travels as an :class:`ActorRef` (its key and its own pickled bytes): the
worker keeps set-up actors in a per-process registry keyed by ``actor_key``
and unpickles and sets up an actor only the first time it sees its key (see
:mod:`rewards._actor`).

:func:`run_job` returns a tagged tuple instead of raising for everything the
parent must not retry:

* ``(OK, reward)``: ``reward`` is a finite Python ``float``;
* ``(INVALID, description)``: the function returned something that is not a
  finite real number (the description names its type);
* ``(LOAD_FAILED, description)``: the job could not be unpickled in the worker
  (for example its module cannot be imported there);
* ``(NOT_SET_UP, None)``: the job is an actor call, setup was not allowed, and
  this worker has not set the actor up (the parent re-sends it allowing setup,
  under the actor's setup timeout).

Process trees (**ours**; issue 13): :func:`init_worker` runs first in every
worker (trio-parallel's ``init`` hook).  It makes the worker the leader of a new
session and process group (``os.setsid``), so that whatever the reward starts
(a compiler, a test runner, ``sleep``) is in that group, and forks a tiny
*guardian* process into the group.  The guardian waits on a pipe whose only
writer is the worker and, on Linux, on a pidfd of the engine process; when the
worker dies (killed on timeout or cancellation, crashed, or exited because the
pool closed) or the engine process dies (even by SIGKILL), the guardian kills
the whole group with SIGKILL, itself included.  A child that starts its own
session (``start_new_session=True``) leaves the group; for a local pool's
workers (``init_worker(..., subreaper=True)``) those are covered too (issue 24,
:mod:`rewards._proctree`): the worker is a child subreaper, so every process
its rewards start stays below it, the host kills that whole tree just before
trio-parallel kills the worker (:mod:`rewards._slots`), and the worker kills it
itself when it exits (pool closed, retired, idle).  A worker left with
:data:`MAX_ZOMBIE_CHILDREN` unreaped children is retired
(:func:`retire_worker`, trio-parallel's ``retire`` hook).  When the engine
process dies, the guardian of a subreaper worker kills the worker's whole tree
too (the worker is still alive then, so nothing has been re-parented away); a
worker that dies by itself (a crash, the OOM killer) takes only its process
group with it.

An exception raised by the reward function itself propagates unchanged;
trio-parallel sends it back with its worker-side traceback (tblib).
:func:`run_batch` runs several jobs in one round trip and returns one tagged
result per job, an exception as ``(RAISED, exception)``.
"""

from __future__ import annotations

import inspect
import math
import mmap
import numbers
import os
import pickle
import select
import signal
import struct
import time
from typing import Any

from . import _proctree
from ._board import HEADER, REGION_BYTES, RETIRING

__all__ = [
    "INVALID",
    "LOAD_FAILED",
    "NOT_SET_UP",
    "OK",
    "RAISED",
    "ActorRef",
    "TokenText",
    "as_reward",
    "describe_value",
    "MAX_ZOMBIE_CHILDREN",
    "init_worker",
    "load_job",
    "retire_worker",
    "run_batch",
    "run_job",
    "run_ticketed",
]

OK = "ok"
INVALID = "invalid"
LOAD_FAILED = "load_failed"
NOT_SET_UP = "not_set_up"
RAISED = "raised"

#: Set-up reward actors of this process, by ``actor_key``.
_ACTORS: dict[str, Any] = {}
#: Tokenizers loaded in this process for :class:`TokenText`, by file path.
_TOKENIZERS: dict[str, Any] = {}

_REPR_CHARS = 80


def describe_value(value: Any) -> str:
    """``"<type> (<short repr>)"``, e.g. ``"NoneType (None)"``, ``"float (nan)"``."""
    cls = type(value)
    name = cls.__qualname__
    if cls.__module__ not in ("builtins", None):
        name = f"{cls.__module__}.{name}"
    text = repr(value)
    if len(text) > _REPR_CHARS:
        text = text[: _REPR_CHARS - 3] + "..."
    return f"{name} ({text})"


def _element_count(value: Any) -> int | None:
    """Element count of a tensor/array-like, or None if it is not one."""
    numel = getattr(value, "numel", None)
    if callable(numel):  # torch.Tensor
        return int(numel())
    size = getattr(value, "size", None)
    if isinstance(size, int):  # numpy.ndarray and numpy scalars
        return size
    return None


def as_reward(value: Any) -> tuple[str, Any]:
    """Convert a reward function's return value to ``(OK, float)`` or ``(INVALID, why)``.

    Accepted: ``int``, ``float``, any :class:`numbers.Real` (numpy scalars,
    ``fractions.Fraction``), and one-element tensors/arrays (through ``.item()``),
    provided the result is finite.  Rejected (``INVALID``): ``None``, NaN, +-inf,
    ``bool`` (ours: a bool is usually a bug such as returning a comparison by
    mistake; return ``float(ok)``), strings, coroutines, tensors with more than
    one element, anything else.
    """
    original = value
    if inspect.iscoroutine(value):
        value.close()  # avoid "coroutine was never awaited"
        return INVALID, (
            f"{describe_value(original)}; an async reward function must be declared "
            "with 'async def' so that the pool awaits it in-process"
        )
    if not isinstance(value, numbers.Real):
        count = _element_count(value)
        item = getattr(value, "item", None)
        if count is None or not callable(item):
            return INVALID, f"{describe_value(original)}; expected a finite real number"
        if count != 1:
            return INVALID, (
                f"{describe_value(original)} with {count} elements; "
                "expected a finite real number or a one-element tensor"
            )
        value = item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return INVALID, f"{describe_value(original)}; expected a finite real number"
    result = float(value)
    if not math.isfinite(result):
        return INVALID, f"{describe_value(original)}; expected a finite real number"
    return OK, result


class ActorRef:
    """A reward actor in a job: its key and its pickled bytes (unpickled only
    by a worker that has not set it up yet)."""

    __slots__ = ("key", "payload")

    def __init__(self, key: str, payload: bytes) -> None:
        self.key = key
        self.payload = payload

    def __reduce__(self) -> tuple[Any, tuple[str, bytes]]:
        return ActorRef, (self.key, self.payload)


class TokenText:
    """Text a reward receives, sent as token ids and decoded where the reward
    runs (ours; :func:`rewards.token_text` makes one).

    ``tokenizer_file``: a ``tokenizer.json`` (the Rust ``tokenizers.Tokenizer``,
    loaded once per process and kept); ``ids``: the token ids (a list of int);
    ``skip_special_tokens``: as in ``decode``.  :func:`resolve_texts` turns it
    into ``str`` before the reward function is called, so reward functions
    only ever see strings.
    """

    __slots__ = ("ids", "skip_special_tokens", "tokenizer_file")

    def __init__(self, tokenizer_file: str, ids: Any, skip_special_tokens: bool) -> None:
        self.tokenizer_file = tokenizer_file
        self.ids = ids
        self.skip_special_tokens = skip_special_tokens

    def __reduce__(self) -> tuple[Any, tuple[str, Any, bool]]:
        return TokenText, (self.tokenizer_file, self.ids, self.skip_special_tokens)

    def decode(self) -> str:
        """The text (loads the tokenizer file on first use in this process).

        Raises:
            OSError / Exception: the tokenizer file cannot be read or parsed.
        """
        tokenizer = _TOKENIZERS.get(self.tokenizer_file)
        if tokenizer is None:
            from tokenizers import Tokenizer

            tokenizer = _TOKENIZERS[self.tokenizer_file] = Tokenizer.from_file(self.tokenizer_file)
        return tokenizer.decode(self.ids, skip_special_tokens=self.skip_special_tokens)


def resolve_texts(args: tuple) -> tuple:
    """``args`` with every :class:`TokenText` decoded to ``str`` (the same
    tuple when there is none)."""
    if not any(type(a) is TokenText for a in args):
        return args
    return tuple(a.decode() if type(a) is TokenText else a for a in args)


def run_job(job: bytes, allow_setup: bool = True) -> tuple[str, Any]:
    """Unpickle ``(reward_fn, args, kwargs)``, call it, return a tagged result.

    If ``reward_fn`` is an :class:`ActorRef` whose actor this process has not
    set up, it is unpickled and its ``setup()`` run first, unless
    ``allow_setup`` is False: then ``(NOT_SET_UP, None)`` comes back.

    Raises:
        Exception: whatever the reward function (or the actor's ``setup()``)
            raises, unchanged.
    """
    try:
        reward_fn, args, kwargs = pickle.loads(job)
    except Exception as exc:
        return LOAD_FAILED, f"{type(exc).__name__}: {exc}"
    if isinstance(reward_fn, ActorRef):
        ref = reward_fn
        reward_fn = _ACTORS.get(ref.key)
        if reward_fn is None:
            if not allow_setup:
                return NOT_SET_UP, None
            try:
                reward_fn = pickle.loads(ref.payload)
            except Exception as exc:
                return LOAD_FAILED, f"{type(exc).__name__}: {exc}"
            reward_fn.setup()  # an exception here is the reward's exception
            _ACTORS[ref.key] = reward_fn
    return as_reward(reward_fn(*resolve_texts(args), **kwargs))


def load_job(job: bytes) -> tuple[str, Any]:
    """Unpickle a job without running it (a start-up check): ``(OK, 0.0)`` or
    ``(LOAD_FAILED, why)``.  An actor's own bytes are unpickled too, not set up."""
    try:
        reward_fn, _, _ = pickle.loads(job)
        if isinstance(reward_fn, ActorRef):
            pickle.loads(reward_fn.payload)
    except Exception as exc:
        return LOAD_FAILED, f"{type(exc).__name__}: {exc}"
    return OK, 0.0


def _portable(exc: Exception) -> Exception:
    """``exc`` made picklable with its traceback, or a RuntimeError naming it."""
    try:
        from tblib.pickling_support import install  # comes with trio-parallel

        install(exc)
    except ImportError:  # pragma: no cover
        pass
    try:
        pickle.loads(pickle.dumps(exc))  # some exceptions pickle but do not unpickle
    except Exception:
        return RuntimeError(f"{type(exc).__name__}: {exc}")
    return exc


def run_batch(jobs: list[bytes]) -> tuple[list[tuple[str, Any]], float]:
    """Run several jobs (micro-batching): one tagged result per job, in order,
    and the seconds they took together (this process's clock, so neither the
    round trip nor a worker's start-up is counted; the batcher sizes its
    batches from it).

    Actors are not set up here (``NOT_SET_UP``: the parent sends that job on its
    own, under the setup timeout).  A reward's exception becomes
    ``(RAISED, exception)`` instead of failing the batch.

    Run as the job of a ticket (:func:`run_ticketed`), it records on the pool's
    board which call is running and each result as it comes (:mod:`rewards._board`):
    if the worker is killed mid-batch, the parent still knows both.
    """
    results: list[tuple[str, Any]] = []
    board: Any = _BOARD  # (mapped whenever a region is set)
    region = _REGION
    used, recorded = HEADER.size, 0
    if region is not None:
        HEADER.pack_into(board, region, 0, 0, used, 0, time.monotonic())  # call 0 is running
    start = time.perf_counter()
    for i, job in enumerate(jobs):
        try:
            result = run_job(job, allow_setup=False)
        except Exception as exc:
            result = (RAISED, _portable(exc))
        results.append(result)
        if region is not None:
            if recorded == i:  # every earlier result is recorded: record this one too
                size = _record(board, region + used, REGION_BYTES - used, result)
                if size:
                    used += size
                    recorded += 1
            HEADER.pack_into(board, region, i + 1, recorded, used, 0, time.monotonic())  # record, then header
    return results, time.perf_counter() - start


def _record(board: Any, offset: int, room: int, result: tuple[str, Any]) -> int:
    """Write ``result`` at ``offset`` (length-prefixed pickle); its size, or 0 if it
    does not pickle or fit in ``room`` bytes."""
    try:
        data = pickle.dumps(result, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception:
        return 0
    size = 4 + len(data)
    if size > room:
        return 0
    board[offset:offset + size] = struct.pack("<i", len(data)) + data
    return size


#: The pool's job board (:mod:`rewards._board`), mapped at :func:`init_worker`; None
#: without one (a Ray actor, a worker of another context).
_BOARD: mmap.mmap | None = None
#: The offset of the running job's region on the board (:func:`run_ticketed`), or None.
_REGION: int | None = None


def run_ticketed(ticket: int, function: Any, *args: Any) -> Any:
    """``function(*args)`` as the job that holds ``ticket`` on the pool's board
    (:mod:`rewards._board`; what :func:`run_batch` records goes to its region).

    Raises:
        Exception: what ``function`` raises.
    """
    global _REGION, _RETIRE
    region = _REGION = None if _BOARD is None else ticket * REGION_BYTES
    try:
        return function(*args)
    finally:
        _REGION = None
        if _SUBREAPER and _proctree.has_zombie_child() and _zombies_checked() and \
                _proctree.zombie_children() >= MAX_ZOMBIE_CHILDREN:
            _RETIRE = True  # retire_worker() says so next; the host learns it from the board
            if region is not None and _BOARD is not None:
                flags_at = region + 12  # the header's flags field (rewards._board.HEADER)
                struct.pack_into("<i", _BOARD, flags_at, RETIRING)


#: A worker with this many exited children nobody reaped retires (they are processes its
#: rewards started and left, adopted by the worker as a subreaper; see rewards._proctree).
MAX_ZOMBIE_CHILDREN = 64
#: This worker is a child subreaper (:func:`init_worker` with ``subreaper=True``).
_SUBREAPER = False
#: Set after a job that left this worker with too many zombies (:func:`retire_worker`).
_RETIRE = False


#: Seconds between two zombie counts (:func:`run_ticketed`, when there is a zombie): at most
#: one /proc walk per second.
_ZOMBIE_CHECK_S = 1.0
_next_zombie_check = 0.0


def _zombies_checked() -> bool:
    """True when it is time to count zombies again (once per :data:`_ZOMBIE_CHECK_S`)."""
    global _next_zombie_check
    now = time.monotonic()
    if now < _next_zombie_check:
        return False
    _next_zombie_check = now + _ZOMBIE_CHECK_S
    return True


def retire_worker() -> bool:
    """trio-parallel's ``retire`` hook (called after every job): True once this worker
    holds :data:`MAX_ZOMBIE_CHILDREN` unreaped children; it then exits, killing its
    process tree, and a fresh worker replaces it."""
    return _RETIRE


def _kill_own_tree() -> None:
    """At exit (a ``multiprocessing`` finalizer): kill every process below this worker."""
    _proctree.kill_tree(os.getpid(), stop_root=False)


#: The board's file, which the guardian deletes if the engine process dies (nobody else can then).
_BOARD_PATH: str | None = None


def _attach_board(path: str) -> None:
    """Map the pool's board file (read and write), once per process."""
    global _BOARD, _BOARD_PATH
    if _BOARD is not None:
        return
    _BOARD_PATH = path
    fd = os.open(path, os.O_RDWR)
    try:
        _BOARD = mmap.mmap(fd, 0)
    finally:
        os.close(fd)


#: The write end of the guardian's pipe: open for as long as this worker lives.
_GUARD_FD: int | None = None


def init_worker(board: str | None = None, *, subreaper: bool = False) -> None:
    """trio-parallel's ``init`` hook: map the pool's job ``board`` (a file path,
    :mod:`rewards._board`; None: none), put this worker in its own session and
    process group and start its guardian (see the module docstring); with
    ``subreaper`` (a local pool's workers, not Ray actors), make it a child
    subreaper that kills its process tree when it exits.  The session part is a
    no-op where ``os.setsid``/``os.fork`` do not exist, or if the worker already
    leads a group (nothing of its own to kill then)."""
    global _GUARD_FD, _SUBREAPER
    if board is not None:
        _attach_board(board)
    if subreaper and not _SUBREAPER and _proctree.become_subreaper():
        _SUBREAPER = True
        from multiprocessing import util

        util.Finalize(None, _kill_own_tree, exitpriority=100)  # runs when the worker process exits
    if _GUARD_FD is not None or not hasattr(os, "setsid") or not hasattr(os, "fork"):
        return
    try:
        os.setsid()
    except OSError:
        return
    group = os.getpid()
    engine_fd = None
    if hasattr(os, "pidfd_open"):  # Linux >= 5.3: also die with the engine process
        try:
            engine_fd = os.pidfd_open(os.getppid())
        except OSError:
            engine_fd = None
    read_end, write_end = os.pipe()  # not inheritable: the reward's own children do not hold it
    if os.fork() == 0:
        try:
            _guard(read_end, engine_fd, group)
        finally:
            os._exit(0)
    os.close(read_end)
    if engine_fd is not None:
        os.close(engine_fd)
    _GUARD_FD = write_end


def _guard(read_end: int, engine_fd: int | None, group: int) -> None:
    """The guardian (a forked copy of the worker at init): hold nothing of the
    worker's, wait until the worker or the engine process is gone, then kill the
    group.  Never returns normally (SIGKILL of its own group)."""
    keep = [read_end] + ([engine_fd] if engine_fd is not None else [])
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):  # do not keep a caller's stdout pipe open
        os.dup2(devnull, fd)
    start = 3
    for fd in sorted(keep + [devnull]):
        if fd >= start:
            os.closerange(start, fd)
            start = fd + 1
    try:
        limit = max(os.sysconf("SC_OPEN_MAX"), start)
    except (AttributeError, ValueError, OSError):  # pragma: no cover
        limit = 1 << 16
    os.closerange(start, limit)  # the worker's pipes to the engine, the write end, ...
    os.close(devnull)
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, signal.SIG_IGN)  # only the worker's or the engine's end ends it
    ready, _, _ = select.select(keep, [], [])  # EOF on the pipe (worker gone) or pidfd readable (engine gone)
    if engine_fd in ready:  # the engine died (the worker lives): its whole tree, also other sessions
        if _SUBREAPER:
            _proctree.kill_tree(group, stop_root=True, spare=os.getpid())
        if _BOARD_PATH is not None:  # nobody else can delete the pool's board now
            for path, remove in ((_BOARD_PATH, os.unlink), (os.path.dirname(_BOARD_PATH), os.rmdir)):
                try:
                    remove(path)
                except OSError:  # gone already (another worker's guardian did it)
                    pass
    os.killpg(group, signal.SIGKILL)

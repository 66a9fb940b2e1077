"""A blocking facade for ordinary (synchronous) training loops.

::

    with RolloutEngineThread(HFBackend(model_dir), EngineConfig(consumer_batch_size=8)) as engine:
        for step in range(steps):
            batch = engine.prepare_batch(dataloader, workflow)   # blocks; generation runs ahead
            train(batch)
            engine.set_version(step + 1)

The trio loop runs in a background thread that owns the engine (its nursery,
backend and reward pool).  Every method hops into that loop with
``trio.from_thread`` and blocks until it returns, so the object is thread-safe:
several trainer threads may call it at once.  Errors raised inside the loop are
re-raised in the caller with their original type and traceback; if the loop
itself died, calls raise :class:`RuntimeError` whose ``__cause__`` is the error
that killed it.  :meth:`close` (or leaving the ``with`` block) cancels what is
still running, stops the workers and joins the thread.
"""

from __future__ import annotations

import threading
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

import outcome
import trio

from .backends.base import InferenceBackend
from .executor import EngineConfig, EngineStatistics, EpisodeResult, open_rollout_engine
from .types import ModelRequest, ModelResponse
from .workflow import EngineRewards

__all__ = ["CallCancelled", "RolloutEngineThread"]


class CallCancelled(Exception):
    """A call started from another thread (:mod:`engine.aio`) was cancelled by its caller."""


class RolloutEngineThread:
    """The engine's API as blocking, thread-safe methods (see the module docstring).

    Args:
        backend, config, reward_pool: as for :func:`engine.open_rollout_engine`.
        start_timeout_s: seconds :meth:`start` waits for the engine to come up
            (model loading included).

    Raises (from :meth:`start`): :class:`RuntimeError` (cause attached) when the
    engine fails to start or does not start in time.
    """

    def __init__(self, backend: InferenceBackend, config: EngineConfig | None = None, *,
                 reward_pool: EngineRewards | None = None, start_timeout_s: float = 600.0) -> None:
        self._backend, self._config, self._pool = backend, config, reward_pool
        self._start_timeout_s = start_timeout_s
        self._ready = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._token: trio.lowlevel.TrioToken | None = None
        self._stop: trio.Event | None = None
        self._calls: trio.Nursery | None = None  # tasks started by _spawn (engine.aio)
        self._engine: Any = None
        self._error: BaseException | None = None
        self._closed = False

    # -- lifecycle -------------------------------------------------------------------
    def start(self) -> RolloutEngineThread:
        with self._lock:
            if self._thread is not None:
                raise RuntimeError("RolloutEngineThread.start() called twice")
            self._thread = threading.Thread(target=self._thread_main, name="trio-rollout-engine", daemon=True)
            self._thread.start()
        if not self._ready.wait(self._start_timeout_s):
            raise RuntimeError(f"the rollout engine did not start within {self._start_timeout_s} s")
        if self._engine is None:
            self._thread.join()
            raise RuntimeError("the rollout engine failed to start") from self._error
        return self

    def _thread_main(self) -> None:
        try:
            trio.run(self._main)
        except BaseException as exc:  # reported to callers, never lost
            self._error = exc
        finally:
            self._ready.set()

    async def _main(self) -> None:
        async with open_rollout_engine(self._backend, self._config, reward_pool=self._pool) as engine:
            async with trio.open_nursery() as calls:  # closed before the engine: the calls use it
                self._stop = trio.Event()
                self._token = trio.lowlevel.current_trio_token()
                self._engine, self._calls = engine, calls
                self._ready.set()
                await self._stop.wait()
                calls.cancel_scope.cancel()

    def close(self) -> None:
        """Cancel what is still running, stop workers and join the thread.  Idempotent.

        Raises:
            RuntimeError: the loop had died with an error (attached as the cause).
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
        if self._thread is None:
            return
        if self._token is not None and self._stop is not None:
            try:
                trio.from_thread.run_sync(self._stop.set, trio_token=self._token)
            except trio.RunFinishedError:
                pass
        self._thread.join()
        if self._error is not None:
            raise RuntimeError("the rollout engine loop stopped with an error") from self._error

    def __enter__(self) -> RolloutEngineThread:
        return self.start()

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    # -- hopping into the loop ------------------------------------------------------------
    def _check(self) -> None:
        if self._closed:
            raise trio.ClosedResourceError("the rollout engine is closed")
        if self._engine is None:
            raise RuntimeError("the rollout engine is not started (use start() or a with block)")

    def _run(self, async_fn: Callable[..., Any], *args: Any) -> Any:
        self._check()
        try:
            return trio.from_thread.run(async_fn, *args, trio_token=self._token)
        except trio.RunFinishedError as exc:
            raise RuntimeError("the rollout engine loop is not running") from (self._error or exc)

    def _run_sync(self, fn: Callable[..., Any], *args: Any) -> Any:
        self._check()
        try:
            return trio.from_thread.run_sync(fn, *args, trio_token=self._token)
        except trio.RunFinishedError as exc:
            raise RuntimeError("the rollout engine loop is not running") from (self._error or exc)

    def _spawn(self, async_fn: Callable[..., Awaitable[Any]], args: tuple[Any, ...],
               done: Callable[[outcome.Outcome[Any]], None]) -> Callable[[], None]:
        """Start ``async_fn(*args)`` as a task of the engine's loop from any thread, without
        blocking and without a thread per call (:mod:`engine.aio` is built on it).

        ``done(outcome)`` is called once, in the loop's thread, when the task ends: its value,
        its error, :class:`trio.Cancelled` turned into :class:`CallCancelled` when the returned
        ``cancel()`` (thread-safe, idempotent) stopped it, or :class:`RuntimeError` when the
        engine closed under it.

        Raises:
            RuntimeError: the engine is not running.
        """
        self._check()
        scope = trio.CancelScope()

        async def call() -> None:
            try:
                with scope:
                    value = await async_fn(*args)
                    done(outcome.Value(value))
                    return
                done(outcome.Error(CallCancelled("the call was cancelled by its caller")))
            except trio.Cancelled:
                done(outcome.Error(RuntimeError("the rollout engine closed while the call ran")))
                raise
            except Exception as exc:  # the caller's to handle, with its own type
                done(outcome.Error(exc))

        def start() -> None:
            if self._calls is None or self._stop is None or self._stop.is_set():
                done(outcome.Error(RuntimeError("the rollout engine is closing")))
                return
            self._calls.start_soon(call)

        def cancel() -> None:
            try:
                self._token.run_sync_soon(scope.cancel)  # type: ignore[union-attr]
            except trio.RunFinishedError:
                pass  # the loop is gone, and the call with it

        try:
            self._token.run_sync_soon(start)  # type: ignore[union-attr]
        except trio.RunFinishedError as exc:
            raise RuntimeError("the rollout engine loop is not running") from (self._error or exc)
        return cancel

    # -- the engine's API, blocking ----------------------------------------------------------
    def submit(self, data: Any, workflow: Any, workflow_kwargs: dict[str, Any] | None = None,
               should_accept_fn: Callable[..., Any] | None = None, group_size: int = 1,
               task_id: int | None = None) -> int:
        """See :meth:`engine.RolloutEngine.submit`."""
        return self._run_sync(lambda: self._engine.submit(data, workflow, workflow_kwargs, should_accept_fn,
                                                          group_size, task_id))

    def wait(self, count: int, timeout: float | None = None) -> list[Any]:
        """See :meth:`engine.RolloutEngine.wait`."""
        return self._run(self._engine.wait, count, timeout)

    def wait_results(self, count: int, timeout: float | None = None) -> list[EpisodeResult]:
        """See :meth:`engine.RolloutEngine.wait_results`."""
        return self._run(self._engine.wait_results, count, timeout)

    def wait_for_task(self, task_id: int, timeout: float | None = None) -> EpisodeResult:
        """See :meth:`engine.RolloutEngine.wait_for_task`."""
        return self._run(self._engine.wait_for_task, task_id, timeout)

    def rollout_batch(self, items: Iterable[Any], workflow: Any, **kwargs: Any) -> Any:
        """See :meth:`engine.RolloutEngine.rollout_batch`."""
        return self._run(lambda: self._engine.rollout_batch(list(items), workflow, **kwargs))

    def prepare_batch(self, dataloader: Iterable[Any], workflow: Any, **kwargs: Any) -> Any:
        """See :meth:`engine.RolloutEngine.prepare_batch`."""
        return self._run(lambda: self._engine.prepare_batch(dataloader, workflow, **kwargs))

    def reset_data_stream(self) -> None:
        """See :meth:`engine.RolloutEngine.reset_data_stream`."""
        self._run_sync(self._engine.reset_data_stream)

    @property
    def data_stream(self) -> Any:
        """See :attr:`engine.RolloutEngine.data_stream` (read it, do not drive it from this thread)."""
        return self._run_sync(lambda: self._engine.data_stream)

    def agenerate(self, req: ModelRequest) -> ModelResponse:
        """Blocking ``agenerate`` (for scripts; episodes should run in workflows)."""
        return self._run(self._engine.agenerate, req)

    def update_weights(self, source: Any, *, version: int, mode: str = "abort") -> None:
        """See :meth:`engine.RolloutEngine.update_weights`."""
        self._run(lambda: self._engine.update_weights(source, version=version, mode=mode))

    def set_version(self, version: int) -> None:
        """See :meth:`engine.RolloutEngine.set_version`."""
        self._run_sync(self._engine.set_version, version)

    def restore(self, version: int) -> None:
        """See :meth:`engine.RolloutEngine.restore`."""
        self._run_sync(self._engine.restore, version)

    def state_dict(self) -> dict[str, Any]:
        """See :meth:`engine.RolloutEngine.state_dict`."""
        return self._run_sync(self._engine.state_dict)

    def load_state_dict(self, state: dict[str, Any], workflow: Any = None,
                        workflow_kwargs: dict[str, Any] | None = None,
                        should_accept_fn: Callable[..., Any] | None = None) -> list[int]:
        """See :meth:`engine.RolloutEngine.load_state_dict`."""
        return self._run_sync(lambda: self._engine.load_state_dict(state, workflow, workflow_kwargs, should_accept_fn))

    def pause(self) -> None:
        """See :meth:`engine.RolloutEngine.pause`."""
        self._run_sync(self._engine.pause)

    def resume(self) -> None:
        """See :meth:`engine.RolloutEngine.resume`."""
        self._run_sync(self._engine.resume)

    @property
    def version(self) -> int:
        """The current policy version."""
        return self._run_sync(lambda: self._engine.version)

    def statistics(self) -> EngineStatistics:
        """See :meth:`engine.RolloutEngine.statistics`."""
        return self._run_sync(self._engine.statistics)

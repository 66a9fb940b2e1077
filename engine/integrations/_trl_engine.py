"""The engine as TRL's (synchronous) thread sees it, and the trainer -> engine weight sync.

TRL calls ``rollout_func`` on its training thread.  :class:`BlockingEngine` gives that
thread one blocking API over either engine kind:

* :class:`engine.RolloutEngineThread` (the blocking facade): called directly;
* a trio-native :class:`engine.RolloutEngine` (``open_rollout_engine``): each call hops into
  the engine's trio loop with ``trio.from_thread``; so TRL must run in a worker thread of
  that loop (``await trio.to_thread.run_sync(trainer.train)``), or the adapter must be built
  inside the loop (its trio token is kept) and TRL run in any other thread.

:func:`sync_weights` publishes the trainer's current weights: as tensors for the
in-process ``hf`` backend (its ``load_state_dict`` copies them, no disk), as a
``save_pretrained`` folder for the server backends (``vllm``, ``sglang``), whose
``update_weights`` loads a folder the servers can read.
"""

from __future__ import annotations

import inspect
import logging
import shutil
from pathlib import Path
from typing import Any

import trio

from ..errors import BackendError, InvalidRequestError

__all__ = ["BlockingEngine", "TENSOR_BACKENDS", "sync_weights"]

logger = logging.getLogger(f"rollout.{__name__}")

#: backend kinds whose ``update_weights`` takes a state dict (the others take a folder)
TENSOR_BACKENDS = frozenset({"hf", "sim", "mock"})


class BlockingEngine:
    """Blocking ``submit`` / ``wait_for_task`` / ``update_weights`` / ``version`` /
    ``statistics`` over a facade or a trio-native engine (see the module docstring).

    Raises :class:`TypeError` naming the missing methods when ``engine`` is not an engine;
    (from each call, trio-native engine only): :class:`RuntimeError` naming the fix
    when called from the engine's own trio thread (it would block the loop) or from a
    thread that trio did not start while no trio token was captured.
    """

    #: what an engine needs for the adapter (both the facade and the trio-native engine have them)
    NEEDS = ("update_weights", "statistics")

    def __init__(self, engine: Any) -> None:
        missing = [name for name in self.NEEDS if not callable(getattr(engine, name, None))]
        if missing:
            raise TypeError(f"TRLRollout(engine=...): a {type(engine).__name__} is not a rollout engine (no "
                            f"{', '.join(missing)}): pass an engine.RolloutEngineThread (started) or the engine of "
                            "open_rollout_engine")
        self.engine = engine
        self.native = inspect.iscoroutinefunction(getattr(engine, "wait_for_task", None))
        self._token: trio.lowlevel.TrioToken | None = None
        if self.native:
            try:
                self._token = trio.lowlevel.current_trio_token()
            except RuntimeError:  # built outside the loop: TRL must then run in a trio worker thread
                self._token = None

    def _hop(self, sync: bool, fn: Any, *args: Any) -> Any:
        if self._token is None:
            if trio.lowlevel.in_trio_run():
                raise RuntimeError("rollout_func with a trio-native engine was called on the engine's own trio "
                                   "thread (it would block the loop): run the trainer in a worker thread, "
                                   "await trio.to_thread.run_sync(trainer.train)")
            try:  # a trio worker thread knows its loop: keep its token for every later call
                self._token = trio.from_thread.run_sync(trio.lowlevel.current_trio_token)
            except RuntimeError as exc:
                raise RuntimeError(
                    "rollout_func with a trio-native engine: run the trainer in a worker thread of the engine's "
                    "loop (await trio.to_thread.run_sync(trainer.train)), build the adapter inside that loop, "
                    "or use engine.RolloutEngineThread") from exc
        run = trio.from_thread.run_sync if sync else trio.from_thread.run
        return run(fn, *args, trio_token=self._token)

    def submit(self, data: Any, workflow: Any, *, workflow_kwargs: dict[str, Any] | None,
               should_accept_fn: Any, group_size: int) -> int:
        if not self.native:
            return self.engine.submit(data, workflow, workflow_kwargs, should_accept_fn, group_size)
        return self._hop(True, lambda: self.engine.submit(data, workflow, workflow_kwargs, should_accept_fn,
                                                          group_size))

    def wait_for_task(self, task_id: int, timeout_s: float) -> Any:
        if not self.native:
            return self.engine.wait_for_task(task_id, timeout_s)
        return self._hop(False, self.engine.wait_for_task, task_id, timeout_s)

    def update_weights(self, source: Any, *, version: int) -> None:
        if not self.native:
            self.engine.update_weights(source, version=version)
            return
        self._hop(False, lambda: self.engine.update_weights(source, version=version))

    @property
    def version(self) -> int:
        if not self.native:
            return int(self.engine.version)
        return int(self._hop(True, lambda: self.engine.version))

    def set_version(self, version: int) -> None:
        if not self.native:
            self.engine.set_version(version)
            return
        self._hop(True, self.engine.set_version, version)

    def statistics(self) -> Any:
        if not self.native:
            return self.engine.statistics()
        return self._hop(True, self.engine.statistics)

    def engine_config(self) -> Any:
        """The engine's :class:`~engine.EngineConfig` (None: the facade was given none: the defaults)."""
        config = getattr(self.engine, "config", None)
        return config if config is not None else getattr(self.engine, "_config", None)

    def backend_kind(self) -> str:
        return str(self.statistics().backend.kind)


def _unwrapped(trainer: Any) -> Any:
    model = trainer.accelerator.unwrap_model(trainer.model)
    if getattr(model, "peft_config", None) is not None:
        raise InvalidRequestError(
            "rollout_func weight sync: the trainer's model is a PEFT model; merge the adapter into the backend's "
            "model yourself (TRLRolloutConfig(weight_sync=callable)) or train without peft_config")
    return model


def sync_weights(engine: BlockingEngine, trainer: Any, *, version: int, mode: Any,
                 weights_dir: str | None, previous: list[Path]) -> str:
    """Publish ``trainer.model``'s weights to the engine's backend as ``version``.

    Args:
        mode: ``"tensors"``, ``"folder"``, ``"auto"`` (tensors for the ``hf``/``sim``/``mock``
            backends, a folder otherwise) or a callable ``(engine, trainer, version) -> None``
            that does it itself (``engine`` is the object given to the adapter).
        weights_dir: where ``"folder"`` mode writes ``step-<version>/`` (``save_pretrained``)
            and the path the servers are sent (made absolute from this process's working
            directory: a server resolves a relative path in its own); the folder of the
            previous sync is removed once the new one is loaded, and a folder that was not
            loaded is removed at once.
        previous: the folders this adapter wrote and has not removed yet (updated here).

    Returns: what was done (``"tensors"``, ``"folder"`` or ``"callable"``), for statistics.

    Raises:
        InvalidRequestError: folder mode without ``weights_dir``; a PEFT model.
        BackendError: the backend refused the weights (``engine.update_weights``'s error; in
            folder mode one error naming the step, the folder and the backend's reason, the
            engine's version unchanged).
    """
    if callable(mode):
        mode(engine.engine, trainer, version)
        return "callable"
    if mode == "auto":
        mode = "tensors" if engine.backend_kind() in TENSOR_BACKENDS else "folder"
    model = _unwrapped(trainer)
    if mode == "tensors":
        # detached views of the live parameters: the backend copies them (load_state_dict) while
        # this thread waits, so nothing changes them under the copy
        state = {name: tensor.detach() for name, tensor in model.state_dict().items()}
        engine.update_weights(state, version=version)
        return "tensors"
    if weights_dir is None:
        raise InvalidRequestError(
            f"rollout_func weight sync: the {engine.backend_kind()!r} backend loads weights from a folder its "
            "servers can read: set TRLRolloutConfig(weights_dir=...) (a path shared with the servers)")
    folder = Path(weights_dir).absolute() / f"step-{version}"
    model.save_pretrained(folder)
    try:
        engine.update_weights(str(folder), version=version)
    except BackendError as exc:
        shutil.rmtree(folder, ignore_errors=True)  # never loaded: only the folder loaded last stays
        raise BackendError(
            f"rollout_func weight sync: the {engine.backend_kind()} backend did not load the trainer's weights of "
            f"step {version} from {folder}: {exc} (weights_dir ({Path(weights_dir).absolute()}) must be a folder "
            "every server reads at the same path, and the trainer's model the served model); the engine's "
            f"weights version stays {engine.version}") from exc
    for old in previous:
        shutil.rmtree(old, ignore_errors=True)
    previous[:] = [folder]
    logger.info("rollout_func: weights of step %s published from %s", version, folder)
    return "folder"

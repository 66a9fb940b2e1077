"""Import strings for workflows and reward functions (as in the reference design).

Accepted forms:

* ``"pkg.module:attr"`` (``attr`` may be dotted: ``"pkg.module:Class.method"``);
* ``"pkg.module.attr"`` (the last dot splits module and attribute);
* ``"path/to/file.py:attr"``: the file is loaded as a module of its own (its
  directory is *not* added to ``sys.path``, so its imports must be importable
  anyway).

:func:`resolve_reward_fn` resolves a reward function once, at workflow
construction, and checks what would otherwise fail in every episode: the
object is callable and (unless it is ``async def``, which runs in-process) can
be pickled for a reward worker process and unpickled again.  A function from
a file reaches the spawned workers as a :class:`FileFunction`: pickled as its
path and name, it loads the file in the worker on first use (once per process).

This module imports only the standard library at import time: reward worker
processes import it to unpickle a :class:`FileFunction`.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import os
import sys
from typing import Any

from .errors import RewardError, RolloutError, WorkflowError

__all__ = ["FileFunction", "import_object", "resolve_reward_fn"]

#: Modules loaded from files in this process, by absolute path.
_FILE_MODULES: dict[str, Any] = {}


def _split(spec: str) -> tuple[str, str]:
    """``(module name or file path, attribute path)``; raises ValueError with the reason."""
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError("expected a non-empty import string like 'pkg.module:name' or 'path/to/file.py:name'")
    spec = spec.strip()
    if ":" in spec:
        target, _, attr = spec.rpartition(":")
    else:
        target, _, attr = spec.rpartition(".")
    if not target or not attr:
        raise ValueError("expected 'pkg.module:name', 'pkg.module.name' or 'path/to/file.py:name'")
    return target, attr


def _load_file(path: str) -> Any:
    """Load ``path`` as a module (once per process and path)."""
    path = os.path.abspath(path)
    module = _FILE_MODULES.get(path)
    if module is not None:
        return module
    if not os.path.isfile(path):
        raise ValueError(f"file not found: {path}")
    stem = os.path.splitext(os.path.basename(path))[0]
    name = f"_rollout_file_{hashlib.sha1(path.encode()).hexdigest()[:12]}_{stem}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ValueError(f"cannot load {path} as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # as an import would: dataclasses and pickling look modules up there
    try:
        spec.loader.exec_module(module)
    except BaseException as exc:
        sys.modules.pop(name, None)
        raise ValueError(f"loading {path} raised {type(exc).__name__}: {exc}") from exc
    _FILE_MODULES[path] = module
    return module


def _getattr_path(obj: Any, attr: str, where: str) -> Any:
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ValueError(f"{where} has no attribute {attr!r}") from None
    return obj


def _import(spec: str) -> tuple[Any, str, bool]:
    """``(object, attribute path, from a file)``; raises ValueError with the reason."""
    target, attr = _split(spec)
    if target.endswith(".py") or os.sep in target or "/" in target:
        return _getattr_path(_load_file(target), attr, os.path.abspath(target)), attr, True
    try:
        module = importlib.import_module(target)
    except ImportError as exc:
        hint = f" (a file in the current folder: {target}.py:NAME)" if "." not in target else ""
        raise ValueError(f"cannot import module {target!r}: {exc}{hint}") from exc
    except Exception as exc:
        raise ValueError(f"importing module {target!r} raised {type(exc).__name__}: {exc}") from exc
    return _getattr_path(module, attr, f"module {target!r}"), attr, False


def import_object(spec: str, *, error: type[RolloutError] = WorkflowError, what: str = "workflow") -> Any:
    """Resolve an import string (see the module docstring) to the object it names.

    Raises:
        ``error`` (default :class:`WorkflowError`): ``"<what> '<spec>': <reason>"``
            when the string is malformed, the module or file cannot be loaded,
            or the attribute does not exist.
    """
    try:
        return _import(spec)[0]
    except ValueError as exc:
        raise error(f"{what} {spec!r}: {exc}") from None


class FileFunction:
    """A reward function loaded from a ``.py`` file, picklable by its path.

    Calling it calls the function; pickling it keeps only ``(path, attr)``, so a
    spawned worker loads the file itself on first use (cached per process).

    Attributes:
        path: the absolute path of the file.
        attr: the attribute path of the function in it.
    """

    def __init__(self, path: str, attr: str, fn: Any = None) -> None:
        self.path = os.path.abspath(path)
        self.attr = attr
        self._fn = fn
        self.__qualname__ = attr  # how the reward pool names it in errors
        self.__module__ = self.path

    def _resolve(self) -> Any:
        if self._fn is None:
            self._fn = _getattr_path(_load_file(self.path), self.attr, self.path)
        return self._fn

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._resolve()(*args, **kwargs)

    def __getstate__(self) -> dict[str, Any]:
        return {"path": self.path, "attr": self.attr}

    def __setstate__(self, state: dict[str, Any]) -> None:
        FileFunction.__init__(self, state["path"], state["attr"])

    def __repr__(self) -> str:
        return f"FileFunction({self.path!r}:{self.attr})"


def _is_async(fn: Any) -> bool:
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))


def resolve_reward_fn(reward_fn: Any) -> Any:
    """Resolve and check a reward function, once (at workflow construction).

    Args:
        reward_fn: a callable, or an import string naming one (a function, a
            :class:`~rewards.RewardActor` instance, or a ``RewardActor`` subclass,
            which is instantiated with no arguments).

    Returns:
        The callable to hand to the reward pool: the object itself, or a
        :class:`FileFunction` for a sync function loaded from a file.

    Raises:
        RewardError: ``"reward function '<spec>': <reason>"`` when the string
            cannot be resolved, the object is not callable (or is a class other
            than a ``RewardActor``), or a sync function cannot be pickled for a
            worker process or unpickled again.
    """
    spec = reward_fn
    from_file = False
    if isinstance(reward_fn, str):
        try:
            reward_fn, attr, from_file = _import(reward_fn)
        except ValueError as exc:
            raise RewardError(f"reward function {spec!r}: {exc}") from None
        if inspect.isclass(reward_fn):
            from rewards import RewardActor

            if not issubclass(reward_fn, RewardActor):
                raise RewardError(f"reward function {spec!r}: is a class, not a function; name a function, "
                                  "a RewardActor instance or a RewardActor subclass")
            try:
                reward_fn = reward_fn()
            except Exception as exc:
                raise RewardError(f"reward function {spec!r}: {reward_fn.__qualname__}() raised "
                                  f"{type(exc).__name__}: {exc}") from exc
        if from_file and not _is_async(reward_fn):
            if not inspect.isfunction(reward_fn):
                raise RewardError(f"reward function {spec!r}: from a file, name a plain function "
                                  f"(got {type(reward_fn).__name__}); put classes in an importable module")
            reward_fn = FileFunction(spec.rpartition(":")[0], attr, reward_fn)
    if not callable(reward_fn):
        raise RewardError(f"reward function {spec!r}: {type(reward_fn).__name__} object is not callable")
    if _is_async(reward_fn):
        return reward_fn  # runs in-process: never pickled
    import pickle

    from ._portable import dumps

    try:
        pickle.loads(dumps(reward_fn))
    except Exception as exc:
        raise RewardError(
            f"reward function {spec!r}: cannot be sent to a reward worker process "
            f"({type(exc).__name__}: {exc}); define it at module level in an importable module or a file, "
            "create unpicklable state in a RewardActor's setup(), or make it 'async def' to run in-process"
        ) from exc
    return reward_fn

"""Reward functions from modules a fresh worker process cannot import (issue 24, class 4).

Pickle names a function (or a class) by module and qualified name; the worker
imports that module to find it.  A module loaded by path
(``importlib.util.spec_from_file_location``: verl's ``custom_reward_function.path``)
and registered in ``sys.modules`` pickles fine in the host, where it is
imported, but a spawned worker cannot import it by name: every call failed
with ``ModuleNotFoundError``.  So before a job is pickled,
:func:`modules_to_ship` asks, once per module, whether a fresh interpreter would
find the reward's module where this process found it (the import system's
finders, minus ``sys.modules``), and if not:

* a module with a file travels **by file path**: the job carries a
  :class:`ModuleFile` ahead of the function (:class:`Shipped`), and unpickling
  it in the worker loads that file under the module's own name
  (:func:`load_module_file`, once per worker process), before the function,
  class or actor that names it is looked up.  Per call this costs what pickling
  by reference costs; the module's globals live in the worker as those of an
  imported module (a cache at module level survives between calls); classes of
  that module (a :class:`~rewards.RewardActor` subclass) resolve too.
* a module without a file (built in memory) travels **by value**: it is
  registered with ``cloudpickle.register_pickle_by_value`` (cloudpickle's one
  process-wide registry: the only change this makes in the host, for that
  module only) and the job is pickled with cloudpickle.

Only the reward function's own module(s) are checked (its class's for an
instance, the wrapped function's for a ``functools.partial`` or a bound
method); what *that* module imports must be importable in the worker, which
the start-up check (:meth:`rewards.RewardPool.check_reward_fn`, run in a real
worker) reports as one error.

Standard library only at import: worker processes import this module to run
:func:`load_module_file`.
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
import os
import sys
import types
from typing import Any

__all__ = ["ModuleFile", "Shipped", "load_module_file", "modules_to_ship"]


class ModuleFile:
    """A module to load from ``path`` under ``name`` in the worker (unpickling it does)."""

    __slots__ = ("name", "path")

    def __init__(self, name: str, path: str) -> None:
        self.name = name
        self.path = path

    def __reduce__(self) -> tuple[Any, tuple[str, str]]:
        return load_module_file, (self.name, self.path)

    def __repr__(self) -> str:
        return f"ModuleFile({self.name!r}, {self.path!r})"


def load_module_file(name: str, path: str) -> None:
    """Load ``path`` as module ``name`` into ``sys.modules``, unless that module
    is already loaded from that file (once per process).

    Raises:
        Exception: what loading the file raises (its own imports, a missing file).
    """
    module = sys.modules.get(name)
    if module is not None and os.path.abspath(getattr(module, "__file__", "") or "") == path:
        return None
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path} as module {name!r}")
    module = importlib.util.module_from_spec(spec)
    previous = sys.modules.get(name)
    sys.modules[name] = module  # as an import would: its own classes and pickles look it up there
    try:
        spec.loader.exec_module(module)
    except BaseException:
        if previous is None:
            sys.modules.pop(name, None)
        else:
            sys.modules[name] = previous
        raise
    return None


def _after_loading(loaded: Any, value: Any) -> Any:
    return value


class Shipped:
    """``value`` pickled after ``modules`` (:class:`ModuleFile`): unpickling loads them
    first, then looks ``value`` up by reference and returns it."""

    __slots__ = ("modules", "value")

    def __init__(self, modules: tuple[ModuleFile, ...], value: Any) -> None:
        self.modules = modules
        self.value = value

    def __reduce__(self) -> tuple[Any, tuple[tuple[ModuleFile, ...], Any]]:
        return _after_loading, (self.modules, self.value)


#: Per module name: (the module object decided on, its verdict: None (a worker imports it),
#: a ModuleFile (ship by path) or True (by value, registered with cloudpickle)).
_VERDICTS: dict[str, tuple[Any, ModuleFile | bool | None]] = {}


def _same_origin(a: str | None, b: str | None) -> bool:
    if a is None or b is None:
        return a is b
    if a == b:
        return True
    return os.path.isabs(a) and os.path.isabs(b) and os.path.realpath(a) == os.path.realpath(b)


def _fresh_spec(name: str) -> Any:
    """The spec a fresh import of ``name`` would find (``sys.meta_path``'s finders,
    not ``sys.modules``), or None."""
    parent, _, _ = name.rpartition(".")
    path = None
    if parent:
        parent_module = sys.modules.get(parent)
        if parent_module is None or _verdict(parent) is not None:
            return None
        path = getattr(parent_module, "__path__", None)
        if path is None:
            return None
    for finder in sys.meta_path:
        find_spec = getattr(finder, "find_spec", None)
        if find_spec is None:
            continue
        try:
            spec = find_spec(name, path)
        except Exception:  # a finder that cannot answer for this name
            continue
        if spec is not None:
            return spec
    return None


def _decide(name: str, module: Any) -> ModuleFile | bool | None:
    if name == "__main__" or name in sys.builtin_module_names:  # (dumps sends __main__ by value)
        return None
    spec = getattr(module, "__spec__", None)
    if spec is not None:
        fresh = _fresh_spec(name)
        if fresh is not None and _same_origin(fresh.origin, spec.origin):
            return None  # a worker imports it by name, from the same place
    origin = getattr(spec, "origin", None) if spec is not None and spec.has_location else None
    origin = origin or getattr(module, "__file__", None)
    if isinstance(origin, str) and os.path.isfile(origin):
        return ModuleFile(name, os.path.abspath(origin))
    import cloudpickle

    cloudpickle.register_pickle_by_value(module)
    return True


def _verdict(name: str) -> ModuleFile | bool | None:
    module = sys.modules.get(name)
    if module is None:  # not imported under that name: pickling by reference fails, cloudpickle sends it by value
        return None
    cached = _VERDICTS.get(name)
    if cached is not None and cached[0] is module:
        return cached[1]
    verdict = _decide(name, module)
    _VERDICTS[name] = (module, verdict)
    return verdict


def _module_names(fn: Any) -> list[str]:
    if isinstance(fn, functools.partial):
        fn = fn.func
    names: list[Any] = []
    if inspect.ismethod(fn):
        names.append(type(fn.__self__).__module__)
        fn = fn.__func__
    target = fn if isinstance(fn, (types.FunctionType, type)) else type(fn)
    names.append(getattr(target, "__module__", None))
    return [n for n in names if isinstance(n, str)]


def modules_to_ship(fn: Any) -> tuple[tuple[ModuleFile, ...], bool]:
    """``(files, by_value)`` for reward function ``fn`` (see the module docstring):
    the module files a worker must load before unpickling it, and whether it must be
    pickled with cloudpickle (a module of its is registered by value).  ``((), False)``
    for a function of an importable module (cached: a dict lookup per call)."""
    if type(fn) is types.FunctionType:  # fast path: a plain function
        name = fn.__module__
        cached = _VERDICTS.get(name)
        if cached is not None and cached[1] is None and cached[0] is sys.modules.get(name):
            return (), False
        names = [name]
    else:
        names = _module_names(fn)
    files: list[ModuleFile] = []
    by_value = False
    for name in names:
        verdict = _verdict(name)
        if isinstance(verdict, ModuleFile):
            files.append(verdict)
        elif verdict is True:
            by_value = True
    return tuple(files), by_value

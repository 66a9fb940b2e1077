"""Unit tier: the public API of each package is explicit (httpx's
tests/test_exported_members.py habit): a sorted ``__all__`` whose every name
resolves, lazily."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.parametrize("package", ["engine", "engine.chat", "engine.cli", "engine.datasets", "engine.models",
                                     "engine.openai", "workflows", "rewards"])
def test_all_is_sorted_and_every_name_resolves(package):
    module = importlib.import_module(package)
    assert module.__all__ == sorted(module.__all__)
    assert set(module._LAZY) == set(module.__all__)
    for name in module.__all__:
        assert getattr(module, name) is not None, name
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        module.nope  # noqa: B018


@pytest.mark.parametrize("package", ["engine", "engine.chat", "engine.cli", "engine.datasets", "engine.models",
                                     "engine.openai", "workflows"])
def test_what_type_checkers_see_is_what_resolves(package):
    """The face's ``if TYPE_CHECKING:`` imports name every lazy export, from the module its
    ``_LAZY`` map gives (a type checker does not run ``__getattr__``)."""
    module = importlib.import_module(package)
    tree = ast.parse(Path(module.__file__).read_text(encoding="utf-8"))
    seen = {}
    for node in tree.body:
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            for stmt in node.body:
                assert isinstance(stmt, ast.ImportFrom)
                source = importlib.util.resolve_name("." * stmt.level + (stmt.module or ""), package)
                seen.update({alias.asname or alias.name: source for alias in stmt.names})
    assert seen == module._LAZY


def test_importing_the_packages_does_not_import_torch():
    code = ("import sys, engine, engine.chat, engine.cli, engine.datasets, engine.models, engine.openai, workflows, "
            "rewards; "
            "print('torch' in sys.modules, 'trio' in sys.modules, 'openai' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False", "False"]


def test_the_packages_ship_their_type_information():
    """PEP 561: a ``py.typed`` marker in each top-level package, listed as package data
    (setuptools puts in the wheel only the data files it is told of)."""
    tomllib = pytest.importorskip("tomllib" if sys.version_info >= (3, 11) else "tomli")
    root = Path(__file__).resolve().parents[2]
    setuptools = tomllib.loads((root / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["setuptools"]
    for package in ("engine", "workflows", "rewards"):
        assert (root / package / "py.typed").is_file(), package
        assert "py.typed" in setuptools["package-data"].get(package, []), package

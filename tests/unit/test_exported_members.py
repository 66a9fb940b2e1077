"""Unit tier: the public API of each package is explicit (httpx's
tests/test_exported_members.py habit): a sorted ``__all__`` whose every name
resolves, lazily."""

from __future__ import annotations

import importlib
import subprocess
import sys

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


def test_importing_the_packages_does_not_import_torch():
    code = ("import sys, engine, engine.chat, engine.cli, engine.datasets, engine.models, engine.openai, workflows, "
            "rewards; "
            "print('torch' in sys.modules, 'trio' in sys.modules, 'openai' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False", "False"]

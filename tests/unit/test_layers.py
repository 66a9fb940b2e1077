"""Unit tier: the house's floors, read from the source (an AST scan of every import,
function-level and TYPE_CHECKING ones included): no import runs from a lower layer up to
a higher one (ARCHITECTURE_REVIEW.md section 3; issue 25).

Floors, bottom up: the engine's core (``engine/`` top level, ``engine.chat``,
``engine.models``, ``engine.datasets``, ``engine.backends``, ``engine.testing``) and the
reward pool (``rewards``), with ``engine.openai.interaction`` (the ``dict[id,
Interaction]`` an episode may return, AReaL's third return type, is part of the
contract the executor reads); the workflow implementations (``workflows``); the services
built on the engine (``engine.shards``, ``engine.serve``, ``engine.openai``) and the
trainer adapters (``engine.integrations``, which may run the built-in workflows); the
``rollout`` application (``engine.cli``); the benchmarks.  The subpackage faces say the
same in their docstrings.
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _modules() -> dict[str, Path]:
    mods = {}
    for package in ("engine", "workflows", "rewards"):
        for path in (ROOT / package).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            mods[".".join(parts)] = path
    return mods


MODULES = _modules()


def _imports(module: str) -> list[tuple[str, int, bool]]:
    """``(imported module, line, at module level)`` for every import of ``module``."""
    path = MODULES[module]
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found = []

    def visit(node: ast.AST, top: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inner = top and not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.Import):
                found.extend((a.name, child.lineno, top) for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    base = module.split(".")
                    base = base[: len(base) - child.level + (1 if path.name == "__init__.py" else 0)]
                    target = ".".join(base + ([child.module] if child.module else []))
                else:
                    target = child.module or ""
                found.extend((f"{target}.{a.name}" if f"{target}.{a.name}" in MODULES else target, child.lineno, top)
                             for a in child.names)
            visit(child, inner)

    visit(tree, True)
    return found


def _under(module: str, *packages: str) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


CONTRACT = ("engine.openai.interaction",)
ABOVE_CORE = ("engine.cli", "engine.shards", "engine.serve", "engine.openai", "engine.integrations")
CORE = [m for m in MODULES if m.startswith("engine.") and not _under(m, *ABOVE_CORE)] + ["engine", *CONTRACT]


def _violations(importers: list[str], forbidden: tuple[str, ...]) -> list[str]:
    return [f"{MODULES[m].relative_to(ROOT)}:{line} imports {target}"
            for m in importers for target, line, _ in _imports(m)
            if _under(target, *forbidden) and not _under(target, *CONTRACT)]


def test_the_scan_sees_the_imports_it_checks():  # the checks below cannot pass by reading nothing
    assert any(t == "engine.cli._backend" for t, _, _ in _imports("engine.cli._run"))
    assert any(t == "engine.context" for t, _, _ in _imports("engine.backends.hf._backend"))
    assert any(t.startswith("benchmarks") and not top for t, _, top in _imports("engine.cli._main"))
    assert len(CORE) > 60


def test_the_core_imports_neither_the_application_nor_the_services_nor_the_workflows():
    assert _violations(CORE, (*ABOVE_CORE, "workflows", "benchmarks")) == []


def test_backends_do_not_import_the_engine_above_them():
    backends = [m for m in MODULES if _under(m, "engine.backends")]
    assert _violations(backends, ("engine.executor", "engine.sync", *ABOVE_CORE)) == []


def test_rewards_import_only_the_core():
    rewards = [m for m in MODULES if _under(m, "rewards")]
    assert _violations(rewards, ("workflows", "engine.executor", "benchmarks", *ABOVE_CORE)) == []


def test_workflows_do_not_import_the_application():
    workflows = [m for m in MODULES if _under(m, "workflows")]
    assert _violations(workflows, ("engine.cli", "engine.shards", "engine.serve", "engine.integrations",
                                   "benchmarks")) == []


def test_nothing_below_the_application_imports_it():
    below = [m for m in MODULES if not _under(m, "engine.cli")]
    assert _violations(below, ("engine.cli",)) == []


def test_only_rollout_bench_imports_the_benchmarks_and_only_when_run():
    """``benchmarks`` is an application of the engine installed beside it: the library
    never imports it, and ``rollout`` only inside ``rollout bench``'s branch."""
    found = [(m, line, top) for m in MODULES for target, line, top in _imports(m) if _under(target, "benchmarks")]
    assert [(m, top) for m, _, top in found] == [("engine.cli._main", False)]


@pytest.mark.parametrize("package", ["engine.chat", "engine.cli", "engine.datasets", "engine.models"])
def test_each_room_says_what_it_holds_and_what_it_may_import(package):
    doc = importlib.import_module(package).__doc__ or ""
    assert "May import" in doc and f":mod:`{package}." in doc, package


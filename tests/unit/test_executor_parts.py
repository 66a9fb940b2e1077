"""Unit tier: the executor's parts own their state, read from the source (an AST scan of
``engine/_*.py``; issue 25, ARCHITECTURE_REVIEW.md section 4, smell 3).

Each part (``_admission``, ``_ledger``, ``_batches``, ``_episode``, ``_checkpoint``, ...)
is handed the typed parts it needs by :class:`engine.executor.RolloutEngine`, which
composes them.  No function takes the engine untyped to reach into its private
attributes: no parameter named ``engine`` is typed ``Any`` (or not at all), no code reads
or writes ``engine._<name>``, and no parameter typed ``Any`` is used to reach a private
attribute.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PARTS = sorted((ROOT / "engine").glob("_*.py"))


def _untyped(arg: ast.arg) -> bool:
    return arg.annotation is None or ast.unparse(arg.annotation) in ("Any", "typing.Any")


def _private(attr: str) -> bool:
    return attr.startswith("_") and not attr.startswith("__")


def _violations(source: str) -> list[str]:
    found = []
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "engine" \
                and _private(node.attr):
            found.append(f"line {node.lineno}: engine.{node.attr}")
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        args = node.args
        params = [a for a in (*args.posonlyargs, *args.args, *args.kwonlyargs) if a.arg not in ("self", "cls")]
        untyped = {a.arg for a in params if _untyped(a)}
        found += [f"line {node.lineno}: {node.name}(engine: Any)" for a in params if a.arg == "engine" and _untyped(a)]
        for inner in ast.walk(node):
            if isinstance(inner, ast.Attribute) and isinstance(inner.value, ast.Name) and inner.value.id in untyped \
                    and inner.value.id != "engine" and _private(inner.attr):
                found.append(f"line {inner.lineno}: {node.name}: {inner.value.id}.{inner.attr} through an untyped parameter")
    return found


def test_the_scan_finds_what_the_parts_did_before():
    before = '''
def rollout_batch(engine: Any, items):
    engine._breaker.reset(watermark=engine._next_id)

def refill(engine) -> None:
    return engine.config

def why(eng: Any) -> str:
    return eng._counts["queued"]
'''
    assert sorted(_violations(before)) == [
        "line 2: rollout_batch(engine: Any)", "line 3: engine._breaker", "line 3: engine._next_id",
        "line 5: refill(engine: Any)", "line 9: why: eng._counts through an untyped parameter"]
    assert _violations("def f(ledger: Ledger, result: Any) -> int:\n    return ledger.next_id + result.task_id\n") == []


@pytest.mark.parametrize("path", PARTS, ids=[p.name for p in PARTS])
def test_no_part_takes_the_engine_untyped_to_reach_into_its_privates(path):
    assert _violations(path.read_text(encoding="utf-8")) == []

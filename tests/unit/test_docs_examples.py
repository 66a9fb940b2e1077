"""Every ```python block on the docs pages and in README.md runs, so the docs cannot rot.

The blocks run in one child process (``tests/fixtures/docs_examples.py``), each as a script's
``__main__`` in an empty working directory, offline: the simulated backend and the tiny
tokenizer.  A block that is a sketch (it needs a trainer, a GPU, a real server, or is a fragment
of a larger program) says so with ``<!-- not-run: REASON -->`` on the line above it; those are
the exceptions, and each one names why.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import docs_examples
from docs_examples import CodeBlock, code_blocks, pages

BLOCKS = [block for page in pages() for block in code_blocks(page)]
RUN = [block for block in BLOCKS if block.not_run is None]
#: the child process's bound: every block's own bound (``BLOCK_TIMEOUT_S``) is far below it
RUN_TIMEOUT_S = 900


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    folder = tmp_path_factory.mktemp("docs-examples")
    (folder / "blocks.json").write_text(json.dumps([{"id": b.id, "code": b.code} for b in RUN]), encoding="utf-8")
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               PYTHONPATH=os.pathsep.join([str(docs_examples.ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]))
    proc = subprocess.run([sys.executable, docs_examples.__file__, str(folder / "blocks.json"), str(folder / "results.json")],
                          env=env, cwd=folder, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    if proc.returncode != 0:
        pytest.fail(f"the docs examples' process exited {proc.returncode}:\n{proc.stderr[-6000:]}")
    return json.loads((folder / "results.json").read_text(encoding="utf-8"))


def test_docs_have_examples_and_few_sketches():
    assert len(RUN) >= 8, [b.id for b in RUN]
    # a sketch is a block that nothing runs: one whose marker names the test that runs its
    # code (a trainer's tier, an end-to-end test) is not one
    sketches = [b.id for b in BLOCKS if b.not_run and "tests/" not in b.not_run]
    assert len(sketches) <= len(RUN) // 2, sketches


@pytest.mark.parametrize("block", [b for b in BLOCKS if "trio.run(" in b.code], ids=lambda b: b.id)
def test_a_block_that_starts_trio_guards_main(block: CodeBlock):
    # reward workers are spawned processes that import a user's script again: without the
    # guard each worker would run the example (the runner cannot see this: its __main__ has no file)
    assert 'if __name__ == "__main__":' in block.code


@pytest.mark.parametrize("block", RUN, ids=lambda b: b.id)
def test_docs_example_runs(block: CodeBlock, results: dict[str, dict]):
    result = results[block.id]
    assert result["ok"], f"{block.id} failed:\n{result['error']}"


def test_a_not_run_marker_must_mark_a_python_block(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(docs_examples, "ROOT", tmp_path)
    page = tmp_path / "page.md"
    page.write_text("<!-- not-run: a sketch -->\n\n```python\nx = 1\n```\n\n```python\ny = 2\n```\n")
    assert [(b.line, b.not_run) for b in code_blocks(page)] == [(3, "a sketch"), (7, None)]
    page.write_text("<!-- not-run: a sketch -->\n\n```sh\nls\n```\n")
    with pytest.raises(ValueError, match="page.md:3: a not-run marker"):
        code_blocks(page)
    page.write_text("<!-- not-run: a sketch -->\nsome prose\n\n```python\nx = 1\n```\n")
    with pytest.raises(ValueError, match="page.md:2: a not-run marker"):
        code_blocks(page)

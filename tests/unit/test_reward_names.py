"""How messages name a reward function (``rewards._pickling.describe_fn``).

Regression: a reward loaded from a file (``--reward path/to/file.py:fn``) was named
``/path/to/file.py.fn`` in every warning and failure reason, neither the import
string the user gave nor a module path.
"""

from __future__ import annotations

from pathlib import Path

from engine.imports import resolve_reward_fn
from rewards._pickling import describe_fn
from rewards.gsm8k import gsm8k_reward


def test_a_file_reward_is_named_by_its_path_and_name(tmp_path: Path) -> None:
    path = tmp_path / "my_reward.py"
    path.write_text("def score(prompt, completions, prompt_ids, completion_ids, **data):\n    return 1.0\n")
    fn = resolve_reward_fn(f"{path}:score")
    assert describe_fn(fn) == f"{path}:score"


def test_a_module_reward_keeps_its_dotted_name() -> None:
    assert describe_fn(gsm8k_reward) == "rewards.gsm8k.gsm8k_reward"

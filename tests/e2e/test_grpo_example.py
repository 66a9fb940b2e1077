"""End-to-end tier: ``examples/grpo_minimal.py`` runs 3 GRPO steps on the tiny model
(issue 18): rollout overlapped with training in a thread, weights published each step."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_grpo_minimal_runs_three_steps_and_publishes_weights(tmp_path):
    spec = importlib.util.spec_from_file_location("grpo_minimal", ROOT / "examples" / "grpo_minimal.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = tmp_path / "steps.json"
    assert module.main(["--steps", "3", "--reward", f"{ROOT / 'examples' / 'toy_rewards.py'}:digit_fraction",
                        "--lr", "1e-3", "--json", str(out)]) == 0
    steps = json.loads(out.read_text())
    assert [s["step"] for s in steps] == [0, 1, 2]
    assert all(s["rows"] == 8 for s in steps)  # B = 2 groups of 4
    assert any(s["loss"] != 0.0 for s in steps)  # the toy reward gives non-zero advantages
    for s in steps:  # eta = 1: a batch consumed at step k holds tokens of version >= k - 1
        assert min(s["versions"]) >= s["step"] - 1 and max(s["versions"]) <= s["step"]

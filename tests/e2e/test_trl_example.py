"""End-to-end tier: ``examples/trl_grpo.py`` (TRL's GRPOTrainer with ``TRLRollout``) runs on the
tiny model with the real reward pool (worker processes), weights synced every step (issue 30)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_trl_example_trains_two_steps_on_the_tiny_model(tmp_path):
    spec = importlib.util.spec_from_file_location("trl_grpo", ROOT / "examples" / "trl_grpo.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = tmp_path / "steps.json"
    assert module.main(["--steps", "2", "--lr", "1e-3", "--max-new-tokens", "12", "--json", str(out)]) == 0
    steps = json.loads(out.read_text())
    assert [s["step"] for s in steps] == [1, 2]
    assert [s["version"] for s in steps] == [0, 1]  # each step's completions came from that step's weights
    assert all(s["samples_rerun"] == 0 for s in steps)

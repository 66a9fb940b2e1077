"""Unit tier: the safe calculator and MathAgentWorkflow on a scripted backend
(tool call, tool result, final answer), through the engine; end-to-end tier:
``rollout run --workflow math_agent`` on the sim backend."""

from __future__ import annotations

import pytest
import torch

from engine import open_rollout_engine
from engine.chat import decode_text
from engine.testing import InProcessRewardPool, build_tiny_tokenizer
from engine.types import GenerationHyperparameters
from openai_fixtures import ScriptedBackend, tool_call_text
from rewards.gsm8k import gsm8k_reward
from workflows.math_agent import CalculatorError, MathAgentWorkflow, calculate

ITEM = {"question": "Ava has 22 apples and buys 8 more. How many?", "answer": "#### 30"}


@pytest.mark.parametrize(("expression", "value"), [
    ("22 + 8", "30"), ("(12 + 7) * 3", "57"), ("7 / 2", "3.5"), ("6 / 3", "2"), ("2 ^ 10", "1024"),
    ("-3 * -3", "9"), ("1,000 + 1", "1001"), ("17 // 5 + 17 % 5", "5"), ("0.1 + 0.2", "0.3"),
])
def test_calculator_evaluates_plain_arithmetic(expression, value):
    assert calculate(expression) == value


@pytest.mark.parametrize(("expression", "needle"), [
    ("__import__('os').system('true')", "not allowed"), ("x + 1", "expression: Name"), ("(1).real", "Attribute"),
    ("[1, 2][0]", "not allowed"), ("9 ** 9 ** 9", "exponent too large"), ("1 / 0", "division by zero"),
    ("1 +", "not an arithmetic expression"), ("1" * 201, "longer than 200"), ("True + 1", "not allowed"),
    ("10 ** 19", "too large"), ("(-8) ** 0.5", "not a real number"),
])
def test_calculator_refuses_anything_else(expression, needle):
    with pytest.raises(CalculatorError, match=needle):
        calculate(expression)


def make_agent(tok, **kwargs):
    return MathAgentWorkflow(gsm8k_reward, GenerationHyperparameters(max_new_tokens=256), tok, **kwargs)


async def test_the_agent_calls_the_calculator_then_answers_and_is_rewarded():
    tok = build_tiny_tokenizer()
    backend = ScriptedBackend(tok, [tool_call_text("calculator", {"expression": "22 + 8"}), "She has #### 30"])
    async with open_rollout_engine(backend, reward_pool=InProcessRewardPool()) as engine:
        result = await engine.wait_for_task(engine.submit(ITEM, make_agent(tok)))
    assert result.status == "accepted"
    traj = result.trajectory
    assert traj.batch_size == torch.Size([1])  # concat: one row per conversation
    (in1, out1), (in2, out2) = backend.log
    ids, mask = traj["input_ids"][0].tolist(), traj["loss_mask"][0].tolist()
    assert ids == in2 + out2.output_tokens and in2[:len(in1) + out1.output_len] == in1 + out1.output_tokens
    sent1 = len(in1) + out1.output_len
    assert mask == [0] * len(in1) + [1] * out1.output_len + [0] * (len(in2) - sent1) + [1] * out2.output_len
    # between the turns: template glue and the calculator's result, all loss_mask 0
    assert decode_text(tok, ids[sent1:len(in2)]) == "\n<|im_start|>tool\n30<|im_end|>\n<|im_start|>assistant\n"
    assert decode_text(tok, in1).startswith("<|im_start|>system\nYou solve grade-school math problems")
    assert (traj["rewards"].item(), traj["num_turns"].item()) == (1.0, 2)
    assert not traj["retokenization_drift"].any()


async def test_a_wrong_answer_scores_zero_and_tool_errors_are_told_to_the_model():
    tok = build_tiny_tokenizer()
    backend = ScriptedBackend(tok, [tool_call_text("calculator", {"expression": "import os"}),
                                    tool_call_text("abacus", {}), "#### 31"])
    agent = make_agent(tok, export_style="individual", turn_discount=0.5)
    async with open_rollout_engine(backend, reward_pool=InProcessRewardPool()) as engine:
        result = await engine.wait_for_task(engine.submit(ITEM, agent))
    traj = result.trajectory
    assert traj.batch_size == torch.Size([3]) and traj["rewards"].tolist() == [0.0, 0.0, 0.0]
    prompts = [decode_text(tok, inp) for inp, _ in backend.log]
    assert "<|im_start|>tool\nerror: not an arithmetic expression" in prompts[1]
    assert "error: unknown tool 'abacus'" in prompts[2]


async def test_the_turn_limit_ends_a_sample_and_the_reward_is_discounted_back():
    tok = build_tiny_tokenizer()
    call = tool_call_text("calculator", {"expression": "22 + 8"})
    backend = ScriptedBackend(tok, [call, "#### 30"], default=call)
    agent = make_agent(tok, max_turns=2, export_style="individual", turn_discount=0.5)
    async with open_rollout_engine(backend, reward_pool=InProcessRewardPool()) as engine:
        right = await engine.wait_for_task(engine.submit(ITEM, agent))
        backend.script = []  # from now on: a tool call every turn, never an answer
        capped = await engine.wait_for_task(engine.submit(ITEM, agent))
    assert right.trajectory["rewards"].tolist() == [0.5, 1.0]
    assert capped.trajectory.batch_size == torch.Size([2]) and capped.trajectory["rewards"].tolist() == [0.0, 0.0]


async def test_n_samples_run_concurrently_and_merge_into_one_episode():
    tok = build_tiny_tokenizer()
    backend = ScriptedBackend(tok, default="#### 30")
    agent = MathAgentWorkflow(gsm8k_reward, GenerationHyperparameters(n_samples=3, max_new_tokens=64), tok)
    async with open_rollout_engine(backend, reward_pool=InProcessRewardPool()) as engine:
        result = await engine.wait_for_task(engine.submit({"messages": [{"role": "user", "content": "22+8?"}],
                                                           "answer": "#### 30"}, agent))
    assert result.trajectory.batch_size == torch.Size([3]) and result.trajectory["rewards"].tolist() == [1.0] * 3


def test_bad_arguments_are_refused_at_construction():
    tok = build_tiny_tokenizer()
    for kwargs, needle in (({"max_turns": 0}, "max_turns"), ({"turn_discount": 2}, "turn_discount"),
                           ({"export_style": "flat"}, "export_style"), ({"tool_parser": "nope"}, "tool_parser")):
        with pytest.raises(ValueError, match=needle):
            make_agent(tok, **kwargs)


@pytest.mark.slow
def test_rollout_run_math_agent_on_sim(tmp_path, capsys):
    from test_cli import _read_outputs, _run

    out = tmp_path / "out"
    code, stdout, err = _run(["run", "--backend", "sim", "--workflow", "math_agent", "--limit", "4",
                              "--max-new-tokens", "16", "--quiet", "--out", str(out)], capsys)
    assert code == 0, err
    batch, rows, summary = _read_outputs(out)
    assert (summary["submitted"], summary["accepted"], summary["failed"]) == (4, 4, 0)
    assert summary["workflow"] == "math_agent" and summary["retokenization_drifts"] == 0
    assert batch.batch_size == torch.Size([8])  # 4 episodes x 2 samples, one concat row each (noise: no tool call)
    assert summary["generated_tokens"] == int(batch["loss_mask"].sum())

"""End-to-end tier: ``rollout run --workflow agents_sdk_math`` / ``langgraph_math`` (the
GSM8K agent written with the OpenAI Agents SDK and with LangGraph; the ``agents`` extra)
on the sim backend: every episode accepted, no drift, the tokens counted equal the rows'
sampled tokens; without the frameworks, one clear error at construction."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from engine.errors import WorkflowError
from engine.testing import build_tiny_tokenizer
from engine.types import GenerationHyperparameters
from test_cli import _read_outputs, _run


@pytest.mark.slow
@pytest.mark.parametrize("workflow", ["agents_sdk_math", "langgraph_math"])
def test_rollout_run_with_an_agent_framework_workflow(tmp_path, capsys, monkeypatch, workflow):
    monkeypatch.delenv("LANGSMITH_TRACING", raising=False)
    monkeypatch.delenv("LANGCHAIN_TRACING_V2", raising=False)
    out = tmp_path / "out"
    code, _, err = _run(["run", "--backend", "sim", "--workflow", workflow, "--limit", "4", "--max-new-tokens", "16",
                         "--workflow-kwargs", '{"max_turns": 2}', "--quiet", "--out", str(out)], capsys)
    assert code == 0, err
    batch, _, summary = _read_outputs(out)
    assert (summary["submitted"], summary["accepted"], summary["failed"]) == (4, 4, 0)
    assert summary["workflow"] == workflow and summary["retokenization_drifts"] == 0
    assert batch.batch_size == torch.Size([8])  # 4 episodes x 2 samples (rollout run's default), one row each
    assert summary["generated_tokens"] == int(batch["loss_mask"].sum())


@pytest.mark.slow
@pytest.mark.parametrize("workflow", ["math_agent", "agents_sdk_math"])
def test_the_samples_of_a_seeded_agent_episode_differ(tmp_path, capsys, workflow):
    # a new-user trial: every sample of an agent episode reused the run seed, so a group's
    # samples were byte-identical (zero GRPO advantage); each sample now derives its own
    import json

    out = tmp_path / "out"
    code, _, err = _run(["run", "--backend", "sim", "--workflow", workflow, "--limit", "3", "--n-samples", "2",
                         "--seed", "0", "--max-new-tokens", "16", "--quiet", "--out", str(out)], capsys)
    assert code == 0, err
    rows = [json.loads(line) for line in (out / "rollouts.jsonl").read_text().splitlines()]
    by_task: dict[int, set[str]] = {}
    for row in rows:
        by_task.setdefault(row["task_id"], set()).add(row["completion"])
    assert len(by_task) == 3 and all(len(c) == 2 for c in by_task.values()), by_task


def test_a_missing_framework_is_one_clear_error(monkeypatch):
    from workflows.agents_sdk_math import AgentsSDKMathWorkflow
    from workflows.langgraph_math import LangGraphMathWorkflow

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name in ("agents", "langgraph") else real(name, *a))
    for cls, name in ((AgentsSDKMathWorkflow, "agents"), (LangGraphMathWorkflow, "langgraph")):
        with pytest.raises(WorkflowError, match=rf"\({name} not found\): pip install 'trio-rollout\[agents\]'"):
            cls("rewards.gsm8k:gsm8k_reward", GenerationHyperparameters(), build_tiny_tokenizer())

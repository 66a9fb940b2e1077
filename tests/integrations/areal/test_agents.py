"""AReaL's OpenAI-SDK agents on the adapter: ``areal.workflow.openai.math_agent.MathAgent`` and
``MultiTurnMathAgent``, unchanged.

Each gets ``base_url`` / ``api_key`` / ``http_client`` whose transport answers the OpenAI routes
in the episode's own trio task (the engine's ``EngineOpenAI``: no socket); its ``openai.AsyncOpenAI``
never notices.  Its reward (AReaL's ``AsyncRewardWrapper(math_reward_fn)``, swapped for the
engine's reward pool) comes back as the return value and lands on its completions, which become
rows with the keys and dtypes of AReaL's ``InteractionWithTokenLogpReward.to_tensor_dict``.
"""

from __future__ import annotations

import pytest

pytest.importorskip("areal", reason="needs the areal venv: make test-integrations")
pytest.importorskip("agents", reason="needs the areal venv (openai-agents): make test-integrations")

import torch  # noqa: E402
from areal.api.cli_args import InferenceEngineConfig  # noqa: E402
from areal.workflow.openai.math_agent import MathAgent, MultiTurnMathAgent, math_reward_fn  # noqa: E402
from areal_doubles import AREAL_WARNINGS, prompts  # noqa: E402

from engine import EngineConfig, HFBackend  # noqa: E402
from engine.integrations.areal import AReaLEngineOptions, AReaLInferenceEngine  # noqa: E402
from engine.integrations._areal_episodes import EngineReward  # noqa: E402
from engine.testing import build_tiny_model, build_tiny_tokenizer  # noqa: E402

torch.set_num_threads(1)

pytestmark = AREAL_WARNINGS

AREAL_ROW_DTYPES = {"input_ids": torch.int64, "loss_mask": torch.int64, "logprobs": torch.float32,
                    "versions": torch.int64, "attention_mask": torch.bool, "rewards": torch.float32}


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer()


@pytest.fixture(scope="module")
def adapter(tmp_path_factory, tok):
    path = build_tiny_model(tmp_path_factory.mktemp("areal-agents") / "tiny")
    config = InferenceEngineConfig(experiment_name="agents", trial_name="t0", consumer_batch_size=2,
                                   max_concurrent_rollouts=4, max_head_offpolicyness=int(1e10))
    # one reward worker: the engine's check loads math_reward_fn's module (it imports AReaL and
    # openai-agents) in it once, with the check's 60 s budget, before any episode needs it
    options = AReaLEngineOptions(tokenizer=tok, engine_config=EngineConfig(staleness_policy="flag",
                                                                           reward_max_workers=1))
    engine = AReaLInferenceEngine(config, backend=HFBackend(path, tok), options=options)
    engine.initialize()
    yield engine
    engine.destroy()


def _completion_text(tok, row_ids, row_mask):
    return tok.decode(row_ids[row_mask.bool()].tolist(), skip_special_tokens=True)


def test_math_agent_runs_unchanged_and_its_reward_is_math_verify(adapter, tok):
    agent = MathAgent(max_completion_tokens=8, temperature=1.0)
    items = prompts(3, tag="math")
    groups = adapter.rollout_batch(items, workflow=agent, group_size=2)
    assert isinstance(agent._reward_fn, EngineReward)  # AReaL's wrapper swapped: the engine's pool scored it
    assert len(groups) == 3
    for item, g in zip(items, groups):
        assert {k: v.dtype for k, v in g.items()} == AREAL_ROW_DTYPES
        assert g["input_ids"].shape[0] == 2  # one completion per sample, "individual" export
        for r in range(2):
            text = _completion_text(tok, g["input_ids"][r], g["loss_mask"][r])
            assert float(g["rewards"][r]) == math_reward_fn(text, item["answer"])
            assert set(g["versions"][r][g["loss_mask"][r].bool()].tolist()) == {0}
    stats = adapter.statistics()
    assert stats.reward_fallbacks == 0 and stats.failed == 0
    assert stats.rewards.calls >= 6


def test_multi_turn_math_agent_rows_are_its_completions(adapter, tok):
    agent = MultiTurnMathAgent(max_turns=2, max_completion_tokens=6, temperature=1.0)
    (g,) = adapter.rollout_batch(prompts(1, tag="mt"), workflow=agent)
    assert {k: v.dtype for k, v in g.items()} == AREAL_ROW_DTYPES
    # the tiny model never answers right: both turns ran, each completion is a row whose prompt
    # holds the previous turns (the second row's prompt extends the first row's conversation)
    assert g["input_ids"].shape[0] == 2
    first, second = (g["input_ids"][r][g["attention_mask"][r]].tolist() for r in range(2))
    first_len = int(g["attention_mask"][0].sum())
    assert second[:first_len] == first
    assert g["rewards"].tolist() == [0.0, 0.0]

"""Contract tier: the RLVR workflow on the sim backend with real reward worker
processes (spawn): rewards, fallbacks flagged per trajectory, reward errors."""

from __future__ import annotations

import torch

import reward_fixtures
from engine import EngineConfig, SimBackend, SimConfig, open_rollout_engine
from engine.datasets import builtin_arith, to_item
from engine.testing import build_tiny_tokenizer
from engine.types import GenerationHyperparameters
from workflows.rlvr import RLVRWorkflow


def _sim(tok):
    return SimBackend(SimConfig(vocab_size=len(tok), eos_token_id=tok.eos_token_id, first_token_id=0,
                                out_len_median=6, seed=2))


async def test_rewards_are_scored_in_workers_and_fallbacks_are_flagged():
    tok = build_tiny_tokenizer()
    items = [to_item(row) for row in builtin_arith(3)]
    hang = RLVRWorkflow(reward_fixtures.sleep_forever, GenerationHyperparameters(n_samples=2, max_new_tokens=8), tok)
    length = RLVRWorkflow(reward_fixtures.length_reward, GenerationHyperparameters(max_new_tokens=8), tok)
    config = EngineConfig(reward_timeout_seconds=0.5, reward_max_retries=0, reward_max_workers=2)
    async with open_rollout_engine(_sim(tok), config) as engine:
        hung = await engine.rollout_batch(items[:1], hang)
        s = engine.statistics()
    assert hung["reward_is_fallback"].tolist() == [True, True]
    assert hung["rewards"].tolist() == [0.0, 0.0]
    assert s.reward_fallbacks == 2 and s.rewards.fallbacks == 2
    async with open_rollout_engine(_sim(tok), EngineConfig(reward_max_workers=2)) as engine:
        scored = await engine.rollout_batch(items, length)
        assert engine.statistics().reward_fallbacks == 0
    assert scored["reward_is_fallback"].tolist() == [False] * 3
    expected = [float(len(tok.decode(ids[mask.bool()], skip_special_tokens=True)))
                for ids, mask in zip(scored["input_ids"], scored["loss_mask"])]
    assert scored["rewards"].tolist() == expected


async def test_a_reward_that_raises_fails_only_its_episode():
    tok = build_tiny_tokenizer()
    items = [to_item(row) for row in builtin_arith(4)]
    bad = RLVRWorkflow(reward_fixtures.raise_value_error, GenerationHyperparameters(max_new_tokens=8), tok)
    good = RLVRWorkflow(reward_fixtures.length_reward, GenerationHyperparameters(max_new_tokens=8), tok)
    config = EngineConfig(reward_max_retries=1, reward_max_workers=2)
    async with open_rollout_engine(_sim(tok), config) as engine:
        ids = [engine.submit(items[0], bad)] + [engine.submit(item, good) for item in items[1:]]
        results = {r.task_id: r for r in await engine.wait_results(4)}
    assert results[ids[0]].status == "failed" and results[ids[0]].reason == "reward_error"
    assert "ValueError" in results[ids[0]].error_message
    assert [results[i].status for i in ids[1:]] == ["accepted"] * 3
    assert all(isinstance(results[i].trajectory["rewards"], torch.Tensor) for i in ids[1:])

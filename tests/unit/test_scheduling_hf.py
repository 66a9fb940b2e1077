"""Unit tier (slow: a tiny real model): every scheduling policy runs on the ``hf`` backend,
which has no server priorities (the engine's dispatch bound orders its segments), in real
time (the backend generates in a worker thread)."""

from __future__ import annotations

import pytest
import torch
import trio

from engine import EngineConfig, HFBackend, ModelRequest, open_rollout_engine
from engine.testing import build_tiny_model
from engine.trajectory import trajectory_from_response
from engine.types import GenerationHyperparameters
from scheduling_fixtures import counts_add_up, groups_of, oldest_version
from workflows import RolloutWorkflow

from conftest import HF_TEST_DEVICE as DEVICE

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = build_tiny_model(tmp_path_factory.mktemp("tiny-llama"), seed=0)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval().to(DEVICE)
    return model, AutoTokenizer.from_pretrained(folder)


class Budgeted(RolloutWorkflow):
    """``data["n"]`` tokens (ignore_eos), from a prompt of the item's own."""

    async def arun_episode(self, engine, data):
        req = ModelRequest(input_ids=[3, 10 + data["g"], 40, 41],
                           gconfig=GenerationHyperparameters(max_new_tokens=data["n"], ignore_eos=True))
        return trajectory_from_response(await engine.agenerate(req), 1.0)


@pytest.mark.parametrize("policy", ["length_aware", "overprovision", "tail_batching"])
async def test_every_policy_runs_on_the_hf_backend(policy, tiny, reward_pool):
    model, tok = tiny
    backend = HFBackend(model, tok, device=DEVICE, dtype="float32", batch_window_s=0.005)
    config = EngineConfig(scheduling=policy, consumer_batch_size=2, max_head_offpolicyness=1, overprovision_ratio=1.0,
                          overprovision_chunk_tokens=8, length_aware_probe_tokens=4, scheduling_max_segments=3)
    data = [{"g": g, "n": n} for g, n in enumerate([6, 7, 40, 44, 5, 6, 38, 42])]
    async with open_rollout_engine(backend, config, reward_pool=reward_pool) as engine:
        with trio.fail_after(240):
            for _ in range(3):
                batch = await engine.prepare_batch(data, Budgeted(), group_size=2)
                assert list(groups_of(batch).values()) == [2, 2]
                assert engine.version - oldest_version(batch) <= 1
                engine.set_version(engine.version + 1)
        stats = engine.statistics()
    counts_add_up(stats)
    assert stats.accepted >= 6 and stats.scheduling["policy"] == policy
    assert stats.scheduling["peak_segments_waiting"] > 0  # the engine ordered segments itself

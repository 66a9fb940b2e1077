"""Every episode finds the engine's reward pool as its current pool, whoever admitted it.

``rewards.AsyncRewardWrapper`` inside a workflow uses the current pool (documented: "inside an
engine: a bare ``await wrapper(...)`` uses the engine's workers").  An episode task inherits the
context of the task that admitted it; ``RolloutEngineThread.prepare_batch`` refills from a task
started by ``trio.from_thread``, whose context has no pool: every such episode failed with
"AsyncRewardWrapper has no reward pool" (found under the AReaL adapter, issue 26)."""

from __future__ import annotations

import torch

from engine import EngineConfig, RolloutEngineThread, SimBackend, SimConfig
from engine.trajectory import trajectory_from_response
from engine.types import ModelRequest
from rewards import AsyncRewardWrapper
from workflows import RolloutWorkflow

torch.set_num_threads(1)


async def one(prompt, completions, prompt_ids, completion_ids, **data):  # async: scored in-process
    return 1.0


class Wrapped(RolloutWorkflow):
    def __init__(self):
        self.reward = AsyncRewardWrapper(one)

    async def arun_episode(self, engine, data):
        resp = await engine.agenerate(ModelRequest(input_ids=[5, 6]))
        return trajectory_from_response(resp, await self.reward("p", "c", [5, 6], resp.output_tokens))


def test_episodes_admitted_by_the_facades_prepare_batch_find_the_pool():
    backend = SimBackend(SimConfig(vocab_size=50, out_len_median=3, per_token_s=0.0, seed=1))
    config = EngineConfig(consumer_batch_size=2, max_concurrent_rollouts=4)
    rows = [{"i": i} for i in range(8)]
    with RolloutEngineThread(backend, config) as engine:
        for _ in range(2):
            batch = engine.prepare_batch(rows, Wrapped(), timeout=60)
            assert batch["rewards"].tolist() == [1.0, 1.0]
        s = engine.statistics()
    assert s.failed == 0

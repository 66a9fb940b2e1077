"""A huge staleness bound: AReaL says "no staleness control" with ``max_head_offpolicyness``
``int(1e10)`` (its tests) or ``int(1e12)`` (its trainer's evaluation rollout).

* prepare_batch's run-ahead kept ``(eta + 1) * B`` episodes queued, so it read the dataloader
  without end (a sync loop: memory grew until the process died).  It now keeps at most the
  result buffer's capacity queued or running (more could not deposit anyway).
* The staleness check compared int32 versions with eta: past 2**31 the comparison wrapped and
  every trajectory was rejected as stale."""

from __future__ import annotations

import pytest
import torch

from engine import EngineConfig, SimBackend, SimConfig, open_rollout_engine
from engine.testing import InProcessRewardPool
from engine.trajectory import trajectory_from_response
from engine.types import ModelRequest
from workflows import RolloutWorkflow

torch.set_num_threads(1)


class OneGen(RolloutWorkflow):
    async def arun_episode(self, engine, data):
        resp = await engine.agenerate(ModelRequest(input_ids=[5, 6, 7]))
        return trajectory_from_response(resp, float(data["i"]))


@pytest.mark.parametrize("eta", [2**31, 10**12, 2**70])
async def test_a_huge_staleness_bound_rejects_nothing_as_stale(autojump_clock, eta):
    config = EngineConfig(consumer_batch_size=2, max_concurrent_rollouts=4, max_head_offpolicyness=eta)
    backend = SimBackend(SimConfig(vocab_size=50, out_len_median=5, per_token_s=0.01, seed=1))
    async with open_rollout_engine(backend, config, reward_pool=InProcessRewardPool()) as engine:
        engine.set_version(3)
        batch = await engine.rollout_batch([{"i": i} for i in range(4)], OneGen())
        engine.set_version(5)  # re-checks what is buffered (nothing: rollout_batch took it)
        s = engine.statistics()
    assert batch.batch_size[0] == 4
    assert s.rejected == 0 and s.accepted == 4


@pytest.mark.parametrize("eta", [10**10, 10**12])
async def test_a_huge_staleness_bound_does_not_read_the_dataloader_without_end(autojump_clock, eta):
    taken = []

    def rows():  # an endless dataloader that says when it is read too far
        i = 0
        while True:
            if len(taken) >= 1000:
                raise RuntimeError(f"read {len(taken)} items for a batch of 2")
            taken.append(i)
            yield {"i": i}
            i += 1

    config = EngineConfig(consumer_batch_size=2, max_concurrent_rollouts=4, max_head_offpolicyness=eta,
                          buffer_capacity=64)
    backend = SimBackend(SimConfig(vocab_size=50, out_len_median=5, per_token_s=0.01, seed=1))
    async with open_rollout_engine(backend, config, reward_pool=InProcessRewardPool()) as engine:
        gen = rows()
        for _ in range(3):
            batch = await engine.prepare_batch(gen, OneGen())
            assert batch.batch_size[0] == 2
        s = engine.statistics()
    assert len(taken) - 3 * 2 <= 64 + 2  # beyond the 3 batches taken: the buffer's capacity, and one batch
    assert s.submitted == len(taken)

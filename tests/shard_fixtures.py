"""Workflows and helpers for the engine-shard tests (importable by shard processes:
the shards get the test process's ``sys.path``)."""

from __future__ import annotations

import os

from engine import ModelRequest
from engine.data import trajectory_from_response
from engine.types import GenerationHyperparameters
from workflows import RolloutWorkflow


class Echo(RolloutWorkflow):
    """One generation on the shard's backend; reward = the item's ``"reward"``
    (default 1.0); ``"reject"`` items return None; ``"fail"`` items raise.  Each
    trajectory records the shard's pid as its ``shard_pid [1] int64``."""

    def __init__(self, max_new_tokens: int = 4):
        self.gconfig = GenerationHyperparameters(max_new_tokens=max_new_tokens)

    async def arun_episode(self, engine, data):
        import torch

        resp = await engine.agenerate(ModelRequest(input_ids=[1, 2, 3, 4 + data.get("i", 0) % 50],
                                                   gconfig=self.gconfig))
        if data.get("reject"):
            return None
        if data.get("fail"):
            raise RuntimeError("asked to fail")
        traj = trajectory_from_response(resp, float(data.get("reward", 1.0)))
        traj["shard_pid"] = torch.full((1,), os.getpid(), dtype=torch.int64)
        return traj


def sim(latency_s: float = 0.0, **overrides):
    """An unopened SimBackend with per-request latency ``latency_s`` (prefill only)."""
    from engine import SimBackend, SimConfig

    return SimBackend(SimConfig(vocab_size=64, eos_token_id=0, first_token_id=1, prefill_s=latency_s,
                                per_token_s=0.0, out_len_median=3, out_len_sigma=0.0, **overrides))

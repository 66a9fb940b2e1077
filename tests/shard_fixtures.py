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
    (default 1.0); ``"sleep"`` items wait that many seconds first; ``"reject"`` items return None; ``"fail"`` items raise.  Each
    trajectory records the shard's pid as its ``shard_pid [1] int64``."""

    def __init__(self, max_new_tokens: int = 4):
        self.gconfig = GenerationHyperparameters(max_new_tokens=max_new_tokens)

    async def arun_episode(self, engine, data):
        import torch
        import trio

        if data.get("sleep"):  # seconds of real time (an episode still running when its shard is killed)
            await trio.sleep(data["sleep"])
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


class Poison(Echo):
    """Echo, but an item with ``"poison": True`` SIGKILLs the shard process running it."""

    async def arun_episode(self, engine, data):
        if data.get("poison"):
            import signal

            os.kill(os.getpid(), signal.SIGKILL)
        return await super().arun_episode(engine, data)


def invariant(s) -> None:
    assert s.submitted == s.queued + s.running + s.accepted + s.rejected + s.failed, s


def assert_global_bound(log, C: int, B: int, eta: int | None) -> bool:
    """Every admission kept sum(running) <= C and sum(running) + accepted <= (eta + v + 1) * B
    (AReaL's capacity over the sum of the shards); True if some admission reached a bound."""
    tight = False
    for rec in log:
        running = sum(rec.running)
        assert running <= C, rec
        tight |= running == C
        if eta is not None:
            assert running + rec.accepted <= (eta + rec.version + 1) * B, rec
            tight |= running + rec.accepted == (eta + rec.version + 1) * B
    return tight


def weight_sync_sim(latency_s: float = 0.0):
    """A SimBackend that implements WeightSync (pause, resume, update_weights: a no-op load)."""
    return _SyncSim(sim(latency_s).config)


def _sync_sim_class():
    from engine import SimBackend

    class SyncSim(SimBackend):
        loaded: list = []

        async def pause(self, mode: str = "abort") -> None:
            return None

        async def resume(self) -> None:
            return None

        async def update_weights(self, source, *, version: int, mode: str = "abort") -> None:
            if source == "broken":
                raise OSError("cannot read broken")
            self.loaded.append(source)

    SyncSim.__qualname__ = SyncSim.__name__ = "_SyncSim"
    return SyncSim


_SyncSim = _sync_sim_class()


def broken_backend():
    """A backend factory that fails in the shard (a model that does not load)."""
    raise RuntimeError("the model does not load")

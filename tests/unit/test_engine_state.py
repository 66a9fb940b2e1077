"""Unit tier: ``RolloutEngine.state_dict`` / ``load_state_dict`` (sim backend,
RLVR workflow, in-process reward pool, virtual time), and the accounting of
episodes cancelled when an engine closes."""

from __future__ import annotations

import io

import pytest
import torch
import trio
import trio.testing

from engine import EngineConfig, MockBackend, ModelResponse, SimBackend, SimConfig, open_rollout_engine
from engine.datasets import builtin_arith, to_item
from engine.testing import build_tiny_tokenizer
from engine.types import GenerationHyperparameters
from rewards import gsm8k_reward
from workflows.rlvr import RLVRWorkflow


def _sim(tok):
    return SimBackend(SimConfig(vocab_size=len(tok), eos_token_id=tok.eos_token_id, first_token_id=0,
                                out_len_median=8, out_len_sigma=0.8, per_token_s=0.01, seed=3))


def _setup(n_samples=1):
    tok = build_tiny_tokenizer()
    wf = RLVRWorkflow(gsm8k_reward, GenerationHyperparameters(n_samples=n_samples, max_new_tokens=16), tok)
    return tok, wf, [to_item(row) for row in builtin_arith(12)]


def _roundtrip(state):
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)  # plain containers and tensors only


async def test_state_dict_round_trip_resubmits_in_flight_and_keeps_unconsumed(reward_pool, autojump_clock):
    tok, wf, items = _setup()
    config = EngineConfig(max_concurrent_rollouts=3, consumer_batch_size=2)
    async with open_rollout_engine(_sim(tok), config, reward_pool=reward_pool) as engine:
        ids = [engine.submit(item, wf) for item in items]
        consumed = await engine.wait_results(2)  # the trainer took one batch ...
        engine.set_version(1)  # ... and published new weights
        await engine._buffer.wait_until(lambda: len(engine._buffer) >= 2)  # some finished, not consumed
        before = engine.statistics()
        state = _roundtrip(engine.state_dict())
        buffered = {r.task_id: r for r in engine._buffer.results()}
    assert before.results_waiting >= 2 and before.running > 0 and before.queued > 0
    pending = [p["task_id"] for p in state["pending"]]
    saved = [r["task_id"] for r in state["results"]]
    assert len(pending) == before.queued + before.running and len(saved) == before.results_waiting
    assert sorted([r.task_id for r in consumed] + saved + pending) == ids  # each episode in exactly one place
    assert state["version"] == 1 and state["data_position"] is None

    async with open_rollout_engine(_sim(tok), config, reward_pool=reward_pool) as engine:
        assert engine.load_state_dict(state, wf) == pending
        s = engine.statistics()
        assert (s.version, s.accepted, s.rejected, s.failed) == (1, before.accepted, before.rejected, before.failed)
        assert s.submitted == s.queued + s.running + s.accepted + s.rejected + s.failed
        assert s.queued + s.running == len(pending) and s.results_waiting == len(saved)
        assert s.generated_tokens == before.generated_tokens
        # AReaL's restore (version * B) plus the accepted results put back
        assert engine._admission.staleness.accepted == 1 * 2 + sum(r["status"] == "accepted" for r in state["results"])
        rest = await engine.wait_results(len(saved) + len(pending))
        end = engine.statistics()
    assert [r.task_id for r in rest[:len(saved)]] == saved  # unconsumed results come first, in order
    for r in rest[:len(saved)]:
        assert r.status == buffered[r.task_id].status and r.data == items[r.task_id]
        assert torch.equal(r.trajectory["input_ids"], buffered[r.task_id].trajectory["input_ids"])
    assert sorted(r.task_id for r in rest[len(saved):]) == pending
    assert all(r.status == "accepted" for r in rest)
    assert end.submitted == end.accepted + end.rejected + end.failed == len(items)


async def test_load_state_dict_refuses_what_it_cannot_restore(reward_pool, autojump_clock):
    tok, wf, items = _setup()
    async with open_rollout_engine(_sim(tok), EngineConfig(max_concurrent_rollouts=1), reward_pool=reward_pool) as a:
        a.submit(items[0], wf)
        a.submit(items[1], wf)
        state = a.state_dict()
        with pytest.raises(ValueError, match="fresh engine; this one has submitted 2"):
            a.load_state_dict(state, wf)
    async with open_rollout_engine(_sim(tok), reward_pool=reward_pool) as b:
        with pytest.raises(ValueError, match="holds 2 queued or running episodes; pass the workflow"):
            b.load_state_dict(state)
        with pytest.raises(ValueError, match="unknown state format 7"):
            b.load_state_dict({**state, "format": 7}, wf)
        with pytest.raises(ValueError, match="data_position must be a DataStream state"):
            b.load_state_dict({**state, "data_position": {"epoch": 1}}, wf)
        assert b.statistics().submitted == 0  # nothing half-loaded


async def test_cancelled_episodes_with_child_nurseries_are_counted_once(reward_pool, autojump_clock):
    """Regression: an episode whose workflow runs a child nursery (RLVR with
    n_samples > 1) was cancelled inside an exception group, so it was never
    recorded and ``running`` never came back to 0."""
    tok, wf, items = _setup(n_samples=2)
    with trio.CancelScope() as stop:
        async with open_rollout_engine(_sim(tok), EngineConfig(max_concurrent_rollouts=4),
                                       reward_pool=reward_pool) as engine:
            for item in items:
                engine.submit(item, wf)
            await engine.wait_results(3)
            stop.cancel()
            await trio.sleep_forever()
    s = engine.statistics()
    assert s.running == 0 and s.queued == 0
    assert s.submitted == s.accepted + s.rejected + s.failed == len(items)
    left = await engine.wait_results(s.results_waiting)
    assert len(left) == len(items) - 3
    cancelled = [r for r in left if r.reason == "cancelled"]
    assert s.failed_by_reason == {"cancelled": len(cancelled)} and len(cancelled) >= 4


async def test_an_episode_admitted_as_the_engine_closes_ends_cancelled(reward_pool, autojump_clock):
    """Regression: an episode admitted in the tick the engine closed called
    ``agenerate`` before its first checkpoint and failed with
    ``ClosedResourceError`` (so its item counted as done) instead of ending
    ``cancelled``.  Task order in a tick is random, so the race runs 12 times."""

    class CancelAfterOne:
        def __init__(self, scope):
            self.scope = scope

        async def arun_episode(self, engine, data):
            from engine.trajectory import trajectory_from_response
            from engine.types import ModelRequest

            resp = await engine.agenerate(ModelRequest(input_ids=[1, 2, 3], gconfig=GenerationHyperparameters(
                max_new_tokens=2)))
            if data == 0:
                self.scope.cancel()  # the engine closes; this episode ends and admits the next one
            return trajectory_from_response(resp, 1.0)

    async def handler(req, budget):
        await trio.sleep(1)
        return ModelResponse(input_tokens=list(req.input_ids), output_tokens=[5] * budget,
                             output_logprobs=[-0.5] * budget, output_versions=[0] * budget, stop_reason="length")

    for _ in range(12):
        with trio.CancelScope() as stop:
            async with open_rollout_engine(MockBackend(handler), EngineConfig(max_concurrent_rollouts=1),
                                           reward_pool=reward_pool) as engine:
                for i in range(3):
                    engine.submit(i, CancelAfterOne(stop))
                await trio.sleep_forever()
        s = engine.statistics()
        assert (s.accepted, s.failed_by_reason) == (1, {"cancelled": 2}), s.failed_by_reason


async def test_loaded_reasons_are_the_engine_s_vocabulary_again(reward_pool, autojump_clock):
    """Regression (new-user trial): after load_state_dict the reason keys were plain
    str where the engine records RejectReason / FailReason members (a custom reason
    stays as it was)."""
    from engine import EpisodeStatus, FailReason, RejectReason

    tok, wf, _ = _setup()
    async with open_rollout_engine(_sim(tok), EngineConfig(), reward_pool=reward_pool) as engine:
        state = engine.state_dict()
    state["accounting"].update(rejected=3, failed=1, rejected_by_reason={"filtered": 2, "my_reason": 1},
                               failed_by_reason={"reward_error": 1})
    state["results"] = [{"task_id": 7, "status": "rejected", "trajectory": None, "reason": "stale",
                         "error_type": None, "error_message": None, "member_errors": [], "data": {"x": 1},
                         "elapsed_s": 0.5}]
    state = _roundtrip(state)
    async with open_rollout_engine(_sim(tok), EngineConfig(), reward_pool=reward_pool) as engine:
        engine.load_state_dict(state, wf)
        s = engine.statistics()
        [result] = await engine.wait_results(1)
    assert {type(k) for k in s.rejected_by_reason} == {RejectReason, str}
    assert s.rejected_by_reason == {RejectReason.FILTERED: 2, "my_reason": 1}
    assert type(next(iter(s.failed_by_reason))) is FailReason
    assert type(result.status) is EpisodeStatus and type(result.reason) is RejectReason and result.reason == "stale"

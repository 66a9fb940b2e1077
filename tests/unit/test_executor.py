"""Unit tier: the engine's one dispatch path (backend.generate), and accounting
(mock and sim backends, in-process reward pool, virtual time)."""

from __future__ import annotations

import math

import pytest
import torch
import trio
import trio.testing
from tensordict import TensorDict

from engine import (
    BackendError,
    EngineConfig,
    InvalidRequestError,
    MockBackend,
    ModelRequest,
    ModelResponse,
    SimBackend,
    SimConfig,
    WorkflowError,
    open_rollout_engine,
)
from engine.trajectory import trajectory_from_response
from engine.types import GenerationHyperparameters
from workflows import RolloutWorkflow, resolve_workflow


def _ok(req, budget, n=3, version=0):
    n = min(n, budget)
    return ModelResponse(input_tokens=list(req.input_ids), output_tokens=[7] * n,
                         output_logprobs=[-0.1] * n, output_versions=[version] * n, stop_reason="stop")


async def echo(req, budget):
    return _ok(req, budget)


def _req(n_prompt=4, **g):
    return ModelRequest(input_ids=list(range(1, n_prompt + 1)), gconfig=GenerationHyperparameters(**g))


async def test_agenerate_round_trip_through_the_backend(reward_pool):
    seen = []

    async def handler(req, budget):
        seen.append((req.rid, budget))
        return _ok(req, budget)

    async with open_rollout_engine(MockBackend(handler), reward_pool=reward_pool) as engine:
        req = _req(max_new_tokens=5)
        resp = await engine.agenerate(req)
    assert seen == [(req.rid, 5)]
    assert resp.input_tokens == [1, 2, 3, 4] and resp.output_tokens == [7, 7, 7]
    assert resp.stop_reason == "stop" and resp.output_versions == [0, 0, 0]


async def test_invalid_request_raises_before_anything_is_sent(reward_pool):
    calls = []

    async def handler(req, budget):
        calls.append(req)
        return _ok(req, budget)

    async with open_rollout_engine(MockBackend(handler), reward_pool=reward_pool) as engine:
        with pytest.raises(InvalidRequestError, match="budget"):
            await engine.agenerate(_req(n_prompt=10, max_tokens=10))
        with pytest.raises(InvalidRequestError, match="n_samples"):
            await engine.agenerate(_req(n_samples=2))
    assert calls == []


async def test_cancelling_the_caller_cancels_the_running_generation(reward_pool, autojump_clock):
    events = []

    async def hang(req, budget):
        try:
            await trio.sleep_forever()
        finally:
            events.append("backend cancelled")

    async with open_rollout_engine(MockBackend(hang), reward_pool=reward_pool) as engine:
        with trio.move_on_after(1) as scope:
            await engine.agenerate(_req())
        await trio.testing.wait_all_tasks_blocked()
        assert scope.cancelled_caught
        assert events == ["backend cancelled"]


async def test_a_withdrawn_queued_request_is_never_served(reward_pool, autojump_clock):
    served = []
    release = trio.Event()

    async def slow(req, budget):
        served.append(req.rid)
        await release.wait()
        return _ok(req, budget)

    async with open_rollout_engine(MockBackend(slow, max_concurrency=1), reward_pool=reward_pool) as engine:
        first, second = _req(), _req()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(engine.agenerate, first)
            await trio.testing.wait_all_tasks_blocked()
            with trio.move_on_after(1):
                await engine.agenerate(second)  # queued behind `first`, then withdrawn
            release.set()
    assert served == [first.rid]


@pytest.mark.parametrize(
    ("mutate", "match"),
    [
        (lambda r: setattr(r, "output_logprobs", [-0.1]), "3 output_tokens but 1 output_logprobs"),
        (lambda r: r.output_logprobs.__setitem__(0, float("nan")), "not a valid log-probability"),
        (lambda r: r.output_logprobs.__setitem__(1, -9999.0), "not a valid log-probability"),
        (lambda r: r.output_logprobs.__setitem__(2, True), "bool"),
        (lambda r: setattr(r, "output_versions", []), "output_versions"),
    ],
)
async def test_bad_evidence_is_a_backend_error_naming_the_request(reward_pool, mutate, match):
    async def bad(req, budget):
        resp = _ok(req, budget)
        mutate(resp)
        return resp

    async with open_rollout_engine(MockBackend(bad), reward_pool=reward_pool) as engine:
        req = _req()
        with pytest.raises(BackendError, match=match) as info:
            await engine.agenerate(req)
    assert req.rid in str(info.value)


async def test_aborted_generation_is_resumed_with_prompt_plus_partial_output(reward_pool):
    backend = None
    calls = []

    async def handler(req, budget):
        calls.append((list(req.input_ids), budget))
        if len(calls) == 1:  # interrupted after 2 tokens; a weight update lands
            engine.set_version(1)  # a weight update lands (the engine tells the backend)
            return ModelResponse(input_tokens=list(req.input_ids), output_tokens=[5, 6], output_logprobs=[-1.0, -1.0],
                                 output_versions=[0, 0], stop_reason="abort")
        return _ok(req, budget, n=2, version=backend.version)

    backend = MockBackend(handler)
    async with open_rollout_engine(backend, reward_pool=reward_pool) as engine:
        resp = await engine.agenerate(_req(n_prompt=2, max_new_tokens=10))
    assert calls == [([1, 2], 10), ([1, 2, 5, 6], 8)]
    assert resp.input_tokens == [1, 2]
    assert resp.output_tokens == [5, 6, 7, 7]
    assert resp.output_versions == [0, 0, 1, 1]
    assert resp.stop_reason == "stop"


async def test_abort_exactly_at_the_budget_is_reported_as_length(reward_pool):
    async def handler(req, budget):
        return ModelResponse(input_tokens=list(req.input_ids), output_tokens=[5] * budget,
                             output_logprobs=[-1.0] * budget, output_versions=[0] * budget, stop_reason="abort")

    async with open_rollout_engine(MockBackend(handler), reward_pool=reward_pool) as engine:
        resp = await engine.agenerate(_req(max_new_tokens=4))
    assert resp.stop_reason == "length" and resp.output_len == 4


class OneShot(RolloutWorkflow):
    """Generate once; behave according to data['mode']."""

    async def arun_episode(self, engine, data):
        mode = data["mode"]
        if mode == "raise":
            raise RuntimeError("boom")
        if mode == "none":
            return None
        if mode == "wrong_type":
            return {"not": "a tensordict"}
        resp = await engine.agenerate(_req())
        return trajectory_from_response(resp, 1.0)


def _check_invariant(s):
    assert s.submitted == s.queued + s.running + s.accepted + s.rejected + s.failed


async def test_accounting_every_episode_ends_once_with_a_reason(reward_pool):
    modes = ["ok", "raise", "none", "ok", "wrong_type", "ok"]
    async with open_rollout_engine(MockBackend(echo), reward_pool=reward_pool) as engine:
        ids = [engine.submit({"mode": m}, OneShot()) for m in modes]
        _check_invariant(engine.statistics())
        results = await engine.wait_results(len(modes))
        s = engine.statistics()
    assert sorted(r.task_id for r in results) == ids
    by_id = {r.task_id: r for r in results}
    assert [by_id[i].status for i in ids] == ["accepted", "failed", "rejected", "accepted", "failed", "accepted"]
    assert by_id[ids[1]].reason == "workflow_error" and by_id[ids[1]].error_type == "RuntimeError"
    assert by_id[ids[1]].error_message == "boom"
    assert by_id[ids[2]].reason == "workflow_returned_none"
    assert "TensorDict" in by_id[ids[4]].error_message
    assert (s.submitted, s.accepted, s.rejected, s.failed, s.running, s.queued) == (6, 3, 1, 2, 0, 0)
    assert s.failed_by_reason == {"workflow_error": 2}
    assert s.rejected_by_reason == {"workflow_returned_none": 1}
    _check_invariant(s)


async def test_wait_returns_trajectories_and_none_oldest_first(reward_pool):
    async with open_rollout_engine(MockBackend(echo), reward_pool=reward_pool) as engine:
        engine.submit({"mode": "none"}, OneShot())
        await trio.testing.wait_all_tasks_blocked()
        engine.submit({"mode": "ok"}, OneShot())
        out = await engine.wait(2)
    assert out[0] is None and isinstance(out[1], TensorDict)


async def test_wait_timeout_loses_nothing(reward_pool, autojump_clock):
    async def slow(req, budget):
        await trio.sleep(10)
        return _ok(req, budget)

    async with open_rollout_engine(MockBackend(slow), reward_pool=reward_pool) as engine:
        engine.submit({"mode": "ok"}, OneShot())
        engine.submit({"mode": "none"}, OneShot())
        with pytest.raises(TimeoutError):
            await engine.wait(2, timeout=1)
        out = await engine.wait(2, timeout=60)
        assert sum(o is None for o in out) == 1
        with pytest.raises(ValueError, match="unknown or already consumed"):
            await engine.wait_for_task(0)


async def test_closing_the_engine_cancels_running_episodes_and_accounts_for_them(reward_pool, autojump_clock):
    cancelled = []

    async def hang(req, budget):
        try:
            await trio.sleep_forever()
        finally:
            cancelled.append(req.rid)

    async with open_rollout_engine(MockBackend(hang), EngineConfig(max_concurrent_rollouts=2),
                                   reward_pool=reward_pool) as engine:
        for _ in range(5):
            engine.submit({"mode": "ok"}, OneShot())
        await trio.testing.wait_all_tasks_blocked()
        s = engine.statistics()
        assert (s.running, s.queued) == (2, 3)
    s = engine.statistics()
    assert (s.failed, s.running, s.queued) == (5, 0, 0)
    assert s.failed_by_reason == {"cancelled": 5}
    assert len(cancelled) == 2
    with pytest.raises(trio.ClosedResourceError):
        engine.submit({"mode": "ok"}, OneShot())


async def test_concurrency_limit_is_respected(reward_pool, autojump_clock):
    running = peak = 0

    async def handler(req, budget):
        nonlocal running, peak
        running += 1
        peak = max(peak, running)
        await trio.sleep(1)
        running -= 1
        return _ok(req, budget)

    async with open_rollout_engine(MockBackend(handler), EngineConfig(max_concurrent_rollouts=3),
                                   reward_pool=reward_pool) as engine:
        batch = await engine.rollout_batch([{"mode": "ok"}] * 10, OneShot)
    assert peak == 3
    assert batch.batch_size == torch.Size([10])


class WithKwargs(RolloutWorkflow):
    def __init__(self, tag):
        self.tag = tag

    async def arun_episode(self, engine, data):
        return None


class RunOnly:
    async def run(self, engine, data):
        return None


def test_workflow_specs_resolve():
    assert isinstance(resolve_workflow(WithKwargs, {"tag": 1}), WithKwargs)
    assert resolve_workflow("test_executor.WithKwargs", {"tag": 2}).tag == 2
    inst = OneShot()
    assert resolve_workflow(inst) is inst
    assert isinstance(resolve_workflow(RunOnly()), RolloutWorkflow)
    with pytest.raises(WorkflowError, match="cannot import"):
        resolve_workflow("no_such_module.Flow")
    with pytest.raises(WorkflowError, match="has no attribute"):
        resolve_workflow("workflows.base.Nope")
    with pytest.raises(WorkflowError, match="workflow_kwargs"):
        resolve_workflow(WithKwargs, {"wrong": 1})
    with pytest.raises(WorkflowError, match="coroutine method"):
        resolve_workflow(object())


def test_engine_config_rejects_bad_values():
    with pytest.raises(ValueError, match="max_concurrent_rollouts"):
        EngineConfig(max_concurrent_rollouts=0)
    with pytest.raises(ValueError, match="reward_timeout_seconds"):
        EngineConfig(reward_timeout_seconds=math.nan)


async def test_sim_backend_latency_lengths_and_determinism(reward_pool, autojump_clock):
    cfg = SimConfig(vocab_size=100, eos_token_id=2, prefill_s=0.5, per_token_s=0.01, out_len_median=20, seed=3)
    async with open_rollout_engine(SimBackend(cfg), reward_pool=reward_pool) as engine:
        t0 = trio.current_time()
        resp = await engine.agenerate(_req(max_new_tokens=50, seed=11))
        elapsed = trio.current_time() - t0
        again = await engine.agenerate(_req(max_new_tokens=50, seed=11))
        short = await engine.agenerate(_req(max_new_tokens=5))
    assert elapsed == pytest.approx(0.5 + 20 * 0.01)
    assert resp.output_len == 20 and resp.output_tokens[-1] == 2 and resp.stop_reason == "stop"
    assert again.output_tokens == resp.output_tokens and again.output_logprobs == resp.output_logprobs
    assert all(3 <= t < 100 for t in resp.output_tokens[:-1])
    assert all(-5 <= lp < 0 for lp in resp.output_logprobs)
    assert short.output_len == 5 and short.stop_reason == "length"


class Counting(RolloutWorkflow):
    built = 0

    def __init__(self, tag):
        Counting.built += 1
        self.tag = tag

    async def arun_episode(self, engine, data):
        return None


async def test_a_workflow_class_with_the_same_kwargs_is_built_once(reward_pool):
    Counting.built = 0
    kwargs = {"tag": "x"}
    async with open_rollout_engine(MockBackend(echo), reward_pool=reward_pool) as engine:
        for _ in range(5):
            engine.submit({}, Counting, kwargs)
        engine.submit({}, "test_executor.Counting", kwargs)
        engine.submit({}, Counting, {"tag": "y"})
        results = await engine.wait_results(7)
    assert Counting.built == 3
    assert all(r.status == "rejected" for r in results)


async def test_segments_of_an_episode_share_a_routing_key_and_resume_lowers_min_new_tokens(reward_pool):
    seen = []

    async def handler(req, budget):
        seen.append((req.metadata.get("routing_key"), req.gconfig.min_new_tokens))
        if len(seen) == 1:
            return ModelResponse(input_tokens=list(req.input_ids), output_tokens=[5, 6, 7], output_logprobs=[-1.0] * 3,
                                 output_versions=[0] * 3, stop_reason="abort")
        return _ok(req, budget)

    class Flow(RolloutWorkflow):
        async def arun_episode(self, engine, data):
            resp = await engine.agenerate(_req(min_new_tokens=5))
            return trajectory_from_response(resp, 0.0)

    async with open_rollout_engine(MockBackend(handler), reward_pool=reward_pool) as engine:
        tid = engine.submit({}, Flow())
        assert (await engine.wait_for_task(tid)).status == "accepted"
    assert seen == [(f"episode-{tid}", 5), (f"episode-{tid}", 2)]

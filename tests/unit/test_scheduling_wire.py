"""Unit tier: ``ModelRequest.priority`` on the wire (scripted vLLM and SGLang fakes behind
``httpx.MockTransport``, virtual time): vLLM's sense as is, SGLang's negated, never a zero,
and none to a vLLM server that says it does not schedule by priority (older vLLM refused a
non-zero one there; 0.32 ignores it: ``tests/contract/test_remote_vllm_priority.py``)."""

from __future__ import annotations

import pytest

from engine import EngineConfig, ModelRequest, open_rollout_engine
from engine._schedule_base import PROBE_PRIORITY
from engine.backends.remote import make_remote_backend
from engine.types import GenerationHyperparameters as G
from fake_servers import FakeSGLang, FakeVLLM, mock_transport
from workflows import RolloutWorkflow

A = "http://a:1"
PROMPT = [3, 10, 20, 30]


def make(fake, kind, **opts):
    return make_remote_backend(kind, [A], transport=mock_transport({A: fake}), seed=0, **opts)


def test_vllm_sends_a_priority_as_is_and_never_a_zero():
    wire = make(FakeVLLM(), "vllm", model="tiny").wire
    assert wire.build_payload(ModelRequest(input_ids=PROMPT, priority=-7), 5, "r@1")["priority"] == -7
    assert "priority" not in wire.build_payload(ModelRequest(input_ids=PROMPT), 5, "r@2")


def test_sglang_sends_a_priority_in_its_own_sense():
    # SGLang's --enable-priority-scheduling serves higher values first, unless the server runs
    # --schedule-low-priority-values-first; 0 is never sent (--abort-on-priority-when-disabled)
    urgent = ModelRequest(input_ids=PROMPT, priority=-7)
    assert make(FakeSGLang(), "sglang").wire.build_payload(urgent, 5, "r@1")["priority"] == 7
    low_first = make(FakeSGLang(), "sglang", low_priority_values_first=True).wire
    assert low_first.build_payload(urgent, 5, "r@1")["priority"] == -7
    assert "priority" not in low_first.build_payload(ModelRequest(input_ids=PROMPT), 5, "r@2")


class Pair(RolloutWorkflow):
    async def arun_episode(self, engine, data):
        from engine.trajectory import trajectory_from_response

        return trajectory_from_response(await engine.agenerate(
            ModelRequest(input_ids=PROMPT, gconfig=G(max_new_tokens=64))), 1.0)


@pytest.mark.parametrize(("policy", "sends"), [("priority", True), ("fcfs", False)])
async def test_length_aware_priorities_reach_a_vllm_server_that_schedules_by_them(policy, sends, reward_pool,
                                                                               autojump_clock, caplog):
    caplog.set_level("WARNING", logger="rollout")
    fake = FakeVLLM(length=40, scheduling_policy=policy)
    backend = make(fake, "vllm")
    config = EngineConfig(scheduling="length_aware", length_aware_probe_tokens=16)
    async with open_rollout_engine(backend, config, reward_pool=reward_pool) as engine:
        batch = await engine.rollout_batch([{}], Pair(), group_size=3)
        stats = engine.statistics()
    assert batch.batch_size[0] == 3 and stats.accepted == 1 and backend.priority_scheduling is sends
    sent = [call.get("priority") for call in fake.generate_calls]
    if sends:  # the probe; its continuation at the group's estimate (its whole budget); the siblings at
        # that estimate, or at the probe's own length (16 + 40) once its continuation has come back
        assert sent[0] == PROBE_PRIORITY
        continuation = [c for c in fake.generate_calls if len(c["prompt"]) > len(PROMPT)]
        assert len(continuation) == 1 and continuation[0]["priority"] == -64 and continuation[0]["max_tokens"] == 48
        assert len(sent) == 4 and set(sent[1:]) <= {-64, -56}
    else:  # none to a server that schedules fcfs: the policy still probes first
        assert sent == [None] * 4 and fake.generate_calls[0]["max_tokens"] == 16
    # nothing orders the segments there (no dispatch bound): one warning says so and how to fix it
    unordered = [r for r in caplog.records if "nothing orders the segments" in r.getMessage()]
    assert len(unordered) == (0 if sends else 1)
    if not sends:
        assert "--scheduling-policy priority" in unordered[0].getMessage() and unordered[0].levelname == "WARNING"


async def test_a_dispatch_bound_orders_what_an_fcfs_server_would_not(reward_pool, autojump_clock, caplog):
    caplog.set_level("WARNING", logger="rollout")
    backend = make(FakeVLLM(length=40, scheduling_policy="fcfs"), "vllm")
    config = EngineConfig(scheduling="length_aware", length_aware_probe_tokens=16, scheduling_max_segments=2)
    async with open_rollout_engine(backend, config, reward_pool=reward_pool) as engine:
        await engine.rollout_batch([{}], Pair(), group_size=3)
    assert not [r for r in caplog.records if "nothing orders the segments" in r.getMessage()]


async def test_without_the_startup_read_priorities_are_sent(reward_pool, autojump_clock):
    fake = FakeVLLM(scheduling_policy="fcfs")
    backend = make(fake, "vllm", check_logprobs_mode=False, check_seeded_sampling=False)
    async with open_rollout_engine(backend, reward_pool=reward_pool) as engine:
        await engine.agenerate(ModelRequest(input_ids=PROMPT, priority=-2, gconfig=G(max_new_tokens=4)))
    assert backend.priority_scheduling is None and fake.generate_calls[0]["priority"] == -2

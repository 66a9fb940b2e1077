"""Unit tier (property): random interleavings of submit / complete (accept,
reject, fail) / wait / pause / resume / set_version keep the accounting
invariant after every step, and every episode ends exactly once."""

from __future__ import annotations

import trio
import trio.testing
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.testing import InProcessRewardPool
from engine import EngineConfig, MockBackend, ModelResponse, open_rollout_engine
from engine.trajectory import trajectory_from_response
from workflows import RolloutWorkflow

OPS = st.sampled_from(["submit", "submit", "accept", "reject", "fail", "wait", "pause", "resume", "bump"])


class Controlled(RolloutWorkflow):
    """Each running episode parks until the test decides how it ends."""

    def __init__(self):
        self.running: list[dict] = []

    async def arun_episode(self, engine, data):
        self.running.append(data)
        version = engine.version
        try:
            await data["go"].wait()
        finally:
            self.running.remove(data)
        if data["mode"] == "reject":
            return None
        if data["mode"] == "fail":
            raise RuntimeError("boom")
        resp = ModelResponse(input_tokens=[1], output_tokens=[2], output_logprobs=[-1.0], output_versions=[version])
        return trajectory_from_response(resp, 1.0)


def _check(engine, seen_ids, consumed):
    s = engine.statistics()
    assert s.submitted == s.queued + s.running + s.accepted + s.rejected + s.failed
    assert s.rejected == sum(s.rejected_by_reason.values())
    assert s.failed == sum(s.failed_by_reason.values())
    assert s.running <= engine.config.max_concurrent_rollouts
    assert len(consumed) == len(set(consumed)) and set(consumed) <= seen_ids


async def _scenario(ops, C, B, eta):
    async def never(req, budget):
        raise AssertionError

    wf = Controlled()
    seen, consumed = set(), []
    config = EngineConfig(max_concurrent_rollouts=C, consumer_batch_size=B, max_head_offpolicyness=eta,
                          buffer_capacity=3)
    async with open_rollout_engine(MockBackend(never), config, reward_pool=InProcessRewardPool()) as engine:
        for op in ops:
            if op == "submit":
                seen.add(engine.submit({"go": trio.Event(), "mode": "accept"}, wf))
            elif op in ("accept", "reject", "fail"):
                waiting = [d for d in wf.running if not d["go"].is_set()]
                if waiting:
                    waiting[0]["mode"] = op
                    waiting[0]["go"].set()
            elif op == "wait":
                if engine.statistics().results_waiting:
                    consumed += [r.task_id for r in await engine.wait_results(1)]
            elif op == "pause":
                engine.pause()
            elif op == "resume":
                engine.resume()
            elif op == "bump":
                engine.set_version(engine.version + 1)
            await trio.testing.wait_all_tasks_blocked()
            _check(engine, seen, consumed)
    s = engine.statistics()
    _check(engine, seen, consumed)
    assert s.running == s.queued == 0
    consumed += [r.task_id for r in await engine.wait_results(s.results_waiting)]
    assert sorted(consumed) == sorted(seen)  # every episode ended exactly once


@settings(max_examples=60, deadline=None)
@given(ops=st.lists(OPS, max_size=40), C=st.integers(1, 4), B=st.integers(1, 3),
       eta=st.one_of(st.none(), st.integers(0, 2)))
def test_accounting_invariant_under_random_interleavings(ops, C, B, eta):
    trio.run(_scenario, ops, C, B, eta, clock=trio.testing.MockClock(autojump_threshold=0))

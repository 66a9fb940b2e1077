"""Unit tier: ``scheduling="length_aware"`` (Seer's context-aware scheduling) and the
settings of every policy (the sim backend with scripted lengths, virtual time).

A group's probe (its first member to send) goes first with at most
``length_aware_probe_tokens``; its siblings wait for it; then longer groups go first,
by server ``priority`` and, with ``scheduling_max_segments``, by the engine's own
dispatch order."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from engine import EngineConfig, ModelRequest, open_rollout_engine
from engine._schedule_base import PROBE_PRIORITY, SlotGate
from engine.types import GenerationHyperparameters
from scheduling_fixtures import Scripted, ScriptedSim, counts_add_up, groups_of, item, prompt, versions_of_rows


@pytest.mark.parametrize(("field", "value", "match"), [
    ("scheduling", "sjf", "scheduling must be one of"),
    ("overprovision_ratio", 0, "overprovision_ratio must be"),
    ("overprovision_ratio", float("nan"), "overprovision_ratio must be"),
    ("overprovision_ratio", True, "overprovision_ratio must be"),
    ("overprovision_chunk_tokens", 0, "overprovision_chunk_tokens must be"),
    ("length_aware_probe_tokens", None, "length_aware_probe_tokens must be"),
    ("scheduling_max_segments", 0, "scheduling_max_segments must be"),
])
def test_a_bad_scheduling_setting_names_its_field(field, value, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(**{"scheduling": "length_aware", field: value})


def test_settings_that_cannot_work_together_are_refused_with_the_fix():
    with pytest.raises(ValueError, match=r"max_head_offpolicyness must be >= 1 \(or None\) with scheduling='overprovision'"):
        EngineConfig(scheduling="overprovision", max_head_offpolicyness=0)
    EngineConfig(scheduling="overprovision", max_head_offpolicyness=None)
    EngineConfig(scheduling="tail_batching", max_head_offpolicyness=0)  # regenerates on-policy: fine


def test_a_request_priority_must_be_an_int():
    from engine import InvalidRequestError

    for bad in (True, 1.5, "1"):
        with pytest.raises(InvalidRequestError, match="priority must be an int"):
            ModelRequest(input_ids=[1, 2], priority=bad).validate()
    assert ModelRequest(input_ids=[1, 2], priority=-3).validate() > 0


async def test_probes_go_first_then_the_longest_groups_through_the_dispatch_bound(reward_pool, autojump_clock):
    # one segment at a time: the dispatch order is the whole schedule.  Group 0 is short (its
    # probe finishes: estimate 20), group 2 medium (estimate 100), group 1 longer than the
    # probe budget (estimate: its whole budget, 4096)
    backend = ScriptedSim()
    config = EngineConfig(scheduling="length_aware", length_aware_probe_tokens=256, scheduling_max_segments=1)
    items = [item(0, 20), item(1, 500), item(2, 100)]
    async with open_rollout_engine(backend, config, reward_pool=reward_pool) as engine:
        batch = await engine.rollout_batch(items, Scripted(), group_size=3)
        stats = engine.statistics()
    assert sorted(groups_of(batch).values()) == [3, 3, 3]
    sent = backend.sent
    assert all(s.priority == PROBE_PRIORITY and s.budget == 256 and s.done == 0 for s in sent[:3])
    assert {s.group for s in sent[:3]} == {0, 1, 2}  # every probe before any sibling
    rest = sent[3:]
    # then the longest groups first: group 1 (its two siblings and the probe's continuation), 2, 0.
    # (The slot the last probe frees goes to what waits at that moment: the siblings of that
    # probe's group queue a moment later.  From then on every segment is queued.)
    assert sorted(s.priority for s in rest) == [-4096] * 3 + [-100] * 2 + [-20] * 2
    assert [s.priority for s in rest[1:]] == sorted(s.priority for s in rest[1:])
    assert [s.group for s in rest[-2:]] == [0, 0] and rest[0].group in (1, 2)
    assert {s.priority for s in rest if s.group == 1} == {-4096} and {s.priority for s in rest if s.group == 2} == {-100}
    continuation = [s for s in rest if s.done > 0]
    assert [(s.group, s.done, s.budget) for s in continuation] == [(1, 256, 4096 - 256)]
    assert stats.scheduling == {"policy": "length_aware", "probes": 3, "probes_finished": 2, "siblings_waited": 6,
                                "siblings_unestimated": 0, "max_segments": 1,
                                "segments_waiting": 0, "peak_segments_waiting": 6}
    counts_add_up(stats)
    assert stats.accepted == 3


async def test_siblings_wait_for_their_probe_and_carry_its_estimate_as_priority(reward_pool, autojump_clock):
    # no engine-side bound: everything goes to the server at once, ordered by priority only
    backend = ScriptedSim()
    config = EngineConfig(scheduling="length_aware", length_aware_probe_tokens=64)
    items = [item(0, 30, 34, 38), item(1, 900, 800, 1000)]
    async with open_rollout_engine(backend, config, reward_pool=reward_pool) as engine:
        await engine.rollout_batch(items, Scripted(), group_size=3)
        alone = await engine.rollout_batch([item(7, 40)], Scripted(), group_size=1)  # nothing to estimate
        direct = await engine.agenerate(ModelRequest(input_ids=prompt(8, 12), priority=5,
                                                     gconfig=GenerationHyperparameters(max_new_tokens=64)))
    assert alone.batch_size[0] == 1 and direct.output_len == 12
    by_group = {g: [s for s in backend.sent if s.group == g] for g in (0, 1)}
    for group, segments in by_group.items():
        probe = segments[0]
        assert (probe.priority, probe.budget, probe.done) == (PROBE_PRIORITY, 64, 0)
        probe_end = next(t for t, task, sample in backend.ended if (task, sample) == (probe.task, probe.sample))
        siblings = [s for s in segments if s.sample != probe.sample]
        assert len(siblings) == 2 and all(s.t >= probe_end for s in siblings)  # sent once the probe returned
    # group 0's probe finished within 64 tokens: its length estimates its siblings'
    assert {s.priority for s in by_group[0][1:]} == {-[30, 34, 38][by_group[0][0].sample]}
    # group 1's probe did not: the siblings and the probe's rest go first, at its whole budget
    assert {s.priority for s in by_group[1][1:]} == {-4096}
    assert [s.priority for s in backend.sent if s.group in (7, 8)] == [0, 5]  # a group of one, outside an episode


class TwoSamples(Scripted):
    """Two generations at once per member (``rollout run --n-samples 2``): lengths
    ``data["lengths"][2 * sample index + k]``."""

    async def arun_episode(self, engine, data):
        from engine.context import sample_index
        from engine.trajectory import trajectory_from_response

        responses = {}

        async def one(k):
            length = data["lengths"][2 * sample_index.get() + k]
            responses[k] = await engine.agenerate(ModelRequest(
                input_ids=prompt(data["g"], length), gconfig=GenerationHyperparameters(max_new_tokens=4096)))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(one, 0)
            nursery.start_soon(one, 1)
        return trajectory_from_response(responses[0], 1.0)


async def test_the_probe_members_other_samples_wait_for_the_probe_too(reward_pool, autojump_clock):
    # regression (new-user trial, rollout run --n-samples 2): the probe member's second
    # generation shares its (task, sample) key; it went out at once at priority 0 (estimate
    # not known) and counted in no counter, and its end could be taken for the probe's
    backend = ScriptedSim()
    config = EngineConfig(scheduling="length_aware", length_aware_probe_tokens=64)
    async with open_rollout_engine(backend, config, reward_pool=reward_pool) as engine:
        await engine.rollout_batch([item(0, 30, 34, 40, 50)], TwoSamples(), group_size=2)
        stats = engine.statistics().scheduling
    probe = [s for s in backend.sent if s.priority == PROBE_PRIORITY]
    assert len(probe) == 1 and len(backend.sent) == 4
    probe_end = min(t for t, task, sample in backend.ended if (task, sample) == (probe[0].task, probe[0].sample))
    others = [s for s in backend.sent if s.priority != PROBE_PRIORITY]
    assert all(s.t >= probe_end for s in others)  # all three waited for the probe ...
    # ... and carry its length (whichever generation probed: each finishes within the probe's 64)
    assert len({s.priority for s in others}) == 1 and -others[0].priority in {30, 34, 40, 50}
    assert stats["probes"] == 1 and stats["siblings_waited"] == 3 and stats["siblings_unestimated"] == 0


async def test_a_probe_that_fails_releases_its_siblings(reward_pool, autojump_clock):
    class FailingProbe(ScriptedSim):
        async def generate(self, request, budget):
            if request.input_ids[1] == 10 and not self.sent:
                self.sent.append(None)
                raise RuntimeError("the probe's server went away")
            return await super().generate(request, budget)

    backend = FailingProbe()
    async with open_rollout_engine(backend, EngineConfig(scheduling="length_aware"), reward_pool=reward_pool) as engine:
        with trio.fail_after(60):
            await engine.rollout_batch([item(0, 50)], Scripted(), group_size=3)
        stats = engine.statistics()
    siblings = [s for s in backend.sent if s is not None]
    assert len(siblings) == 2 and {s.priority for s in siblings} == {-4096}  # unknown length: taken as the budget
    counts_add_up(stats)
    assert stats.accepted == 1  # the failure is the member's: the group is kept with its two others


async def test_the_dispatch_bound_serves_lower_priorities_first_and_survives_cancellation():
    gate = SlotGate(1)
    order = []

    async def segment(priority, name, hold=None):
        await gate.acquire(priority)
        order.append(name)
        if hold is not None:
            await hold.wait()
        gate.release()

    hold = trio.Event()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(segment, 0, "first", hold)
        await trio.testing.wait_all_tasks_blocked()
        cancelled = trio.CancelScope()

        async def doomed():
            with cancelled:
                await segment(-100, "cancelled")

        nursery.start_soon(doomed)
        for priority, name in ((5, "late"), (-3, "urgent"), (5, "later")):  # arriving in this order
            nursery.start_soon(segment, priority, name)
            await trio.testing.wait_all_tasks_blocked()
        assert gate.waiting == 4
        cancelled.cancel()
        await trio.testing.wait_all_tasks_blocked()
        hold.set()
    assert order == ["first", "urgent", "late", "later"]
    assert (gate.busy, gate.waiting, gate.peak_waiting) == (0, 0, 4)


async def test_fcfs_with_a_dispatch_bound_keeps_what_the_server_cannot_run_unsent(reward_pool, autojump_clock):
    """``scheduling="fcfs"`` with ``scheduling_max_segments``: at most that many segments at the server,
    the others wait in the engine (in the order they asked), unsent, so their tokens are stamped with the
    version at which they are sent, not the one at which they queued (the tail benchmark at eta 4:
    16% of tokens thrown away as stale instead of 28%)."""
    backend = ScriptedSim(max_running_seqs=8)
    config = EngineConfig(scheduling_max_segments=2, consumer_batch_size=1)
    items = [item(0, 10), item(1, 20), item(2, 10)]
    async with open_rollout_engine(backend, config, reward_pool=reward_pool) as engine:
        got = {}

        async def rollout():
            got["batch"] = await engine.rollout_batch(items, Scripted(), group_size=2)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(rollout)
            await trio.testing.wait_all_tasks_blocked()
            assert len(backend.sent) == 2  # two at the server, four wait in the engine
            engine.set_version(1)
        stats = engine.statistics()
    batch = got["batch"]
    # the two sent at once carry version 0; the four that waited in the engine were sent after set_version(1)
    assert sorted(min(v) for v in versions_of_rows(batch)) == [0, 0, 1, 1, 1, 1]
    sent = backend.sent
    assert len(sent) == 6 and sorted(s.group for s in sent) == [0, 0, 1, 1, 2, 2]
    assert all(s.priority == 0 and s.done == 0 and s.budget == 4096 for s in sent)  # one segment each, as fcfs
    assert max(_in_flight(backend)) == 2
    assert stats.scheduling == {"policy": "fcfs", "max_segments": 2, "segments_waiting": 0,
                                "peak_segments_waiting": 4}
    assert stats.accepted == 3
    counts_add_up(stats)


def _in_flight(backend) -> list[int]:
    """Segments at the server after each send and each answer."""
    events = sorted([(s.t, 1) for s in backend.sent] + [(t, -1) for t, _, _ in backend.ended], key=lambda e: (e[0], e[1]))
    level, levels = 0, []
    for _, d in events:
        level += d
        levels.append(level)
    return levels


async def test_with_a_free_dispatch_slot_siblings_do_not_wait_for_their_probe(reward_pool, autojump_clock):
    """The probe orders a queue; with room at the dispatch bound there is none, and waiting for the probe
    would only delay the group (its oldest token is the probe's: the delay eats its staleness window)."""
    backend = ScriptedSim()
    config = EngineConfig(scheduling="length_aware", length_aware_probe_tokens=64, scheduling_max_segments=4)
    items = [item(0, 300, 340), item(1, 900, 800)]  # 4 members, 4 slots: nobody queues
    async with open_rollout_engine(backend, config, reward_pool=reward_pool) as engine:
        await engine.rollout_batch(items, Scripted(), group_size=2)
        stats = engine.statistics()
    first = [s for s in backend.sent if s.done == 0]
    assert len(first) == 4 and {s.t for s in first} == {0.0}  # probes and siblings at once
    assert sorted(s.priority for s in first) == [PROBE_PRIORITY] * 2 + [0] * 2  # the siblings: no estimate yet
    assert stats.scheduling["siblings_waited"] == 0 and stats.scheduling["siblings_unestimated"] == 2
    assert stats.accepted == 2
    counts_add_up(stats)

"""Unit tier: the step policies, ``scheduling="overprovision"`` (APRIL) and
``"tail_batching"`` (RollPacker), and the contracts every policy keeps (the sim backend,
virtual time, a trainer loop: ``prepare_batch``, train, ``set_version``).

Every submitted episode ends once with a reason and ``statistics()`` adds up; no batch
holds a token past ``max_head_offpolicyness``; a group is handed out whole or not at all;
a recycled episode's tokens keep their versions (the boundary shows); tail batching's
deferred prompts run together in a dedicated round."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from engine import EngineConfig, ModelRequest, SimBackend, SimConfig, open_rollout_engine
from engine.errors import DataExhaustedError
from engine.context import sample_index
from engine.trajectory import trajectory_from_response
from engine.types import GenerationHyperparameters
from scheduling_fixtures import (Scripted, ScriptedSim, counts_add_up, groups_of, item, oldest_version, prompt_groups,
                                 versions_of_rows)
from workflows import RolloutWorkflow

#: two short groups then two long ones, twice: each step of four finds two of each
MIXED = [item(0, 60, 64), item(1, 70, 66), item(2, 450, 440), item(3, 500, 490),
         item(4, 60, 62), item(5, 70, 72), item(6, 450, 460), item(7, 500, 510)]
#: two short, four long, two short: the long ones cut in step 1 finish first in step 2
SHORT_LONG = [item(0, 60, 64), item(1, 70, 66), item(2, 450, 440), item(3, 500, 490),
              item(4, 480, 470), item(5, 520, 510), item(6, 60, 62), item(7, 70, 72)]


async def _train(engine, data, steps, *, group_size=2, train_s=1.0, marks=None):
    """The trainer loop; returns ``[(version at hand-out, batch)]``; ``marks`` gets
    ``(step start, hand-out)`` times."""
    out = []
    for _ in range(steps):
        start = trio.current_time()
        batch = await engine.prepare_batch(data, Scripted(), group_size=group_size, timeout=600)
        out.append((engine.version, batch))
        if marks is not None:
            marks.append((start, trio.current_time()))
        counts_add_up(engine.statistics())
        await trio.sleep(train_s)
        engine.set_version(engine.version + 1)
    return out


async def test_overprovision_parks_the_cut_resumes_them_first_and_keeps_their_versions(reward_pool, autojump_clock):
    backend = ScriptedSim()
    config = EngineConfig(scheduling="overprovision", consumer_batch_size=2, max_head_offpolicyness=2,
                          overprovision_ratio=1.0, overprovision_chunk_tokens=100)
    marks: list[tuple[float, float]] = []
    async with open_rollout_engine(backend, config, reward_pool=reward_pool) as engine:
        batches = await _train(engine, SHORT_LONG, 5, marks=marks)
        during = engine.statistics()
    after = engine.statistics()
    for version, batch in batches:
        assert list(groups_of(batch).values()) == [2, 2]  # B groups, each whole
        assert version - oldest_version(batch) <= 2  # the staleness bound, oldest token first
    assert prompt_groups(batches[0][1]) == [0, 1]  # the short ones of step 1 ...
    assert prompt_groups(batches[1][1]) == [2, 3]  # ... and the long ones, parked and resumed in step 2
    assert all(row[:100] == [0] * 100 and set(row[100:]) == {1} for row in versions_of_rows(batches[1][1]))
    sched = during.scheduling
    assert sched["policy"] == "overprovision" and sched["steps"] == 5
    assert sched["cut_episodes"] >= 2 and sched["parks"] >= 4 and sched["resumed_segments"] >= 4
    # chunks of at most 100 tokens; nothing sent between a hand-out and the next step
    assert max(s.budget for s in backend.sent) == 100
    for (_, handed), (start, _) in zip(marks, marks[1:]):
        assert not [s for s in backend.sent if handed < s.t < start]
    # step 2 starts with the parked members' segments (priority -1), then the fresh episodes'
    step2 = [s for s in backend.sent if s.t >= marks[1][0]]
    resumed = step2[:4]
    assert {(s.group, s.done, s.priority) for s in resumed} == {(2, 100, -1), (3, 100, -1)} and len(resumed) == 4
    assert all(s.done == 0 and s.priority == 0 for s in step2[4:] if s.task not in {r.task for r in resumed}
               and s.t == marks[1][0])
    # every episode ended once: the ones parked when the engine closed are cancelled
    counts_add_up(after)
    assert after.queued == after.running == 0
    assert set(after.failed_by_reason) <= {"cancelled"} and set(after.rejected_by_reason) <= {"stale"}
    assert after.accepted >= 10  # the five batches' groups (and any accepted but not taken)


async def test_a_parked_episode_counts_as_recycled_while_it_waits(reward_pool, autojump_clock):
    # regression (new-user trial): recycled_episodes ("alive, parked at least once") stayed 0
    # while the cut episodes waited for the next step; it counted them only once released
    config = EngineConfig(scheduling="overprovision", consumer_batch_size=2, max_head_offpolicyness=None,
                          overprovision_ratio=1.0, overprovision_chunk_tokens=100)
    data = [item(0, 60), item(1, 60), item(2, 3000), item(3, 3000)] + [item(g, 50 + g) for g in range(4, 30)]
    async with open_rollout_engine(ScriptedSim(), config, reward_pool=reward_pool) as engine:
        await engine.prepare_batch(data, Scripted(), group_size=1, timeout=600)
        await trio.sleep(5.0)  # the trainer trains: the cut members reach their next segment and park
        sched = engine.statistics().scheduling
        assert sched["parked"] == 2 and sched["recycled_episodes"] == 2


async def test_overprovision_resumes_the_parked_before_any_fresh_episode_sends(reward_pool, autojump_clock):
    # groups of one start generating in their own task's first run: only admission's hold
    # keeps a fresh one from sending before a released member (trio runs a batch of tasks in
    # either order); two long episodes stay recycled for every step
    backend = ScriptedSim()
    config = EngineConfig(scheduling="overprovision", consumer_batch_size=2, max_head_offpolicyness=None,
                          overprovision_ratio=1.0, overprovision_chunk_tokens=100)
    data = [item(0, 60), item(1, 60), item(2, 3000), item(3, 3000)] + [item(g, 50 + g) for g in range(4, 30)]
    marks: list[tuple[float, float]] = []
    async with open_rollout_engine(backend, config, reward_pool=reward_pool) as engine:
        await _train(engine, data, 8, group_size=1, marks=marks)
        stats = engine.statistics()
    for start, _ in marks[1:]:
        first = [s for s in backend.sent if s.t == start]
        assert [(s.group, s.priority) for s in first[:2]] in ([(2, -1), (3, -1)], [(3, -1), (2, -1)])
        assert all(s.done == 0 and s.priority == 0 for s in first[2:])
    assert stats.scheduling["resumed_segments"] == 2 * 7 and stats.scheduling["recycled_episodes"] == 2


async def test_tail_batching_defers_the_cut_prompts_to_a_dedicated_long_round(reward_pool, autojump_clock):
    backend = ScriptedSim()
    config = EngineConfig(scheduling="tail_batching", consumer_batch_size=2, max_head_offpolicyness=0,
                          overprovision_ratio=1.0)
    marks: list[tuple[float, float]] = []
    async with open_rollout_engine(backend, config, reward_pool=reward_pool) as engine:
        batches = await _train(engine, MIXED, 4, marks=marks)
        stats = engine.statistics()
    # short round, long round of the two cut, short round, long round
    assert [prompt_groups(b) for _, b in batches] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    for version, batch in batches:
        assert list(groups_of(batch).values()) == [2, 2]
        assert oldest_version(batch) == version  # on-policy: the long round generates afresh
    for step in (1, 3):  # the long rounds: only the deferred prompts, from scratch, in new episodes
        start, handed = marks[step]
        sent = [s for s in backend.sent if start <= s.t <= handed]
        assert {s.group for s in sent} == set(prompt_groups(batches[step][1]))
        assert all(s.done == 0 for s in sent)
        earlier = {s.task for s in backend.sent if s.t < start and s.group in prompt_groups(batches[step][1])}
        assert earlier and not earlier & {s.task for s in sent}
    counts_add_up(stats)
    assert stats.rejected_by_reason == {"deferred": 4}
    sched = stats.scheduling
    assert (sched["long_rounds"], sched["deferred_episodes"], sched["cut_episodes"], sched["deferred_prompts"]) == \
        (2, 4, 4, 0)


async def test_tail_batching_runs_what_is_deferred_when_one_pass_data_runs_out(reward_pool, autojump_clock):
    backend = ScriptedSim()
    config = EngineConfig(scheduling="tail_batching", consumer_batch_size=2, overprovision_ratio=1.0)
    data = iter([item(0, 60, 61), item(1, 70, 71), item(2, 450, 451)])
    trained = []
    async with open_rollout_engine(backend, config, reward_pool=reward_pool) as engine:
        for _ in range(2):
            trained.append(prompt_groups(await engine.prepare_batch(data, Scripted(), group_size=2, timeout=600)))
            engine.set_version(engine.version + 1)
        with pytest.raises(DataExhaustedError):
            await engine.prepare_batch(data, Scripted(), group_size=2, timeout=600)
        stats = engine.statistics()
    assert trained == [[0, 1], [2]]  # the deferred prompt reaches training in the last (partial) batch
    counts_add_up(stats)
    assert stats.rejected_by_reason == {"deferred": 1} and stats.accepted == 3


async def test_the_deferred_prompts_travel_in_a_checkpoint(reward_pool, autojump_clock):
    config = EngineConfig(scheduling="tail_batching", consumer_batch_size=2, overprovision_ratio=1.0)
    async with open_rollout_engine(ScriptedSim(), config, reward_pool=reward_pool) as engine:
        await engine.prepare_batch(MIXED, Scripted(), group_size=2, timeout=600)
        await trio.testing.wait_all_tasks_blocked()  # the cut episodes end
        state = engine.state_dict()
    assert sorted(state["deferred"], key=lambda d: d["g"]) == [MIXED[2], MIXED[3]]  # (in the order they ended)
    async with open_rollout_engine(ScriptedSim(), config, reward_pool=reward_pool) as engine:
        engine.load_state_dict(state, Scripted())
        assert engine.statistics().scheduling["deferred_prompts"] == 2
        batch = await engine.prepare_batch(MIXED, Scripted(), group_size=2, timeout=600)
        assert prompt_groups(batch) == [2, 3]  # a long round first
    async with open_rollout_engine(ScriptedSim(), EngineConfig(consumer_batch_size=2), reward_pool=reward_pool) as engine:
        with pytest.raises(ValueError, match="scheduling='tail_batching'"):
            engine.load_state_dict(state, Scripted())
        assert engine.statistics().submitted == 0  # nothing half-loaded


class SimGroup(RolloutWorkflow):
    """One sim generation per member (its drawn length), reward 1."""

    async def arun_episode(self, engine, data):
        req = ModelRequest(input_ids=[5, data["g"] + 10, 11, 12 + sample_index.get()],
                           gconfig=GenerationHyperparameters(max_new_tokens=400))
        return trajectory_from_response(await engine.agenerate(req), 1.0)


@pytest.mark.parametrize("policy", ["fcfs", "overprovision", "length_aware", "tail_batching"])
async def test_every_policy_accounts_for_every_episode_and_keeps_the_bound(policy, reward_pool, autojump_clock):
    # heavy-tailed lengths, a server that holds 6 sequences, injected errors and aborts
    # (resumed segments), a filter, groups dropped when a member fails
    backend = SimBackend(SimConfig(per_token_s=0.001, prefill_s=0.002, out_len_median=60, out_len_sigma=1.2,
                                   max_running_seqs=6, error_fraction=0.04, abort_fraction=0.1, seed=3,
                                   draws_by_prompt=True))
    config = EngineConfig(scheduling=policy, consumer_batch_size=2, max_head_offpolicyness=1, overprovision_ratio=0.5,
                          overprovision_chunk_tokens=48, length_aware_probe_tokens=32, drop_incomplete_group=True,
                          **({"scheduling_max_segments": 5} if policy != "fcfs" else {}))
    data = [{"g": g} for g in range(11)]

    async def keep(traj):  # (async: a sync filter runs in a thread, which virtual time does not wait for)
        return int(traj["input_ids"][0, 1]) % 5 != 0

    handed = []
    async with open_rollout_engine(backend, config, reward_pool=reward_pool) as engine:
        for _ in range(6):
            batch = await engine.prepare_batch(data, SimGroup(), should_accept_fn=keep, group_size=3, timeout=600)
            handed.append((engine.version, batch))
            counts_add_up(engine.statistics())
            await trio.sleep(0.2)
            engine.set_version(engine.version + 1)
        during = engine.statistics()
    after = engine.statistics()
    for version, batch in handed:
        assert list(groups_of(batch).values()) == [3, 3]
        assert version - oldest_version(batch) <= 1
    counts_add_up(after)
    assert after.queued == after.running == 0 and after.submitted > 12
    assert "filtered" in after.rejected_by_reason
    assert set(after.rejected_by_reason) <= {"filtered", "incomplete_group", "deferred", "stale"}
    assert set(after.failed_by_reason) <= {"cancelled"}
    assert after.segments_resumed > 0 and backend.statistics().aborts_injected > 0
    sched = during.scheduling or {}
    assert (sched.get("policy"), bool(sched.get("parks")), bool(sched.get("long_rounds")), bool(sched.get("probes"))) == {
        "fcfs": (None, False, False, False), "overprovision": ("overprovision", True, False, False),
        "length_aware": ("length_aware", False, False, True), "tail_batching": ("tail_batching", False, True, False),
    }[policy]  # each policy did its part: parked cut episodes, ran long rounds, probed groups


async def test_a_sharded_engine_refuses_a_scheduling_policy():
    from engine.shards import open_sharded_engine

    with pytest.raises(ValueError, match="scheduling='fcfs'"):
        async with open_sharded_engine(SimBackend(), EngineConfig(scheduling="length_aware"), shards=2):
            pass
    with pytest.raises(ValueError, match="scheduling_max_segments=8: a sharded engine has no engine-wide"):
        async with open_sharded_engine(SimBackend(), EngineConfig(scheduling_max_segments=8), shards=2):
            pass

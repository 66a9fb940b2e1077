"""Unit tier: ``EngineConfig(scheduling_max_segments="server")``: the engine bounds the
segments in flight by its backend's running-sequence limit, read once the backend is open
(the sim's ``max_running_seqs``; the sum of vLLM's ``scheduler_config.max_num_seqs`` over the
servers, from ``/server_info``), or runs unbounded with one INFO line when the backend does
not know it.  Virtual time; the vLLM fakes behind ``httpx.MockTransport``."""

from __future__ import annotations

import logging

import pytest

from engine import EngineConfig, open_rollout_engine
from engine._scheduling import resolve_max_segments
from engine.backends.remote import make_remote_backend
from engine.backends.sim import SimBackend
from fake_servers import FakeVLLM, mock_transport
from scheduling_fixtures import Scripted, ScriptedSim, counts_add_up, item

A, B = "http://a:1", "http://b:1"
# a group's members alike: which one probes (trio's order among ready episodes) does not matter
ITEMS = [item(0, 6, 6), item(1, 20, 20), item(2, 40, 40), item(3, 5, 5), item(4, 30, 30)]


def in_flight(backend) -> list[int]:
    """Segments at the server after each send and each answer."""
    events = sorted([(s.t, 1) for s in backend.sent] + [(t, -1) for t, _, _ in backend.ended])
    level, levels = 0, []
    for _, step in events:
        level += step
        levels.append(level)
    return levels


@pytest.mark.parametrize("value", ["servers", "", "SERVER", 0, -1, 1.5, True])
def test_a_bad_bound_is_one_error_naming_the_field(value):
    with pytest.raises(ValueError, match=r"^scheduling_max_segments must be an int >= 1"):
        EngineConfig(scheduling_max_segments=value)


def test_server_and_ints_are_accepted():
    assert EngineConfig(scheduling_max_segments="server").scheduling_max_segments == "server"
    assert EngineConfig(scheduling_max_segments=1).scheduling_max_segments == 1


@pytest.mark.parametrize("scheduling", ["fcfs", "length_aware", "overprovision", "tail_batching"])
def test_the_resolved_config_is_the_int_config(scheduling):
    """The policy is built from the config alone: the resolved config *is* the int one."""
    server = EngineConfig(scheduling=scheduling, scheduling_max_segments="server")
    assert resolve_max_segments(server, lambda: 7) == EngineConfig(scheduling=scheduling, scheduling_max_segments=7)
    for fixed in (EngineConfig(scheduling_max_segments=2), EngineConfig()):
        assert resolve_max_segments(fixed, lambda: pytest.fail("asked for an int or None")) is fixed


@pytest.mark.parametrize("scheduling", ["fcfs", "length_aware"])
async def test_the_sims_limit_bounds_exactly_as_the_same_int(scheduling, reward_pool, autojump_clock):
    """``"server"`` on a sim with ``max_running_seqs=3`` is ``scheduling_max_segments=3``: the same
    segments sent at the same virtual times in the same order, the same counters."""
    runs = {}
    for bound in (3, "server"):
        backend = ScriptedSim(max_running_seqs=3)
        config = EngineConfig(scheduling=scheduling, scheduling_max_segments=bound, length_aware_probe_tokens=8)
        async with open_rollout_engine(backend, config, reward_pool=reward_pool) as engine:
            await engine.rollout_batch(ITEMS, Scripted(), group_size=2)
            stats = engine.statistics()
        counts_add_up(stats)
        assert stats.accepted == 5
        start = backend.sent[0].t  # the clock runs on between the two engines
        # (trio's scheduling order among ready episodes is not fixed, so neither is which one goes first)
        segments = sorted((s.group, s.priority, s.budget, s.done) for s in backend.sent)
        at_once = sum(s.t == start for s in backend.sent)
        runs[bound] = (segments, at_once, max(in_flight(backend)), stats.scheduling)
    if scheduling == "fcfs":  # (length_aware: whether a sibling finds a free slot before its probe ends varies)
        assert runs["server"] == runs[3]
    segments, at_once, most, scheduling_stats = runs["server"]
    assert at_once == 3 and most == 3
    assert scheduling_stats["max_segments"] == 3 and scheduling_stats["peak_segments_waiting"] > 0


async def test_vllm_servers_limits_add_up(reward_pool, autojump_clock):
    fakes = {A: FakeVLLM(max_num_seqs=3), B: FakeVLLM(max_num_seqs=5)}
    backend = make_remote_backend("vllm", [A, B], transport=mock_transport(fakes), seed=0)
    assert backend.running_sequence_limit() is None  # not read before the backend opens
    async with open_rollout_engine(backend, EngineConfig(scheduling_max_segments="server"),
                                   reward_pool=reward_pool) as engine:
        assert backend.running_sequence_limit() == 8
        assert engine.statistics().scheduling["max_segments"] == 8


@pytest.mark.parametrize("case", ["one server unread", "sim without a limit"])
async def test_an_unknown_limit_runs_unbounded_and_says_so_once(case, reward_pool, autojump_clock, caplog):
    if case == "one server unread":
        fakes = {A: FakeVLLM(max_num_seqs=3), B: FakeVLLM(max_num_seqs=None)}
        backend = make_remote_backend("vllm", [A, B], transport=mock_transport(fakes), seed=0)
    else:
        backend = SimBackend(per_token_s=0.001)
    caplog.set_level(logging.INFO, logger="rollout")
    async with open_rollout_engine(backend, EngineConfig(scheduling_max_segments="server"),
                                   reward_pool=reward_pool) as engine:
        stats = engine.statistics()
    assert backend.running_sequence_limit() is None
    assert stats.scheduling is None or stats.scheduling.get("max_segments") is None
    lines = [r for r in caplog.records if "scheduling_max_segments='server'" in r.getMessage()]
    assert len(lines) == 1 and lines[0].levelno == logging.INFO
    assert "no engine-side bound" in lines[0].getMessage()


async def test_a_sharded_engine_refuses_the_servers_bound():
    from engine.shards import open_sharded_engine

    with pytest.raises(ValueError, match="scheduling_max_segments='server': a sharded engine has no engine-wide"):
        async with open_sharded_engine(SimBackend(), EngineConfig(scheduling_max_segments="server"), shards=2):
            pass


@pytest.mark.parametrize(("vllm_config", "limit"), [
    ({"scheduler_config": {"max_num_seqs": 256}}, 256),
    ({"scheduler_config": {"max_num_seqs": 256, "max_num_active_seqs": 64}}, 64),  # admits only that many
    ({"scheduler_config": {"max_num_seqs": 256}, "parallel_config": {"data_parallel_size": 1}}, 256),
    ({"scheduler_config": {"max_num_seqs": 256}, "parallel_config": {"data_parallel_size": 2}}, None),  # per rank
    ({"scheduler_config": {"max_num_seqs": True}}, None),
    ({"scheduler_config": {}}, None),
    ({}, None),
])
def test_one_vllm_servers_limit_from_its_server_info(vllm_config, limit):
    from engine.backends.remote.vllm import _running_limit

    assert _running_limit(vllm_config) == limit

"""Unit tier: the ``sim`` backend's server model on virtual time (``autojump_clock``).

K-slot queueing, decode slowdown with running sequences, stragglers, injected
errors and aborts (resumed by the engine), per-prompt draws, and the replay
(:func:`simulate_makespan`) matching what the live backend did.
"""

from __future__ import annotations

import math

import pytest
import trio

from engine import BackendError, GenerationHyperparameters, InvalidRequestError, ModelRequest, open_rollout_engine
from engine.backends.sim import (
    ServerModel,
    SimBackend,
    SimConfig,
    SimRequest,
    group_episodes,
    prompt_key,
    simulate_makespan,
    tile_pool,
)


def _req(prompt=(5, 6, 7), max_new_tokens=1000, seed=None) -> ModelRequest:
    return ModelRequest(input_ids=list(prompt), gconfig=GenerationHyperparameters(max_new_tokens=max_new_tokens,
                                                                                  seed=seed))


async def _finish_times(engine, prompts, max_new_tokens=1000) -> list[float]:
    """Send every prompt at t0 at once; return each request's finish time - t0."""
    t0 = trio.current_time()
    ends = [math.nan] * len(prompts)

    async def one(i):
        await engine.agenerate(_req(prompts[i], max_new_tokens))
        ends[i] = trio.current_time() - t0

    async with trio.open_nursery() as nursery:
        for i in range(len(prompts)):
            nursery.start_soon(one, i)
    return ends


async def test_k_slots_queue_fifo(reward_pool, autojump_clock):
    # K = 2, 1 s prefill, 10 tokens x 0.1 s: two at a time, 2 s each
    cfg = SimConfig(vocab_size=50, prefill_s=1.0, per_token_s=0.1, out_len_median=10, max_running_seqs=2)
    backend = SimBackend(cfg)
    async with open_rollout_engine(backend, reward_pool=reward_pool) as engine:
        ends = await _finish_times(engine, [(i + 10,) for i in range(5)])
    assert sorted(ends) == pytest.approx([2.0, 2.0, 4.0, 4.0, 6.0])
    assert backend.statistics().peak_running_seqs == 2


async def test_decode_step_slows_down_with_running_sequences(reward_pool, autojump_clock):
    # slowdown 1.0: a step takes per_token_s * R.  A needs 2 tokens, B 4 tokens:
    # both decode at 2 s/step for 2 steps (A ends at 4 s), then B alone at 1 s/step -> 6 s.
    cfg = SimConfig(vocab_size=50, per_token_s=1.0, out_len_median=4, decode_slowdown_per_seq=1.0)
    async with open_rollout_engine(SimBackend(cfg), reward_pool=reward_pool) as engine:
        t0 = trio.current_time()
        ends = {}

        async def one(name, budget):
            resp = await engine.agenerate(_req((1, 2, len(name)), max_new_tokens=budget))
            ends[name] = (trio.current_time() - t0, resp.output_len, resp.stop_reason)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(one, "A", 2)  # capped at 2 tokens by its budget
            nursery.start_soon(one, "BB", 8)
    assert ends["A"] == (pytest.approx(4.0), 2, "length")
    assert ends["BB"] == (pytest.approx(6.0), 4, "stop")


def test_server_model_rate_changes_are_exact():
    model = ServerModel(per_token_s=0.5, decode_slowdown_per_seq=0.5)
    done = {}
    model.submit(0.0, 0.0, 3, lambda end, _: done.setdefault("a", end))
    model.submit(1.0, 0.0, 1, lambda end, _: done.setdefault("b", end))
    # a alone for 1 s: 2 steps at 0.5 s; then a and b at 0.75 s/step: both finish after one more step
    while model.next_event_time() < math.inf:
        model.advance(model.next_event_time())
    assert done == {"a": pytest.approx(1.75), "b": pytest.approx(1.75)}
    assert model.occupied == 0 and model.decoding == 0


async def test_frontend_serves_requests_one_at_a_time(reward_pool, autojump_clock):
    # 0.5 s of front end each, then 2 tokens x 1 s on an unbounded server: the front end
    # lets them through 0.5 s apart, so they end at 2.5, 3.0, 3.5, 4.0 (not all at 2.5)
    cfg = SimConfig(vocab_size=50, per_token_s=1.0, out_len_median=2, frontend_s_per_request=0.5)
    async with open_rollout_engine(SimBackend(cfg), reward_pool=reward_pool) as engine:
        ends = await _finish_times(engine, [(i + 10,) for i in range(4)], max_new_tokens=2)
    assert sorted(ends) == pytest.approx([2.5, 3.0, 3.5, 4.0])


async def test_request_cancelled_in_the_frontend_takes_no_draw(reward_pool, autojump_clock):
    cfg = SimConfig(vocab_size=50, per_token_s=1.0, out_len_median=3, frontend_s_per_request=1.0)
    backend = SimBackend(cfg, record=True)
    async with open_rollout_engine(backend, reward_pool=reward_pool) as engine:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(engine.agenerate, _req((1,)))  # holds the front end for 1 s
            await trio.testing.wait_all_tasks_blocked()
            with trio.move_on_after(0.5):  # still waiting behind the first
                await engine.agenerate(_req((2,)))
    assert len(backend.requests) == 1  # only the first one was drawn


async def test_cancelled_request_frees_its_slot(reward_pool, autojump_clock):
    cfg = SimConfig(vocab_size=50, prefill_s=0.0, per_token_s=1.0, out_len_median=100, max_running_seqs=1)
    backend = SimBackend(cfg)
    async with open_rollout_engine(backend, reward_pool=reward_pool) as engine:
        with trio.move_on_after(5.0):
            await engine.agenerate(_req((1,)))
        await trio.testing.wait_all_tasks_blocked()
        assert backend.statistics().sequences_running == 0
        t0 = trio.current_time()
        await engine.agenerate(_req((2,), max_new_tokens=3))  # gets the slot at once
        assert trio.current_time() - t0 == pytest.approx(3.0)


async def test_stragglers_take_multiplier_times_longer(reward_pool, autojump_clock):
    cfg = SimConfig(vocab_size=50, prefill_s=0.5, per_token_s=0.01, out_len_median=20, straggler_fraction=1.0,
                    straggler_multiplier=3.0)
    backend = SimBackend(cfg)
    async with open_rollout_engine(backend, reward_pool=reward_pool) as engine:
        t0 = trio.current_time()
        resp = await engine.agenerate(_req())
        assert trio.current_time() - t0 == pytest.approx(3 * (0.5 + 20 * 0.01))
    assert resp.output_len == 20 and backend.stragglers == 1


async def test_straggler_and_failure_fractions(reward_pool, autojump_clock):
    cfg = SimConfig(vocab_size=50, out_len_median=4, straggler_fraction=0.25, straggler_multiplier=2.0,
                    error_fraction=0.2, seed=7)
    backend = SimBackend(cfg)
    errors = 0
    async with open_rollout_engine(backend, reward_pool=reward_pool) as engine:
        for i in range(400):
            try:
                await engine.agenerate(_req((i, i + 1)))
            except BackendError as exc:
                assert "injected" in str(exc)
                errors += 1
    assert errors == backend.errors_injected
    assert 50 <= errors <= 110  # 0.2 * 400 = 80
    assert 60 <= backend.stragglers <= 140  # 0.25 * 400 = 100


async def test_error_fails_the_request_after_its_prefill(reward_pool, autojump_clock):
    cfg = SimConfig(vocab_size=50, prefill_s=2.0, per_token_s=1.0, error_fraction=1.0)
    async with open_rollout_engine(SimBackend(cfg), reward_pool=reward_pool) as engine:
        t0 = trio.current_time()
        with pytest.raises(BackendError, match="injected server error"):
            await engine.agenerate(_req())
        assert trio.current_time() - t0 == pytest.approx(2.0)


async def test_abort_is_resumed_by_the_engine(reward_pool, autojump_clock):
    cfg = SimConfig(vocab_size=50, prefill_s=1.0, per_token_s=0.1, out_len_median=10, abort_fraction=1.0, seed=2)
    backend = SimBackend(cfg, record=True)
    plain = SimBackend(SimConfig(vocab_size=50, prefill_s=1.0, per_token_s=0.1, out_len_median=10, seed=2))
    async with open_rollout_engine(backend, reward_pool=reward_pool) as engine:
        t0 = trio.current_time()
        resp = await engine.agenerate(_req())
        elapsed = trio.current_time() - t0
    assert resp.output_len == 10 and resp.stop_reason == "stop" and resp.output_tokens[-1] == cfg.eos_token_id
    assert elapsed == pytest.approx(2 * 1.0 + 10 * 0.1)  # two prefills, 5 + 5 tokens
    assert backend.aborts_injected == 1 and backend.statistics().requests_served == 2
    assert backend.requests == [SimRequest(prompt_key([5, 6, 7]), 3, 10, 1.0, "abort")]
    assert simulate_makespan(group_episodes(backend.requests), 1, cfg) == pytest.approx(elapsed)
    async with open_rollout_engine(plain, reward_pool=reward_pool) as engine:
        same = await engine.agenerate(_req())
    assert same.output_tokens == resp.output_tokens  # the resumed half continues the same draw


async def test_draws_by_prompt_do_not_depend_on_the_schedule(reward_pool, autojump_clock):
    cfg = SimConfig(vocab_size=500, out_len_median=30, out_len_sigma=0.8, straggler_fraction=0.3,
                    straggler_multiplier=2.0, draws_by_prompt=True, seed=5)
    prompts = [(i, 7, 9) for i in range(20)] + [(3, 7, 9)]  # one prompt twice
    outputs = []
    for order in (prompts, prompts[::-1]):
        backend, planner = SimBackend(cfg, record=True), SimBackend(cfg)
        got, want, seen = {}, [], {}
        async with open_rollout_engine(backend, reward_pool=reward_pool) as engine:
            for p in order:
                got.setdefault(p, []).append((await engine.agenerate(_req(p))).output_tokens)
                k = seen[p] = seen.get(p, -1) + 1
                d = planner.draw(list(p), 1000, occurrence=k)  # the plan: no side effect
                want.append(SimRequest(prompt_key(list(p)), 3, d.n, d.multiplier, d.outcome))
        assert backend.requests == want
        outputs.append(got)
    assert outputs[0] == outputs[1]
    assert outputs[0][(3, 7, 9)][0] != outputs[0][(3, 7, 9)][1]  # the k-th occurrence draws anew
    assert len({len(t) for ts in outputs[0].values() for t in ts}) > 3  # lengths vary (lognormal)


async def test_default_model_matches_the_legacy_formula(reward_pool, autojump_clock):
    cfg = SimConfig(vocab_size=100, prefill_s=0.5, prefill_s_per_token=0.01, per_token_s=0.01, out_len_median=20)
    async with open_rollout_engine(SimBackend(cfg), reward_pool=reward_pool) as engine:
        t0 = trio.current_time()
        resp = await engine.agenerate(_req((1,) * 10, max_new_tokens=50))
    assert trio.current_time() - t0 == pytest.approx(0.5 + 10 * 0.01 + 20 * 0.01)
    assert resp.ttft == pytest.approx(0.5 + 10 * 0.01 + 0.01)


def test_simulate_makespan_is_list_scheduling_without_interaction():
    cfg = SimConfig(prefill_s=0.0, per_token_s=1.0)
    eps = [[SimRequest(i, 1, n)] for i, n in enumerate([1, 2, 3, 1])]
    # 2 slots: t=0 start 1 and 2; t=1 start 3 (ends 4); t=2 start 1 (ends 3) -> 4
    assert simulate_makespan(eps, 2, cfg) == pytest.approx(4.0)
    assert simulate_makespan(eps, 1, cfg) == pytest.approx(7.0)
    assert simulate_makespan(eps, 8, cfg) == pytest.approx(3.0)
    # an episode ends with its slowest request; a straggler and an error count their time
    grouped = [[SimRequest(0, 1, 2), SimRequest(0, 1, 5)], [SimRequest(1, 1, 1, 3.0)], [SimRequest(2, 1, 9, 1.0, "error")]]
    assert simulate_makespan(grouped, 1, SimConfig(prefill_s=0.5, per_token_s=1.0)) == pytest.approx(5.5 + 4.5 + 0.5)
    assert simulate_makespan([], 4, cfg) == 0.0
    with pytest.raises(ValueError, match="concurrency"):
        simulate_makespan(eps, 0, cfg)


async def test_live_sim_matches_its_replay_under_load(reward_pool, autojump_clock):
    """A zero-overhead client (virtual time) on the live shared-clock sim takes
    exactly the replayed makespan."""
    cfg = SimConfig(vocab_size=100, prefill_s=0.05, prefill_s_per_token=0.001, per_token_s=0.002,
                    out_len_median=50, out_len_sigma=0.7, max_running_seqs=6, decode_slowdown_per_seq=0.1,
                    straggler_fraction=0.1, straggler_multiplier=4.0, abort_fraction=0.1, seed=11)
    backend = SimBackend(cfg, record=True)
    prompts = [tuple(range(i % 7 + 1)) + (1000 + i,) for i in range(60)]
    async with open_rollout_engine(backend, reward_pool=reward_pool) as engine:
        t0 = trio.current_time()
        pending = list(prompts)

        async def client():
            while pending:
                await engine.agenerate(_req(pending.pop(0)))

        async with trio.open_nursery() as nursery:
            for _ in range(9):  # 9 client slots, 6 server slots
                nursery.start_soon(client)
        wall = trio.current_time() - t0
    assert len(backend.requests) == 60 and backend.aborts_injected > 0
    assert simulate_makespan(group_episodes(backend.requests), 9, cfg) == pytest.approx(wall, rel=1e-9)


async def test_thousands_of_requests_in_flight(reward_pool, autojump_clock):
    # (the benchmarks run 16384 episodes in flight; this keeps the unit tier fast)
    cfg = SimConfig(vocab_size=100, prefill_s=0.05, per_token_s=0.002, out_len_median=64, out_len_sigma=0.5,
                    max_running_seqs=512, decode_slowdown_per_seq=1e-4)
    backend = SimBackend(cfg)
    n = 2048
    done = 0
    async with open_rollout_engine(backend, reward_pool=reward_pool) as engine:

        async def one(i):
            nonlocal done
            await engine.agenerate(_req((i,), max_new_tokens=256))
            done += 1

        async with trio.open_nursery() as nursery:
            for i in range(n):
                nursery.start_soon(one, i)
    assert done == n and backend.peak_in_progress == n
    assert backend.statistics().peak_running_seqs == 512


def test_config_validation_names_the_field():
    with pytest.raises(InvalidRequestError, match="straggler_multiplier"):
        SimConfig(straggler_multiplier=0.5)
    with pytest.raises(InvalidRequestError, match="error_fraction"):
        SimConfig(error_fraction=1.5)
    with pytest.raises(InvalidRequestError, match="max_running_seqs"):
        SimConfig(max_running_seqs=0)
    with pytest.raises(InvalidRequestError, match="decode_slowdown_per_seq"):
        SimConfig(decode_slowdown_per_seq=-1.0)
    with pytest.raises(InvalidRequestError, match="frontend_s_per_request"):
        SimConfig(frontend_s_per_request=-0.1)
    with pytest.raises(ValueError, match="token_pool"):
        tile_pool([])
    with pytest.raises(InvalidRequestError, match="token_pool"):  # the backend's config error
        SimBackend(token_pool=[-1])
    assert len(tile_pool([1, 2, 3])) == 1 << 16


def test_server_model_makes_progress_at_large_clock_values():
    # trio's clock starts around 1e5 s: there, the last picoseconds of a decode round to
    # nothing, and an event at "now" must still fire (a regression: the clock spun)
    model = ServerModel(per_token_s=0.002, decode_slowdown_per_seq=0.01)
    done = []
    for i in range(300):
        model.submit(123456.789 + i * 0.0007, 0.05 * (i % 7) / 7, 1 + (i * 37) % 300, lambda end, _: done.append(end))
    for _ in range(10_000):
        t = model.next_event_time()
        if t == math.inf:
            break
        model.advance(t)
    assert len(done) == 300 and model.occupied == 0

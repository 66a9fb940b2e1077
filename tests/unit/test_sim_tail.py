"""Unit tier: the sim's long tail (issue 27), in virtual time: per-prompt difficulty
(heavy-tailed lengths correlated within a group, deterministic under a seed), priority
admission (vLLM ``--scheduling-policy priority``), the KV-token budget with recompute
preemption, ``abort_request`` returning partial tokens, and lost work counted."""

from __future__ import annotations

import math
import statistics

import pytest
import trio
import trio.testing

from engine import GenerationHyperparameters, InvalidRequestError, ModelRequest, open_rollout_engine
from engine.backends.sim import ServerModel, SimBackend, SimConfig, prompt_difficulty, prompt_key, prompt_rng


def _req(prompt=(5, 6, 7), priority=0, rid=None, max_new_tokens=1000) -> ModelRequest:
    extra = {} if rid is None else {"rid": rid}
    return ModelRequest(input_ids=list(prompt), priority=priority,
                        gconfig=GenerationHyperparameters(max_new_tokens=max_new_tokens), **extra)


# -- the length model ---------------------------------------------------------------------------
_TAIL = SimConfig(out_len_median=512, out_len_sigma=0.45, difficulty_sigma=0.65, draws_by_prompt=True, seed=0)


def _group_lengths(cfg: SimConfig, prompts: int = 400, group: int = 8) -> list[list[int]]:
    backend = SimBackend(cfg)
    return [[backend.draw([i + 10, 7, i], 10**6, occurrence=k).n for k in range(group)] for i in range(prompts)]


def test_lengths_are_heavy_tailed_and_correlated_within_a_group():
    groups = _group_lengths(_TAIL)
    logs = [[math.log(n) for n in g] for g in groups]
    flat = [x for g in logs for x in g]
    total = statistics.pvariance(flat)
    within = statistics.fmean(statistics.variance(g) for g in logs)  # unbiased per group
    # log-length variance 0.65^2 + 0.45^2 = 0.625; the share the prompt explains 0.65^2 / 0.625 = 0.676
    assert total == pytest.approx(0.625, rel=0.12)
    assert 1 - within / total == pytest.approx(0.676, abs=0.08)
    lengths = sorted(n for g in groups for n in g)
    assert statistics.median(lengths) == pytest.approx(512, rel=0.1)
    assert lengths[int(0.99 * len(lengths))] / statistics.median(lengths) > 4  # heavy tail: p99 ~ 6.3x the median
    # without per-prompt difficulty the samples of a prompt are independent
    plain = [[math.log(n) for n in g] for g in _group_lengths(SimConfig(out_len_median=512, out_len_sigma=0.79,
                                                                          draws_by_prompt=True), 300)]
    plain_total = statistics.pvariance([x for g in plain for x in g])
    assert 1 - statistics.fmean(statistics.variance(g) for g in plain) / plain_total == pytest.approx(0, abs=0.1)


def test_draws_are_deterministic_under_a_seed():
    assert _group_lengths(_TAIL, 50) == _group_lengths(_TAIL, 50)
    other = _group_lengths(SimConfig(**{**_TAIL.__dict__, "seed": 1}), 50)
    assert other != _group_lengths(_TAIL, 50)
    key = prompt_key([10, 7, 0])
    assert prompt_difficulty(0, key, 0.65) == prompt_difficulty(0, key, 0.65) != prompt_difficulty(1, key, 0.65)
    assert prompt_difficulty(0, key, 0.0) == 1.0


def test_no_difficulty_keeps_the_earlier_draws():
    cfg = SimConfig(out_len_median=64, out_len_sigma=0.3, draws_by_prompt=True, seed=4)
    prompt = [9, 8, 7]
    rng = prompt_rng(4, prompt_key(prompt), 2)
    assert SimBackend(cfg).draw(prompt, 10**6, occurrence=2).n == max(1, round(rng.lognormvariate(math.log(64), 0.3)))


def test_config_names_the_bad_field():
    for bad, field in (({"difficulty_sigma": -0.1}, "difficulty_sigma"), ({"kv_token_budget": 0}, "kv_token_budget"),
                       ({"scheduling_policy": "lifo"}, "scheduling_policy")):
        with pytest.raises(InvalidRequestError, match=field):
            SimConfig(**bad)


# -- priority admission ---------------------------------------------------------------------------
@pytest.mark.parametrize(("policy", "order"), [("priority", ["A", "C", "D", "B"]), ("fcfs", ["A", "B", "C", "D"])])
async def test_a_full_server_admits_the_lowest_priority_value_first(policy, order, autojump_clock):
    # one slot, 10 tokens at 1 s each: A runs 0-10 s; B (5), C (1), D (1) arrive in that order while it does
    backend = SimBackend(SimConfig(vocab_size=50, per_token_s=1.0, out_len_median=10, max_running_seqs=1,
                                   scheduling_policy=policy))
    done: list[tuple[str, float]] = []

    async def one(name, priority):
        await backend.generate(_req(priority=priority), 1000)
        done.append((name, trio.current_time()))

    async with backend.open(), trio.open_nursery() as nursery:
        for name, priority in (("A", 9), ("B", 5), ("C", 1), ("D", 1)):
            nursery.start_soon(one, name, priority)
            await trio.testing.wait_all_tasks_blocked()  # arrival order A, B, C, D
    assert [name for name, _ in done] == order
    assert [t for _, t in done] == [10.0, 20.0, 30.0, 40.0]


# -- the KV budget ------------------------------------------------------------------------------------
def _run_model(model: ServerModel, seqs: list[tuple[str, int, float, int]]) -> dict[str, float]:
    """Submit (name, prompt tokens, decode steps, priority) at t = 0 in order; run to the end."""
    ends: dict[str, float] = {}
    for name, prompt, steps, priority in seqs:
        model.submit(0.0, 0.0, steps, lambda end, _s, name=name: ends.__setitem__(name, end), prompt_tokens=prompt,
                     priority=priority)
    while (t := model.next_event_time()) < math.inf:
        model.advance(t)
    return ends


@pytest.mark.parametrize(("priorities", "victim"), [((0, 0), "B"), ((5, 0), "A")])
def test_past_the_kv_budget_the_lowest_priority_latest_sequence_is_preempted(priorities, victim):
    # budget 100 (watermark 1): two 10-token prompts, 60 tokens each, 1 s per step.  KV = 20 + 2t
    # reaches 100 at t = 40: the victim leaves with 40 tokens (its KV now 50: it does not fit back
    # beside the other's 50 + the watermark), the other ends alone at 60, the victim re-prefills
    # 40 tokens x 0.05 s = 2 s and decodes its last 20: ends at 82.
    model = ServerModel(per_token_s=1.0, kv_token_budget=100, recompute_s_per_token=0.05)
    ends = _run_model(model, [("A", 10, 60, priorities[0]), ("B", 10, 60, priorities[1])])
    other = "A" if victim == "B" else "B"
    assert ends == {other: pytest.approx(60.0), victim: pytest.approx(82.0)}
    assert model.preemptions == 1
    assert model.peak_kv_tokens == pytest.approx(100.0)
    assert model.busy_slot_s == pytest.approx(60 + 40 + 22)
    assert model.kv_tokens() == 0 and model.occupied == 0
    # unbounded KV: both end together
    assert _run_model(ServerModel(per_token_s=1.0), [("A", 10, 60, 0), ("B", 10, 60, 0)]) == {"A": 60.0, "B": 60.0}


def test_a_prompt_that_does_not_fit_waits_and_one_that_never_fits_is_refused():
    model = ServerModel(per_token_s=1.0, kv_token_budget=100)
    # A holds 60 + its growth; B's 50-token prompt fits only once A is gone (60 + 50 + 1 > 100)
    assert _run_model(model, [("A", 60, 10, 0), ("B", 50, 10, 0)]) == {"A": 10.0, "B": 20.0}
    with pytest.raises(ValueError, match="KV budget"):
        model.submit(0.0, 0.0, 1, lambda *_: None, prompt_tokens=100)


async def test_the_backend_refuses_a_prompt_beyond_the_kv_budget(reward_pool, autojump_clock):
    backend = SimBackend(SimConfig(vocab_size=50, per_token_s=0.1, kv_token_budget=50))
    async with open_rollout_engine(backend, reward_pool=reward_pool) as engine:
        with pytest.raises(InvalidRequestError, match="KV budget"):
            await engine.agenerate(_req(prompt=[5] * 60))


# -- abort_request and lost work -------------------------------------------------------------------------
async def test_abort_request_returns_the_partial_tokens_and_the_engine_resumes_the_same_draw(
        reward_pool, autojump_clock):
    # 3-token prompt (0.3 s prefill), 20 tokens at 1 s: aborted at 5.3 s with 5 tokens; the resumed
    # segment re-prefills 8 tokens (0.8 s) and decodes the other 15: ends at 21.1 s
    cfg = SimConfig(vocab_size=50, per_token_s=1.0, prefill_s_per_token=0.1, out_len_median=20, seed=3,
                    max_running_seqs=4)
    reference = SimBackend(cfg)
    async with reference.open():
        want = await reference.generate(_req(), 1000)
    backend = SimBackend(cfg)
    got = {}
    async with open_rollout_engine(backend, reward_pool=reward_pool) as engine:
        async def generate():
            got["resp"] = await engine.agenerate(_req(rid="r1"))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(generate)
            await trio.sleep(5.3)
            engine.set_version(1)  # e.g. a weight update between the segments
            assert backend.abort_request("r1")
            assert not backend.abort_request("r1") and not backend.abort_request("unknown")
        stats = engine.statistics()
    resp = got["resp"]
    assert resp.output_tokens == want.output_tokens and resp.stop_reason == want.stop_reason == "stop"
    assert resp.output_versions == [0] * 5 + [1] * 15
    assert resp.latency == pytest.approx(21.1)
    assert stats.segments_resumed == 1 and stats.backend.requests_aborted == 1
    assert stats.backend.tokens_discarded == 0
    assert not backend.abort_request("r1")  # finished


async def test_a_withdrawn_request_counts_the_tokens_it_had_decoded_as_discarded(autojump_clock):
    backend = SimBackend(SimConfig(vocab_size=50, per_token_s=1.0, prefill_s_per_token=0.1, out_len_median=20,
                                   max_running_seqs=4))
    async with backend.open():
        with trio.move_on_after(7.3):  # 0.3 s prefill + 7 tokens
            await backend.generate(_req(), 1000)
        stats = backend.statistics()
    assert stats.tokens_discarded == 7 and stats.tokens_generated == 0
    assert stats.sequences_running == 0
    assert stats.busy_slot_s == pytest.approx(7.3)


# -- segments: a generation sent in chunks is the same generation ------------------------------------------
@pytest.mark.parametrize("chunks", [[7], [7, 7], [5, 30], [20]])
async def test_a_generation_sent_in_chunks_continues_its_draw(chunks, autojump_clock):
    """The engine's chunked segments (``overprovision_chunk_tokens``, the ``length_aware`` probe) re-send
    prompt + output so far under the same rid with a budget per chunk: the sim continues the first
    segment's draw (length, tokens, the EOS) instead of drawing a new length per chunk."""
    cfg = SimConfig(vocab_size=50, per_token_s=0.1, out_len_median=20, out_len_sigma=0.5, seed=5, max_running_seqs=4)
    reference = SimBackend(cfg)
    async with reference.open():
        want = await reference.generate(_req(rid="r"), 1000)
    assert 7 < want.output_len < 1000 and want.stop_reason == "stop"
    backend = SimBackend(cfg)
    tokens: list[int] = []
    stops = []
    async with backend.open():
        for budget in [*chunks, 1000]:
            resp = await backend.generate(_req(prompt=[5, 6, 7, *tokens], rid="r"), budget)
            tokens += resp.output_tokens
            stops.append(resp.stop_reason)
            if resp.stop_reason == "stop":
                break
    assert tokens == want.output_tokens
    assert stops[-1] == "stop" and set(stops[:-1]) <= {"length"}


async def test_a_chunk_ending_exactly_at_the_draw_ends_the_generation_next(autojump_clock):
    cfg = SimConfig(vocab_size=50, per_token_s=0.1, out_len_median=20, out_len_sigma=0.0, max_running_seqs=4)
    backend = SimBackend(cfg)
    async with backend.open():
        first = await backend.generate(_req(rid="r"), 20)  # the draw is exactly 20 tokens: cut at the budget
        rest = await backend.generate(_req(prompt=[5, 6, 7, *first.output_tokens], rid="r"), 980)
    assert first.output_len == 20 and first.stop_reason == "length"
    assert rest.output_len == 0 and rest.stop_reason == "stop"

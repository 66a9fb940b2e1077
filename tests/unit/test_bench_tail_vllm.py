"""Unit tier: the tail scenario on vLLM (``benchmarks/bench_tail_vllm.py``, issue 27) against
a fake vLLM behind ``httpx.MockTransport``, in virtual time: the length forcing (every
request carries the sim draw's length with ``ignore_eos``; the engine sees the same budgets
as on the sim), the run's accounting, the server's counters, the calibration fit, and the
ranking comparison.  The real server: ``tests/contract/test_bench_tail_vllm.py``."""

from __future__ import annotations

import collections
import json
import time
from dataclasses import replace

import pytest
import trio

from benchmarks import bench_tail_vllm
from benchmarks.harness.cpu_share import CpuShare
from benchmarks.harness.tail_config import TAIL_SIM, TailConfig
from benchmarks.harness.tail_metrics import summarize
from benchmarks.harness.tail_vllm import Calibration, calibrate, fit_sim, observe_vllm, policy_settings, scaled_config
from benchmarks.harness.tail_vllm_backend import (ForcedLengthVLLM, MetricsSample, ServerMetrics, Withdrawn,
                                                  forced_draw, parse_metrics)
from benchmarks.harness.tail_vllm_report import compare, kendall_tau, ranking
from engine import BackendError, GenerationHyperparameters, InvalidRequestError, ModelRequest, open_rollout_engine
from engine.backends.sim import SimBackend
from engine.serve import HTTPResponse
from engine.testing import InProcessRewardPool
from engine._schedule_base import PROBE_PRIORITY, estimate_priority
from engine.types import derive_seed
from fake_servers import FakeVLLM, mock_transport

URL = "http://vllm:8000"

#: 2 groups of 4 per step, heavy-tailed group-correlated lengths around 16 tokens, cap 64
CFG = TailConfig(steps=3, cooldown_steps=2, groups_per_step=2, group_size=4, train_step_s=0.5, max_new_tokens=64,
                 prompt_len_min=4, prompt_len_max=12,
                 sim=replace(TAIL_SIM, out_len_median=16, vocab_size=256, max_running_seqs=8, kv_token_budget=None))
#: a tenth of the prompts' draws run past the cap
CAPPED = replace(CFG, max_new_tokens=24)


class MeteredVLLM(FakeVLLM):
    """:class:`FakeVLLM` that decodes at ``per_token_s`` (a request answers after its
    ``max_tokens`` steps) and serves ``GET /metrics``: the requests running, and the tokens
    decoded, those of requests cancelled by their client included (at ``per_token_s``)."""

    def __init__(self, per_token_s: float = 0.01, **kwargs):
        super().__init__(length=10**6, **kwargs)
        self.per_token_s = per_token_s
        self.decoded = 0

    async def handle(self, request):
        if request.path == "/metrics":
            text = (f'vllm:num_requests_running{{engine="0",model_name="tiny"}} {len(self.running)}.0\n'
                    'vllm:num_requests_waiting{engine="0",model_name="tiny"} 0.0\n'
                    f'vllm:generation_tokens_total{{engine="0",model_name="tiny"}} {self.decoded}.0\n')
            return HTTPResponse(200, text.encode(), "text/plain")
        if request.path != "/v1/completions":
            return await super().handle(request)
        body = request.json()
        self.delay_s = body["max_tokens"] * self.per_token_s  # read by _run before its first checkpoint
        start = trio.current_time()
        try:
            resp = await super().handle(request)
        except trio.Cancelled:  # the client went away: what was decoded so far stays decoded
            self.decoded += min(body["max_tokens"], int((trio.current_time() - start) / self.per_token_s))
            raise
        self.decoded += len(json.loads(resp.body)["choices"][0]["token_ids"])
        return resp


def _draws(cfg):
    """``(prompt, sample) -> SimDraw`` of the window's and cool-down's samples."""
    return {(i, j): forced_draw(cfg.sim, cfg.prompt(i), derive_seed(cfg.sim.seed, i, j, 0), cfg.max_new_tokens)
            for i in range(cfg.prompts) for j in range(cfg.group_size)}


def _rid(body):
    return body["request_id"].rpartition("@")[0]


def test_the_forced_draw_is_the_sims_own():
    sim = SimBackend(CFG.sim)
    for i in range(6):
        prompt = CFG.prompt(i)
        for j in range(4):
            seed = derive_seed(CFG.sim.seed, i, j, 0)
            assert forced_draw(CFG.sim, prompt, seed, 64) == sim.draw(prompt, 64, gconfig_seed=seed)


@pytest.mark.parametrize("policy", ["sync", "fcfs", "overprovision", "length_aware", "tail_batching"])
async def test_every_request_carries_the_sim_draws_length_with_ignore_eos(policy, autojump_clock):
    fake = MeteredVLLM(scheduling_policy="priority")
    settings = {"overprovision": {"overprovision_chunk_tokens": 8}, "length_aware": {"length_aware_probe_tokens": 8},
                "tail_batching": {}}.get(policy)
    obs = await observe_vllm(CFG, policy, URL, settings, transport=mock_transport({URL: fake}))
    draws = _draws(CFG)
    bodies = fake.generate_calls
    assert bodies and all(b["ignore_eos"] is True and b["min_tokens"] == b["max_tokens"] for b in bodies)
    # the engine sends each sample the cap; the backend asks the server for what its draw has left,
    # segment after segment (a resumed one's prompt is the prompt + the tokens so far)
    by_rid = collections.defaultdict(list)
    for b in bodies:
        by_rid[_rid(b)].append(b)
    completed = 0
    for calls in by_rid.values():
        first = calls[0]
        d = forced_draw(CFG.sim, first["prompt"], first["seed"], CFG.max_new_tokens)
        done = 0
        for b in calls:
            assert len(b["prompt"]) == len(first["prompt"]) + done and b["max_tokens"] <= d.n - done
            done += b["max_tokens"]  # (the fake answers every token it is asked; a cancelled call's count
        completed += done == d.n     # is not known to the client, so this bounds what it was asked)
    # every trained row has exactly its sample's drawn length
    trained = {(p, j): n for batch in obs.batches for p, j, n, _ in batch.rows}
    assert trained and all(n == draws[key].n for key, n in trained.items())
    assert completed >= len(trained)
    assert len(by_rid) >= CFG.steps * CFG.groups_per_step * CFG.group_size
    if policy == "length_aware":  # the probes ask for the probe budget at most, then the rest
        assert any(b["max_tokens"] <= 8 and b.get("priority") is not None for b in bodies)
    if policy == "overprovision":
        assert max(b["max_tokens"] for b in bodies) <= 8
    e = obs.engine
    assert e["accepted"] + e["rejected"] + e["failed"] + e["queued"] + e["running"] == e["submitted"]
    server = e["server"]
    assert obs.decoded_tokens == server["returned_tokens"] + server["unreturned_tokens"]  # the server's own counter
    assert server["unreturned_tokens"] >= 0 and server["unreturned_attributed"] <= server["unreturned_tokens"]
    assert server["client_in_flight_mean"] >= server["running_mean"] > 0  # what the client sent includes what runs
    record = summarize(CFG, obs)
    assert record["length_bias_ks"] is not None and 0 <= record["thrown_away_token_fraction"] < 1
    assert 0 < record["slot_occupancy"] <= 1


async def test_a_draw_that_ends_before_the_cap_stops_and_one_cut_at_the_cap_stays_length(autojump_clock):
    fake = MeteredVLLM()
    backend = ForcedLengthVLLM([URL], sim=CAPPED.sim, transport=mock_transport({URL: fake}))
    gconfig = GenerationHyperparameters(max_new_tokens=CAPPED.max_new_tokens, max_tokens=200)
    seen = collections.Counter()
    async with open_rollout_engine(backend, reward_pool=InProcessRewardPool()) as engine:
        for i in range(12):
            for j in range(4):
                d = forced_draw(CAPPED.sim, CAPPED.prompt(i), derive_seed(0, i, j, 0), CAPPED.max_new_tokens)
                resp = await engine.agenerate(ModelRequest(input_ids=CAPPED.prompt(i),
                                                           gconfig=gconfig.new(seed=derive_seed(0, i, j, 0))))
                assert resp.output_len == d.n
                assert resp.stop_reason == ("stop" if d.finished else "length")
                seen[resp.stop_reason] += 1
    assert seen["stop"] and seen["length"]  # both cases ran
    assert [b["max_tokens"] for b in fake.generate_calls] == [s[1] for s in backend.forced_segments]


async def test_a_server_that_does_not_force_the_length_is_an_error_and_a_request_needs_a_seed(autojump_clock):
    fake = FakeVLLM(length=3)  # ignores ignore_eos: 3 tokens, whatever it is asked
    backend = ForcedLengthVLLM([URL], sim=CFG.sim, transport=mock_transport({URL: fake}))
    async with open_rollout_engine(backend, reward_pool=InProcessRewardPool()) as engine:
        g = GenerationHyperparameters(max_new_tokens=64, seed=derive_seed(0, 0, 0, 0))
        with pytest.raises(BackendError, match="answered 3 tokens for a forced"):
            await engine.agenerate(ModelRequest(input_ids=CFG.prompt(0), gconfig=g))
        with pytest.raises(InvalidRequestError, match="needs gconfig.seed"):
            await engine.agenerate(ModelRequest(input_ids=CFG.prompt(0), gconfig=g.new(seed=None)))


async def test_length_aware_estimates_an_unfinished_probe_as_the_cap_not_as_its_draw(autojump_clock):
    """The engine is given the sim run's budget (the cap), so a group whose probe runs past
    the probe budget is estimated as the cap, as on the sim; a draw-sized budget would hand
    ``length_aware`` each group's exact length."""
    fake = MeteredVLLM(scheduling_policy="priority")
    await observe_vllm(CFG, "length_aware", URL, {"length_aware_probe_tokens": 8}, transport=mock_transport({URL: fake}))
    by_prompt = collections.defaultdict(list)
    for b in fake.generate_calls:
        by_prompt[tuple(b["prompt"][:4])].append(b)
    unfinished = 0
    for calls in by_prompt.values():
        probe = next((b for b in calls if b.get("priority") == PROBE_PRIORITY), None)
        if probe is None:
            continue
        d = forced_draw(CFG.sim, probe["prompt"], probe["seed"], CFG.max_new_tokens)
        later = {b.get("priority", 0) for b in calls if b is not probe}
        if d.n > 8:  # the probe ran past its budget: the group is taken to be as long as allowed
            unfinished += 1
            assert later <= {estimate_priority(CFG.max_new_tokens), 0}
        else:
            assert later <= {estimate_priority(d.n), 0}
    assert unfinished


def test_parse_metrics_and_the_busy_slot_seconds():
    text = ('# HELP vllm:num_requests_running x\nvllm:num_requests_running{engine="0",model_name="tiny"} 3.0\n'
            'vllm:num_requests_waiting{engine="0",model_name="tiny"} 2.0\n'
            'vllm:num_requests_waiting_by_reason{engine="0",reason="capacity"} 9.0\n'
            'vllm:generation_tokens_total{engine="0",model_name="tiny"} 1234.0\n'
            'vllm:generation_tokens_created{engine="0",model_name="tiny"} 1.7e+09\n')
    assert parse_metrics(text) == {"running": 3.0, "waiting": 2.0, "generation_tokens": 1234.0, "prompt_tokens": 0.0,
                                   "preemptions": 0.0}
    m = ServerMetrics(URL)
    m.samples = [MetricsSample(t, r, 0, 0, 0, 0) for t, r in ((0.0, 4), (1.0, 2), (3.0, 0))]
    assert m.busy_slot_s(0.0, 4.0) == pytest.approx(4 * 1 + 2 * 2)
    assert m.busy_slot_s(0.5, 2.0) == pytest.approx(4 * 0.5 + 2 * 1)
    assert m.mean("running", 0.0, 1.0) == 3.0
    with pytest.raises(ValueError, match="interval_s"):
        ServerMetrics(URL, interval_s=0)


def test_unreturned_tokens_are_split_by_time_capped_by_budget():
    backend = ForcedLengthVLLM([URL], sim=CFG.sim)
    backend.returned_tokens, backend.answered_s = 100, 10.0  # 10 tokens/s per segment
    backend.withdrawn = [Withdrawn(1, 50, 2.0, False), Withdrawn(2, 5, 2.0, True), Withdrawn(None, 50, 1.0, True)]
    # weights: min(50, 20) = 20, min(5, 20) = 5, min(50, 10) = 10 -> 35
    assert backend.attribute_unreturned(35) == {1: 20, 2: 5}
    assert backend.attribute_unreturned(0) == {}


def test_fit_sim_by_hand_and_the_scaled_scenario():
    cal = Calibration(step_s={1: 0.003, 16: 0.0045, 64: 0.0108, 128: 0.03}, tokens_per_s={}, request_s=0.01,
                      tokens=128, repeats=1, load_avg=(0.0, 0.0), samples={})
    sim = fit_sim(cal, max_running_seqs=64, base=TAIL_SIM)
    a, b = 0.003, (0.0108 - 0.003) / 63  # the line through the lone sequence and the full server (k = 64)
    assert sim.per_token_s == a and sim.decode_slowdown_per_seq == pytest.approx(b / a, abs=1e-6)
    assert fit_sim(cal, max_running_seqs=32, base=TAIL_SIM).decode_slowdown_per_seq == pytest.approx(0.5 / 15, abs=1e-6)
    assert sim.max_running_seqs == 64 and sim.kv_token_budget is None and sim.prefill_s == pytest.approx(0.01 - a, abs=1e-6)
    cfg = scaled_config(sim, out_len_median=64)
    assert cfg.max_new_tokens == 384 and (cfg.prompt_len_min, cfg.prompt_len_max) == (16, 64)
    assert cfg.sim.out_len_sigma == TAIL_SIM.out_len_sigma and cfg.sim.difficulty_sigma == TAIL_SIM.difficulty_sigma
    step64 = a * (1 + b / a * 63)
    mean_len = 64 * 2.718281828 ** ((0.65 ** 2 + 0.45 ** 2) / 2)
    assert cfg.train_step_s == pytest.approx(0.54 * 64 * mean_len * step64 / 64, rel=1e-3)
    assert max(max(cfg.prompt(i)) for i in range(20)) < 256  # the tiny model's byte ids
    assert policy_settings(cfg)["length_aware"] == {"length_aware_probe_tokens": 32}
    with pytest.raises(ValueError, match="at 1 and at 2 to 64"):
        fit_sim(replace(cal, step_s={1: 0.003}), max_running_seqs=64, base=TAIL_SIM)


def test_fit_sim_keeps_the_front_end_apart():
    cal = Calibration(step_s={1: 0.003, 64: 0.015}, tokens_per_s={}, request_s=0.02, tokens=64, repeats=2,
                      load_avg=(0.0, 0.0), samples={}, request_serial_s=0.01, prefill_s_per_token=1e-4)
    sim = fit_sim(cal, max_running_seqs=64, base=TAIL_SIM)
    assert sim.frontend_s_per_request == 0.01 and sim.prefill_s_per_token == 1e-4
    assert sim.decode_slowdown_per_seq == pytest.approx((0.015 / 0.003 - 1) / 63, abs=1e-6)
    assert sim.prefill_s == pytest.approx(0.02 - 0.003 - 0.01 - 32 * 1e-4, abs=1e-6)  # lone: step + front end + prompt


async def test_calibration_measures_the_steady_state_decode_rate(autojump_clock):
    # the fake decodes every request at 10 ms a token whatever runs beside it: 10 ms a step at
    # every concurrency, k requests running while k clients keep one in flight
    fake = MeteredVLLM(per_token_s=0.01)
    cal = await calibrate(URL, seqs=(1, 8), tokens=8, repeats=2, warmup_s=0.5, window_s=2.0,
                          transport=mock_transport({URL: fake}))
    assert cal.step_s[1] == pytest.approx(0.01, rel=0.05) and cal.step_s[8] == pytest.approx(0.01, rel=0.05)
    assert cal.tokens_per_s[8] == pytest.approx(800, rel=0.05)
    assert cal.running_mean == {1: pytest.approx(1, abs=0.2), 8: pytest.approx(8, abs=1)}
    assert not fake.running  # every client left, nothing is decoding



def test_rankings_and_their_agreement():
    assert kendall_tau(["a", "b", "c"], ["a", "b", "c"]) == 1.0
    assert kendall_tau(["a", "b", "c"], ["c", "b", "a"]) == -1.0
    assert kendall_tau(["a", "b", "c"], ["b", "a", "c"]) == pytest.approx(1 / 3, abs=1e-4)
    vllm = [{"policy": "sync", "steps_per_hour": 10.0, "spread": {"steps_per_hour": [9, 11]}},
            {"policy": "fcfs", "steps_per_hour": 30.0, "spread": {"steps_per_hour": [28, 33]}},
            {"policy": "length_aware", "steps_per_hour": 31.0, "spread": {"steps_per_hour": [29, 32]}}]
    sim = [{"policy": "sync", "steps_per_hour": 12.0}, {"policy": "fcfs", "steps_per_hour": 35.0},
           {"policy": "length_aware", "steps_per_hour": 33.0}, {"policy": "tail_batching", "skipped": "no"}]
    assert ranking(vllm) == ["length_aware", "fcfs", "sync"]
    c = compare(vllm, sim, ["sync", "fcfs", "length_aware"], reference=["fcfs", "length_aware", "sync"])
    assert c["ranking"]["sim"] == ["fcfs", "length_aware", "sync"] and not c["same_order"]
    assert c["disagreements"] == [{"pair": ["fcfs", "length_aware"], "vllm_order": ["length_aware", "fcfs"],
                                   "within_noise": True}]
    assert c["agree_beyond_noise"] and c["kendall_tau_vs_reference"] == {"vllm": pytest.approx(1 / 3, abs=1e-4),
                                                                          "sim": 1.0}
    assert c["steps_per_hour_vs_sync"]["vllm"]["fcfs"] == 3.0


@pytest.mark.parametrize("argv, message", [
    (["--seeds", "x"], "--seeds must be comma-separated integers"),
    (["--policies", "nope"], "unknown policy"),
    (["--out-len-median", "0"], "--out-len-median must be >= 1, got 0"),
    # a new-user trial: these started a vLLM server (a minute each) or named another field
    (["--train-step-s", "-1"], "--train-step-s must be a finite number of seconds > 0, got -1.0"),
    (["--train-step-s", "nan"], "--train-step-s must be a finite number of seconds > 0, got nan"),
    (["--calibration-repeats", "0"], "--calibration-repeats must be >= 1, got 0"),
    (["--calibration-tokens", "0"], "--calibration-tokens must be >= 1, got 0"),
    (["--policy-settings", '{"fcfs": {"no_such_field": 1}}'], "--policy-settings fcfs: no_such_field"),
    (["--policy-settings", '{"overprovision": {"overprovision_ratio": -1}}'], "--policy-settings overprovision: "),
    (["--group-size", "0"], "--group-size must be >= 1, got 0"),
    (["--groups-per-step", "0"], "--groups-per-step must be >= 1, got 0"),
    (["--cap-ratio", "0"], "--cap-ratio must be a finite number > 0 with --cap-ratio x --out-len-median >= 1"),
    (["--cap-ratio", "nan"], "--cap-ratio must be a finite number > 0"),
    (["--max-head-offpolicyness", "-1"], "--max-head-offpolicyness must be >= 0, got -1"),
    (["--cooldown-steps", "-1"], "--cooldown-steps must be >= 0, got -1"),
    (["--tools", "/nonexistent"], "--tools /nonexistent has no serve_vllm_cpu.sh"),
])
def test_bad_options_are_one_line_before_any_server_starts(argv, message, capsys, tmp_path, monkeypatch):
    monkeypatch.setattr(bench_tail_vllm.Server, "__enter__", lambda self: pytest.fail("a server was started"))
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "vllm").write_text("")  # the venv check passes: every option is checked before a server
    assert bench_tail_vllm.main([*argv, "--run-dir", str(tmp_path), "--venv", str(venv)]) == 2  # usage: as rollout bench
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("bench_tail_vllm: error:") and message in err


def test_the_cpu_share_of_others_is_what_the_benchmark_did_not_use():
    meter = CpuShare()
    meter.start()
    deadline = time.process_time() + 0.3
    while time.process_time() < deadline:  # this process's own CPU time: 0.3 s
        pass
    share = meter.stop()
    assert 0 < share["cpu_own_share"] <= share["cpu_busy_share"] <= 1
    assert share["cpu_others_share"] == pytest.approx(share["cpu_busy_share"] - share["cpu_own_share"], abs=0.002)

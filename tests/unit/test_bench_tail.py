"""Unit tier: ``rollout bench --scenario tail`` (issue 27): its metrics on hand-checkable
scenarios, the fit of the tail model, determinism, the policy table and the JSON.  Every
run is in virtual time (``trio.testing.MockClock``), a second or less of CPU."""

from __future__ import annotations

import json
import math
import random
from dataclasses import replace

import pytest

from benchmarks.harness import tail_config, tail_run
from benchmarks.harness.tail_bounds import staleness_latency_bound
from benchmarks.harness.tail_cli import aggregate, server_bound_steps_per_hour, summary
from benchmarks.harness.tail_config import TAIL_SIM, TailConfig, expected_sync_tail_share
from benchmarks.harness.tail_metrics import ks_distance, summarize, tail_share
from benchmarks.harness.tail_run import PolicyUnavailable, engine_config_for, run_policy

#: 2 groups x 4 samples of exactly 16 tokens per step, 0.1 s per token, no prefill, 1 s of training
_FLAT = TailConfig(steps=3, cooldown_steps=2, groups_per_step=2, group_size=4, train_step_s=1.0, max_new_tokens=64,
                   prompt_len_min=8, prompt_len_max=16,
                   sim=replace(TAIL_SIM, out_len_median=16, out_len_sigma=0.0, difficulty_sigma=0.0, per_token_s=0.1,
                               decode_slowdown_per_seq=0.0, prefill_s=0.0, prefill_s_per_token=0.0))
#: the same with heavy-tailed, group-correlated lengths
_TAILED = replace(_FLAT, max_new_tokens=256, sim=replace(_FLAT.sim, out_len_median=32, out_len_sigma=0.45,
                                                          difficulty_sigma=0.65))


def test_ks_distance():
    assert ks_distance([1, 2, 3], [3, 1, 2]) == 0.0
    assert ks_distance([1, 2], [3, 4]) == 1.0
    assert ks_distance([1, 2, 3, 4], [1, 2]) == 0.5  # at x = 2: F = 0.5 vs 1
    rng = random.Random(0)
    a, b = [rng.randint(0, 50) for _ in range(200)], [rng.randint(10, 60) for _ in range(150)]
    brute = max(abs(sum(v <= x for v in a) / len(a) - sum(v <= x for v in b) / len(b)) for x in range(-1, 62))
    assert ks_distance(a, b) == pytest.approx(brute)
    with pytest.raises(ValueError):
        ks_distance([], [1])


def test_tail_share_is_the_time_the_last_tenth_takes():
    assert tail_share([(0.0, 1.0)] * 9 + [(0.0, 10.0)]) == pytest.approx(0.9)  # 9 end at 1 s, the last at 10 s
    assert tail_share([(2.0, 4.0)] * 10) == 0.0
    assert tail_share([]) is None


def test_sync_on_flat_lengths_by_hand():
    r = summarize(_FLAT, run_policy(_FLAT, "sync"))
    # a step: 8 sequences decode 16 tokens at 0.1 s (1.6 s), then 1 s of training: 2.6 s
    assert r["steps_per_hour"] == pytest.approx(3600 / 2.6, abs=1e-3)
    assert r["trainer_idle_fraction"] == pytest.approx(1.6 / 2.6, abs=1e-4)  # (rounded to 4 digits)
    assert r["slot_occupancy"] == pytest.approx(8 * 1.6 / (128 * 2.6), abs=1e-4)
    assert r["tail_share"] == 0.0
    assert r["thrown_away_token_fraction"] == 0.0 and r["length_bias_ks"] == 0.0
    # token, row and prompt counts are over the window's 3 x 2 prompts (the cool-down's 2 x 2 only keep it full)
    assert r["staleness_histogram"] == {"0": 24} and r["staleness_max"] == 0
    assert r["prompts_trained_fraction"] == 1.0 and r["trained_tokens"] == r["decoded_tokens"] == 24 * 16
    assert r["decoded_tokens_run"] == 40 * 16 and r["window_prompts"] == 6 and r["window_prompts_undecided"] == 0


#: chunks and probes shorter than most responses of _TAILED (median 32 tokens)
_SHORT_SEGMENTS = {"overprovision": {"overprovision_chunk_tokens": 8}, "length_aware": {"length_aware_probe_tokens": 8}}


@pytest.mark.parametrize("policy", ["sync", "fcfs", "overprovision", "length_aware"])
def test_nothing_dropped_means_no_bias_and_nothing_thrown_away(policy):
    """Also for the policies that send a generation in segments (the overprovision chunks, the
    length_aware probe): the population is one drawn length per sample, not per segment."""
    cfg = replace(_TAILED, max_head_offpolicyness=50)  # a bound nothing reaches: nothing is stale
    r = summarize(cfg, run_policy(cfg, policy, _SHORT_SEGMENTS.get(policy)))
    assert r["segments_resumed"] > 0 or policy in ("sync", "fcfs")
    assert r["rejected"] == 0 and r["rows_trained"] == r["requests_started"] == r["window_prompts"] * cfg.group_size
    assert r["thrown_away_token_fraction"] == 0.0
    assert r["length_bias_ks"] == 0.0
    assert r["prompts_trained_fraction"] == 1.0


def test_chunked_policies_train_the_lengths_the_unchunked_ones_do():
    cfg = replace(_TAILED, max_head_offpolicyness=50)
    lengths = {p: sorted(row[2] for b in run_policy(cfg, p, _SHORT_SEGMENTS.get(p)).batches for row in b.rows)
               for p in ("fcfs", "overprovision", "length_aware", "tail_batching")}
    assert lengths["overprovision"] == lengths["length_aware"] == lengths["tail_batching"] == lengths["fcfs"]


def test_a_tight_staleness_bound_throws_long_groups_away_and_the_metrics_say_so():
    cfg = replace(_TAILED, max_head_offpolicyness=1, steps=6)  # a group slower than two steps is stale
    r = summarize(cfg, run_policy(cfg, "fcfs"))
    assert r["rejected_by_reason"].get("stale", 0) == r["rejected"] > 0
    assert 0 < r["thrown_away_token_fraction"] < 1
    assert r["trained_tokens"] < r["decoded_tokens"]
    assert r["prompts_trained_fraction"] == pytest.approx(1 - r["groups_rejected_in_window"] / r["window_prompts"], abs=1e-4)
    assert r["length_bias_ks"] > 0 and r["mean_len_trained"] < r["mean_len_generated"]  # the long ones go


def test_runs_are_deterministic():
    a = summarize(_TAILED, run_policy(_TAILED, "fcfs"))
    b = summarize(_TAILED, run_policy(_TAILED, "fcfs"))
    assert a == b
    c = summarize(replace(_TAILED, sim=replace(_TAILED.sim, seed=1)), run_policy(
        replace(_TAILED, sim=replace(_TAILED.sim, seed=1)), "fcfs"))
    assert c["decoded_tokens"] != a["decoded_tokens"]


_DIGEST = """
import hashlib, sys
from dataclasses import replace
from benchmarks.harness.tail_config import TAIL_SIM, TailConfig
from benchmarks.harness.tail_run import run_policy
cfg = TailConfig(steps=4, cooldown_steps=2, groups_per_step=4, group_size=4, max_new_tokens=256,
                 prompt_len_min=8, prompt_len_max=16, sim=replace(TAIL_SIM, out_len_median=32, max_running_seqs=8))
obs = run_policy(cfg, "length_aware", {"length_aware_probe_tokens": 8})
print(hashlib.sha256(repr((obs.window_s, sorted(obs.times.items()))).encode()).hexdigest())
"""


@pytest.mark.slow
def test_runs_are_repeatable_across_processes():
    """A probe's siblings wait on one trio.Event, which wakes its waiters in the order of a set of
    tasks (by address: a new order in each process); the run must not depend on it."""
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "PYTHONPATH": root}
    digests = {subprocess.run([sys.executable, "-c", _DIGEST], env=env, capture_output=True, text=True, check=True,
                              timeout=120).stdout for _ in range(2)}
    assert len(digests) == 1


def test_the_fitted_model_gives_seers_tail_share():
    """Seer (arXiv 2511.14617): the last 10% of requests take up to ~50% of a synchronous step."""
    cfg = TailConfig()
    assert expected_sync_tail_share(cfg.sim, groups=cfg.groups_per_step, group_size=cfg.group_size,
                                    max_new_tokens=cfg.max_new_tokens, trials=300) == pytest.approx(0.49, abs=0.03)
    measured = replace(cfg, steps=10, cooldown_steps=0)
    assert 0.40 <= summarize(measured, run_policy(measured, "sync"))["tail_share"] <= 0.58


def test_policy_rows(monkeypatch):
    assert engine_config_for(_FLAT, "sync").consumer_batch_size == _FLAT.groups_per_step
    fcfs = engine_config_for(_FLAT, "fcfs")  # today's engine: fcfs is the behaviour without a setting
    assert fcfs.max_head_offpolicyness == _FLAT.max_head_offpolicyness
    assert getattr(fcfs, "scheduling", "fcfs") == "fcfs"
    monkeypatch.setitem(tail_config.POLICIES, "future", {"no_such_setting": 1})
    monkeypatch.setattr(tail_run, "POLICIES", tail_config.POLICIES)
    with pytest.raises(PolicyUnavailable, match="no_such_setting"):
        engine_config_for(_FLAT, "future")


def test_summary_picks_the_best_policy_within_the_ks_bound():
    rows = [{"policy": "sync", "steps_per_hour": 10.0, "length_bias_ks": 0.0, "thrown_away_token_fraction": 0.0},
            {"policy": "fcfs", "steps_per_hour": 20.0, "length_bias_ks": 0.05, "thrown_away_token_fraction": 0.1},
            {"policy": "a", "steps_per_hour": 50.0, "length_bias_ks": 0.3, "thrown_away_token_fraction": 0.4},
            {"policy": "b", "steps_per_hour": 32.0, "length_bias_ks": 0.08, "thrown_away_token_fraction": 0.2},
            {"policy": "c", "skipped": "no such setting"}]
    s = summary(rows)
    assert s["steps_per_hour_vs_sync"]["fcfs"] == 2.0 and s["steps_per_hour_vs_fcfs"]["sync"] == 0.5
    assert s["best_within_ks"] == {"ks_max": 0.1, "policy": "b", "vs_fcfs": 1.6, "vs_sync": 3.2,
                                   "thrown_away_token_fraction": 0.2}
    assert summary(rows[:2])["best_within_ks"] is None
    assert s["server_bound_steps_per_hour"] is None  # (no config given)


def test_the_server_bound_ceiling_by_hand():
    # 8 sequences x 16 tokens x 0.1 s on 128 slots = 0.1 s of generation per step < 1 s of training
    assert server_bound_steps_per_hour(_FLAT, 16) == pytest.approx(3600.0)
    # the default: 128 x 678.5 tokens x 25 ms x 1.0635 / 128 = 18.04 s per step > 10 s of training
    assert server_bound_steps_per_hour(TailConfig(), 678.5) == pytest.approx(3600 / (678.5 * 0.025 * 1.0635), rel=1e-9)


def test_the_staleness_latency_bound_by_hand():
    # 0.1 s per token, 1 s of training, eta 1: a sample of L tokens fits steady steps of T s iff 0.1 L <= 2 T - 1
    cfg = replace(_FLAT, max_head_offpolicyness=1, train_step_s=1.0, sim=replace(_FLAT.sim, per_token_s=0.1))
    groups = [[10] * 4] * 9 + [[100] * 4]  # dropping the long group: KS 0.1 (4 of 40 samples)
    b = staleness_latency_bound(cfg, ks_max=0.1, groups=groups)
    assert (b["step_s"], b["steps_per_hour"], b["groups_dropped_fraction"]) == (1.0, 3600.0, 0.1)
    b = staleness_latency_bound(cfg, ks_max=0.05, groups=groups)  # the long group must fit: 2 T - 1 >= 10
    assert (b["step_s"], b["max_len_tokens"], b["groups_dropped_fraction"]) == (5.5, 100, 0.0)
    assert b["steps_per_hour"] == pytest.approx(3600 / 5.5, abs=1e-3)
    assert staleness_latency_bound(replace(cfg, max_head_offpolicyness=20), groups=groups)["steps_per_hour"] == math.inf
    # the default scenario at eta 1: below the server bound (what bounds the comparison there)
    assert staleness_latency_bound(TailConfig())["steps_per_hour"] < server_bound_steps_per_hour(TailConfig(), 678.5)


def test_rollout_bench_scenario_tail_writes_the_json(tmp_path, capsys):
    from engine.cli import main

    out = tmp_path / "bench_tail.json"
    code = main(["bench", "--scenario", "tail", "--policies", "sync,fcfs,overprovision", "--steps", "2",
                 "--cooldown-steps", "2", "--groups-per-step", "2", "--group-size", "2", "--max-new-tokens", "256",
                 "--seeds", "0,1", "--out", str(out)])
    assert code == 0
    printed = capsys.readouterr().out
    assert "steps/h vs sync" in printed and f"wrote {out}" in printed
    doc = json.loads(out.read_text())
    assert doc["schema"] == "bench_tail/1"
    results = {r["policy"]: r for r in doc["results"]}
    assert list(results) == ["sync", "fcfs", "overprovision"]
    for name in ("sync", "fcfs"):
        for key in ("steps_per_hour", "length_bias_ks", "thrown_away_token_fraction", "staleness_mean"):
            assert isinstance(results[name][key], (int, float)), (name, key)
        assert results[name]["time_base"] == "virtual"
    assert "skipped" in results["overprovision"] or "steps_per_hour" in results["overprovision"]
    assert doc["summary"]["steps_per_hour_vs_sync"]["sync"] == 1.0
    assert doc["config"]["seeds"] == [0, 1] and results["fcfs"]["seeds"] == [0, 1]
    lo, hi = results["fcfs"]["spread"]["steps_per_hour"]
    assert lo <= results["fcfs"]["steps_per_hour"] <= hi
    assert len(doc["summary"]["staleness_latency_bound"]["per_seed"]) == 2
    assert doc["summary"]["server_bound_steps_per_hour"] > results["fcfs"]["steps_per_hour"]


def test_a_row_over_seeds_averages_numbers_and_sums_counters():
    rows = [{"policy": "p", "seed": 0, "steps_per_hour": 10.0, "staleness_max": 1, "staleness_histogram": {"0": 3},
             "length_bias_ks": None, "time_base": "virtual"},
            {"policy": "p", "seed": 1, "steps_per_hour": 20.0, "staleness_max": 2, "staleness_histogram": {"0": 1, "1": 2},
             "length_bias_ks": None, "time_base": "virtual"}]
    row = aggregate(rows)
    assert row["steps_per_hour"] == 15.0 and row["staleness_max"] == 2 and row["length_bias_ks"] is None
    assert row["staleness_histogram"] == {"0": 4, "1": 2} and row["seeds"] == [0, 1]
    assert row["spread"] == {"steps_per_hour": [10.0, 20.0]} and row["time_base"] == "virtual"
    assert aggregate(rows[:1])["seeds"] == [0]


@pytest.mark.parametrize("seeds", ["0,x", ","])
def test_bad_seeds_are_one_line(seeds, capsys):
    from engine.cli import main

    assert main(["bench", "--scenario", "tail", "--seeds", seeds]) == 2
    err = capsys.readouterr().err
    assert err.startswith("rollout bench: error:") and "--seeds" in err and err.count("\n") == 1


def test_rollout_bench_scenario_tail_bad_option_is_one_line(capsys):
    from engine.cli import main

    assert main(["bench", "--scenario", "tail", "--policies", "sync,nope"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("rollout bench: error:") and "nope" in err and err.count("\n") == 1


@pytest.mark.parametrize("policy", ["fcfs", "tail_batching"])
def test_every_decoded_token_is_attributed_to_its_prompt(policy):
    """Returned segments and withdrawn requests (tail_batching's cuts, what the close cancels) alike."""
    cfg = replace(_TAILED, steps=4)
    obs = run_policy(cfg, policy)
    assert sum(obs.decoded_by_prompt.values()) == obs.decoded_tokens > 0
    assert set(obs.decoded_by_prompt) <= set(range(cfg.prompts))
    r = summarize(cfg, obs)
    assert r["window_prompts_undecided"] == 0 and r["decoded_tokens"] <= r["decoded_tokens_run"]


def test_the_sweep_picks_per_eta_the_fastest_point_within_the_ks_bound():
    from benchmarks.bench_tail_sweep import GRID, best_by_eta

    def row(eta, policy, sph, ks, settings=None):
        return {"eta": eta, "policy": policy, "settings": settings or {}, "steps_per_hour": sph, "length_bias_ks": ks,
                "thrown_away_token_fraction": 0.1, "mean_len_generated": 678.5}

    rows = [row(1, "fcfs", 100.0, 0.09), row(1, "overprovision", 150.0, 0.2), row(1, "length_aware", 110.0, 0.05,
            {"length_aware_probe_tokens": 64}), row(2, "fcfs", 120.0, 0.08), row(2, "tail_batching", 60.0, 0.0)]
    by_eta = best_by_eta(replace(TailConfig(), steps=2), (0,), (1, 2), rows, {"steps_per_hour": 50.0})
    assert by_eta["1"]["best_within_ks"] == {"policy": "length_aware", "settings": {"length_aware_probe_tokens": 64},
                                             "steps_per_hour": 110.0, "vs_fcfs": 1.1, "vs_sync": 2.2,
                                             "length_bias_ks": 0.05, "thrown_away_token_fraction": 0.1}
    assert by_eta["2"]["best_within_ks"]["policy"] == "tail_batching" and by_eta["2"]["fcfs_steps_per_hour"] == 120.0
    assert by_eta["1"]["staleness_latency_bound_steps_per_hour"] < by_eta["2"]["staleness_latency_bound_steps_per_hour"]
    assert set(GRID) <= set(tail_config.POLICIES) and all({} in points for points in GRID.values())

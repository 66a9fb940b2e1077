"""Contract tier: the benchmark harness on a tiny configuration (correctness, not speed).

The ideal makespan on hand-checkable cases, the plan the sides are checked
against, the AReaL side's server (the sim's own draws, importable without trio or
torch), and the accounting of the ``ours`` and ``naive`` drivers (real reward
worker processes, real tokenizer, the sim on the real clock).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from benchmarks.harness import (
    BenchConfig,
    add_ideal,
    bench_item,
    compare,
    corpus_token_pool,
    format_table,
    ideal_makespan,
    load_tokenizer,
    parse_sides,
    plan_requests,
    write_json,
)
from benchmarks.harness.cli import add_bench_parser, run_bench
from benchmarks.harness.drivers import drive_naive, drive_ours
from benchmarks.harness.meter import batch_figures, memory_summary, steady_rate
from benchmarks.harness.peer_areal import SimPeer
from engine import GenerationHyperparameters, ModelRequest
from engine.backends.sim import POOL_SIZE, SimBackend, SimConfig, SimRequest, tile_pool
from workflows.rlvr import default_get_input_ids


@pytest.fixture(scope="module")
def tiny():
    return load_tokenizer("tiny")[0]


def test_ideal_makespan_hand_checked():
    # 3 slots, per-request latency = 0.5 s prefill + n x 0.1 s:
    #   A 1.5 s, B 2.5 s, C 1.0 s start at 0; D (1.0 s) starts at 1.0 (C's slot) -> 2.0;
    #   E (3.5 s) starts at 1.5 (A's slot) -> 5.0.  Makespan 5.0.
    cfg = SimConfig(prefill_s=0.5, per_token_s=0.1)
    plan = [SimRequest(k, 4, n) for k, n in enumerate([10, 20, 5, 5, 30])]
    assert ideal_makespan(plan, 3, cfg) == pytest.approx(5.0)
    assert ideal_makespan(plan, 1, cfg) == pytest.approx(1.5 + 2.5 + 1.0 + 1.0 + 3.5)
    # a group (same prompt key) holds one slot until its slowest request ends
    grouped = [SimRequest(0, 4, 10), SimRequest(0, 4, 20), SimRequest(1, 4, 5)]
    assert ideal_makespan(grouped, 1, cfg) == pytest.approx(2.5 + 1.0)
    # the shared server: K = 1 serialises everything whatever the client slots
    assert ideal_makespan(plan, 3, SimConfig(prefill_s=0.5, per_token_s=0.1, max_running_seqs=1)) == \
        pytest.approx(1.5 + 2.5 + 1.0 + 1.0 + 3.5)


def test_add_ideal_checks_the_work_and_divides():
    cfg = BenchConfig(episodes=2, concurrency=1, per_token_s=1.0)
    plan = [SimRequest(1, 3, 2), SimRequest(2, 3, 4)]
    out = add_ideal({"wall_s": 12.0, "requests": [[2, 3, 4, 1.0, "ok"], [1, 3, 2, 1.0, "ok"]]}, cfg, plan)
    assert out == {"wall_s": 12.0, "work_matches_plan": True, "ideal_wall_s": 6.0, "efficiency": 0.5}
    out = add_ideal({"wall_s": 12.0, "requests": [[2, 3, 5, 1.0, "ok"], [1, 3, 2, 1.0, "ok"]]}, cfg, plan)
    assert out["work_matches_plan"] is False
    assert add_ideal({"wall_s": 1.0}, BenchConfig(), [SimRequest(1, 3, 2)])["efficiency"] is None  # zero latency


async def test_the_areal_peer_serves_the_plan_with_the_sims_tokens(tiny, autojump_clock):
    # The AReaL side's server (SimPeer, run under AReaL's interpreter) calls the sim's own
    # draw code: its recorded requests are the plan, and its completions are the sim's.
    cfg = BenchConfig(episodes=40, out_len_median=20, out_len_sigma=0.8, max_new_tokens=30, straggler_fraction=0.3,
                      straggler_multiplier=4.0, prefill_s=0.01, per_token_s=0.001, seed=3, tokenizer="tiny")
    plan = plan_requests(cfg, tiny)
    sim = cfg.sim_for(tiny)
    pool = corpus_token_pool(tiny, cfg.seed)
    peer = SimPeer(sim, pool, record=True)
    backend = SimBackend(sim, token_pool=pool)
    gconfig = GenerationHyperparameters(n_samples=1, max_new_tokens=cfg.max_new_tokens)
    for i in range(cfg.episodes):
        ids = default_get_input_ids(tiny, bench_item(i, seed=cfg.seed), False)
        budget = gconfig.token_budget(len(ids))
        out = peer.serve(ids, budget)
        resp = await backend.generate(ModelRequest(input_ids=ids, gconfig=gconfig), budget)
        assert (out.tokens, out.logprobs, out.stop_reason) == (resp.output_tokens, resp.output_logprobs,
                                                              resp.stop_reason)
        assert out.latency == pytest.approx(resp.latency) and out.ttft == pytest.approx(resp.ttft)
    assert add_ideal({"wall_s": 1.0, "requests": peer.log}, cfg, plan)["work_matches_plan"] is True
    assert {r.multiplier for r in plan} == {1.0, 4.0} and len({r.out_len for r in plan}) > 5  # the draws vary
    peer.reset()
    assert peer.log == [] and peer.serve(ids, budget) == out  # occurrences forgotten: the same answer again


def test_the_areal_peer_imports_without_trio_or_torch():
    # The AReaL venv has neither trio nor this project's dependencies: the peer module, the
    # harness package and the sim's draws must import with them made unimportable.
    code = ("import sys\n"
            "for name in ('trio', 'torch', 'transformers', 'numpy', 'tensordict', 'httpx', 'rich'):\n"
            "    sys.modules[name] = None\n"
            "from benchmarks.harness.peer_areal import SimPeer, child_main\n"
            "from engine.backends.sim import SimConfig, draw\n"
            "assert 'engine.backends.sim._backend' not in sys.modules\n"
            "print('ok')\n")
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(root)})
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-2000:]


def test_config_holds_a_sim_config_and_takes_its_fields_flat():
    cfg = BenchConfig(prefill_s=0.05, seed=7, record=False)
    assert cfg.sim.prefill_s == 0.05 and cfg.seed == cfg.sim.seed == 7 and cfg.sim.draws_by_prompt is False
    assert cfg.sim.out_len_median == 256 and cfg.sim.first_token_id == 0  # the benchmark's defaults
    moved = replace(cfg, per_token_s=0.002, concurrency=8, record=True)
    assert (moved.sim.prefill_s, moved.sim.per_token_s, moved.concurrency) == (0.05, 0.002, 8)
    assert moved.sim.draws_by_prompt is True  # always follows record
    assert BenchConfig.from_dict(json.loads(json.dumps(moved.to_dict()))) == moved  # what a side's process gets
    with pytest.raises(ValueError, match="straggler_multiplier"):
        BenchConfig(straggler_multiplier=0.5)
    with pytest.raises(TypeError, match="bogus"):
        BenchConfig(bogus=1)


def test_plan_and_items(tiny):
    cfg = BenchConfig(episodes=6, out_len_median=20, out_len_sigma=0.5, max_new_tokens=25, tokenizer="tiny")
    plan = plan_requests(cfg, tiny)
    assert len(plan) == 6 and len({r.key for r in plan}) == 6
    assert all(1 <= r.out_len <= 25 for r in plan) and len({r.out_len for r in plan}) > 1
    assert plan == plan_requests(cfg, tiny)  # deterministic
    item = bench_item(7)
    assert item["messages"][0]["content"].startswith("Problem 7:") and item["answer"].startswith("#### ")
    assert bench_item(7, warmup=True)["question"] != item["question"]
    pool = tile_pool(corpus_token_pool(tiny))
    assert len(pool) == POOL_SIZE and "\\boxed{" in tiny.decode(pool[:400])


async def test_driver_accounting_on_a_tiny_run(tiny):
    cfg = BenchConfig(episodes=24, concurrency=4, batch_size=4, warmup=0, out_len_median=12, out_len_sigma=0.4,
                      max_new_tokens=32, prefill_s=0.01, per_token_s=0.001, tokenizer="tiny", reward_batch_size=4)
    plan = plan_requests(cfg, tiny)
    outs = {}
    for driver in (drive_ours, drive_naive):
        out = outs[driver.__name__] = add_ideal(await driver(cfg, tiny), cfg, plan)
        assert out["work_matches_plan"] is True
        assert out["accepted"] == 24 and out["failed"] == 0 and out["errors"] == 0
        assert out["generated_tokens"] == sum(r.out_len for r in plan)
        assert sum(out["staleness_histogram"].values()) == 24
        assert 0 < out["efficiency"] <= 1.05
        assert out["ideal_wall_s"] == pytest.approx(ideal_makespan(plan, 4, cfg.sim), abs=1e-4)
        assert out["episodes_per_s"] == pytest.approx(24 / out["wall_s"], rel=1e-3)
        assert out["cpu_ms_per_episode"] >= out["cpu_ms_per_episode_main"] > 0
        assert out["reward_latency_p50_s"] <= out["reward_latency_p99_s"]
        assert out["max_inflight"] == 4  # exact (the sim's peak), not a sample that can miss it
        assert out["time_to_first_batch_s"] <= out["wall_s"]
        assert out["backend"]["requests_served"] == 24 and out["backend"]["tokens_generated"] == out["generated_tokens"]
    ours, naive = outs["drive_ours"], outs["drive_naive"]
    assert ours["reward_mean"] == naive["reward_mean"]  # the same completions, scored the same
    assert ours["token_pool_digest"] == naive["token_pool_digest"]
    assert naive["staleness_histogram"] == {"0": 24}  # naive: generated and consumed at one version per batch


async def test_ours_counts_injected_failures(tiny):
    cfg = BenchConfig(episodes=30, concurrency=8, batch_size=8, warmup=0, out_len_median=6, max_new_tokens=16,
                      error_fraction=0.3, abort_fraction=0.2, tokenizer="tiny", reward_batch_size=8)
    plan = plan_requests(cfg, tiny)
    out = add_ideal(await drive_ours(cfg, tiny), cfg, plan)
    errors = sum(r.outcome == "error" for r in plan)
    assert 0 < errors < 30 and out["work_matches_plan"] is True
    assert out["failed"] == errors == out["failed_by_reason"]["backend_error"]
    assert out["accepted"] == 30 - errors == sum(out["staleness_histogram"].values())
    assert out["backend"]["aborts_injected"] == sum(r.outcome == "abort" for r in plan) > 0


def test_memory_summary_flatness():
    flat = [(i * 0.1, 100.0 + (i % 3), i * 10) for i in range(100)]
    assert memory_summary(flat, 1000)["flat"] is True
    growing = [(i * 0.1, 100.0 + i, i * 10) for i in range(100)]
    summary = memory_summary(growing, 1000)
    assert summary["flat"] is False and summary["tail_min_mib"] == 110.0 and summary["tail_max_mib"] == 199.0
    assert memory_summary([], 10)["flat"] is None


def test_batch_figures_match_the_per_trajectory_reading():
    import random

    import torch
    from tensordict import TensorDict

    rng, trajectories, oldest, rewards = random.Random(0), [], [], 0.0
    for rows in [1] * 40 + [2, 3]:  # single samples, then groups (one figure for all rows)
        length = rng.randint(2, 30)
        prompt = rng.randint(1, length - 1)
        versions = torch.full((rows, length), -1, dtype=torch.int32)
        versions[:, prompt:] = torch.randint(3, 9, (rows, length - prompt), dtype=torch.int32)
        mask = torch.zeros(rows, length, dtype=torch.int32)
        mask[:, prompt:] = 1
        reward = torch.rand(rows)
        trajectories.append(TensorDict({"versions": versions, "loss_mask": mask, "rewards": reward}, batch_size=[rows]))
        oldest.append(int(versions.masked_fill(mask == 0, 1 << 30).min()))  # the -1 prompt versions never count
        rewards += float(reward.double().sum())
    total, got = batch_figures(trajectories)
    assert got == oldest and math.isclose(total, rewards, rel_tol=1e-12)
    assert batch_figures([]) == (0.0, [])


def test_steady_rate_leaves_out_ramp_and_drain():
    # 1000 episodes: nothing for 1 s (ramp), then 100 episodes/s, then a slow drain
    samples = [(0.0, 0.0, 0), (1.0, 0.0, 0)] + [(1.0 + k, 0.0, 100 * k) for k in range(1, 9)]
    samples += [(12.0, 0.0, 900), (20.0, 0.0, 1000)]
    assert steady_rate(samples, 1000) == 100.0  # the whole-run rate would be 50
    assert steady_rate(samples[:3], 1000) is None  # no sample reaches a quarter
    assert steady_rate([(1.0, 0.0, 300), (1.0, 0.0, 600)], 1000) is None  # no time between them


def test_config_validation_and_areal_limits():
    with pytest.raises(ValueError, match="window"):
        BenchConfig(concurrency=8, window=4)
    with pytest.raises(ValueError, match="episodes"):
        BenchConfig(episodes=0)
    assert BenchConfig().effective_window == 512
    assert BenchConfig(max_running_seqs=8).areal_unsupported()
    assert BenchConfig(error_fraction=0.1).areal_unsupported()
    assert BenchConfig(straggler_fraction=0.1, straggler_multiplier=5).areal_unsupported() is None


def test_table_json_and_cli(tmp_path, capsys):
    rows = [{"side": "ours", "concurrency": 8, "episodes_per_s": 100.0, "tokens_per_s": 1e4, "efficiency": 0.98,
             "cpu_ms_per_episode": 0.5, "peak_rss_mib": 400, "rss_per_inflight_kib": 12.0,
             "time_to_first_batch_s": 0.1, "reward_latency_p50_s": 0.001, "reward_latency_p99_s": 0.01, "failed": 0},
            {"side": "areal", "concurrency": 8, "skipped": "not built"}]
    table = format_table(rows, title="t")
    assert "ours" in table and "areal (skipped)" in table and "0.980" in table
    path = write_json(tmp_path / "r.json", "bench", {"episodes": 1}, rows)
    doc = json.loads(path.read_text())
    assert doc["schema"] == "bench/1" and doc["results"] == rows and doc["machine"]["cpus"] >= 1

    parser = argparse.ArgumentParser()
    add_bench_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["bench", "--episodes", "5", "--max-running-seqs", "none", "--prefill-s", "0.5",
                              "--sides", "ours,nope", "--out", str(tmp_path / "b.json")])
    assert args.episodes == 5 and args.max_running_seqs is None and math.isclose(args.prefill_s, 0.5)
    assert run_bench(args) == 2
    assert "unknown side" in capsys.readouterr().err


def test_phase_probe_times_nested_phases_and_restores_the_methods(tmp_path, capsys):
    import importlib.util

    from engine.executor import RolloutEngine
    from workflows.rlvr import RLVRWorkflow

    spec = importlib.util.spec_from_file_location("bench_phases", Path(__file__).resolve().parents[2] / "benchmarks" / "bench_phases.py")
    probe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probe)
    before = (RolloutEngine.agenerate, RLVRWorkflow.arun_episode)
    out = tmp_path / "phases.json"
    assert probe.main(["--episodes", "24", "--concurrency", "4", "--tokenizer", "tiny", "--prefill-s", "0.01",
                       "--per-token-s", "0.0005", "--json-out", str(out)]) == 0
    assert (RolloutEngine.agenerate, RLVRWorkflow.arun_episode) == before  # un-instrumented again
    doc = json.loads(out.read_text())
    mean = {r["phase"]: r["mean_ms"] for r in doc["results"]}
    assert {r["n"] for r in doc["results"]} == {24}  # warm-up episodes excluded
    assert mean["episode"] >= mean["agenerate"] >= mean["generate"] > 0  # phases nest
    assert doc["run"]["planned_generate_mean_ms"] > 0 and 0 < doc["run"]["efficiency"] <= 1.05
    assert "planned generate mean" in capsys.readouterr().out


def test_sides_and_repeats_are_validated():
    assert parse_sides("ours, naive,ours") == ("ours", "naive")  # duplicates dropped, order kept
    for bad in ("ours,bogus", "", ","):
        with pytest.raises(ValueError, match="choose from ours, areal, naive"):
            parse_sides(bad)
    with pytest.raises(ValueError, match="repeats must be >= 1"):
        compare(BenchConfig(episodes=4, concurrency=2, batch_size=2, tokenizer="tiny"), ("ours",), repeats=0)

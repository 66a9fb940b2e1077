"""``rollout bench --backend hf``: asynchronous vs synchronous batched rollout on a real
(tiny, random) model, a tiny workload (a few seconds), and its option checks."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks.async_vs_sync import RealBenchConfig, format_real_table
from engine.cli import main
from engine.testing import build_tiny_model


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    torch.set_num_threads(1)
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


@pytest.mark.parametrize("mode", ["continuous", "static"])
def test_rollout_bench_hf_runs_both_modes_on_the_same_prompts(tiny_model, tmp_path, capsys, mode):
    out = tmp_path / "bench.json"
    code = main(["bench", "--backend", "hf", "--model", tiny_model, "--episodes", "5", "--concurrency", "2",
                 "--max-new-tokens", "8", "--hf-mode", mode, "--out", str(out)])
    assert code == 0
    doc = json.loads(out.read_text())
    assert doc["schema"] == "bench_real/1" and doc["used"]["hf_mode"] == mode
    assert doc["used"]["seeded"] == (mode == "static")  # continuous mode has no per-request seeds
    runs = {r["mode"]: r for r in doc["runs"]}
    assert set(runs) == {"sync", "async"}
    for r in runs.values():
        assert (r["episodes"], r["accepted"], r["failed"]) == (5, 5, 0)
        assert r["wall_s"] > 0 and r["tokens_per_s"] > 0 and 0 < r["slot_occupancy"] <= 1.0
        assert 1 <= r["out_len"]["max"] <= 8 and r["cpu_s"] > 0
    if mode == "static":  # same seeds per prompt on both sides: the same tokens, so the same work
        assert runs["sync"]["generated_tokens"] == runs["async"]["generated_tokens"]
    s = doc["summary"]
    assert s["episodes_per_s_ratio"] == pytest.approx(s["async"]["episodes_per_s"] / s["sync"]["episodes_per_s"],
                                                      rel=1e-2)
    printed = capsys.readouterr().out
    assert "async / sync: episodes/s x" in printed and "wrote" in printed
    assert format_real_table(doc).splitlines()[0].startswith("rollout bench --backend hf: 5 GSM8K prompts")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--backend", "hf", "--prefill-s", "0.1"], "--prefill-s applies to --backend sim only"),
        (["--backend", "hf", "--sides", "ours"], "--sides applies to --backend sim only"),
        (["--backend", "vllm"], "needs at least one server URL"),
        (["--backend", "hf", "--server", "http://127.0.0.1:1"], "apply to --backend sglang|vllm"),
        (["--server", "http://127.0.0.1:1"], "--server applies to --backend hf|sglang|vllm"),
        (["--backend", "hf", "--episodes", "0"], "prompts must be >= 1"),
        (["--backend", "hf", "--modes", "async,later"], "modes must be a non-empty subset"),
        (["--backend", "hf", "--dataset", "/nonexistent.jsonl"], "nonexistent.jsonl"),
        (["--backend", "hf"], "nonexistent-model"),
    ],
)
def test_bad_bench_options_fail_with_one_line_naming_the_option(argv, message, tmp_path, capsys):
    if "hf" in argv:  # never the real model, whatever gets through: an unknown one fails at once
        argv = [*argv, "--model", str(tmp_path / "nonexistent-model")]
    assert main(["bench", *argv, "--out", str(tmp_path / "b.json")]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("rollout bench: error:") == 1


def test_real_config_is_validated():
    with pytest.raises(ValueError, match="hf_mode"):
        RealBenchConfig(hf_mode="paged")
    with pytest.raises(ValueError, match="modes"):
        RealBenchConfig(modes=("sync", "later"))
    assert not RealBenchConfig().seeded and RealBenchConfig(hf_mode="static").seeded

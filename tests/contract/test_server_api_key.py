"""Issue 24, class 8, on real sockets and processes (127.0.0.1): servers with an API key.

* ``rollout serve --api-key KEY`` answers 401 on every route (``/health`` and unknown routes
  included) without ``Authorization: Bearer KEY`` or with a wrong key; ``--host`` beyond
  loopback without ``--api-key`` is one line; ``/update_weights_from_disk`` loads only
  safetensors folders (400 otherwise, nothing paused, nothing loaded);
* ``rollout run --server-api-key`` (or ``$ROLLOUT_SERVER_API_KEY``) sends the key to vLLM,
  SGLang and ``rollout serve``; a missing or wrong key is one line naming the flag, at
  start-up, before any request; the key is never printed nor written to the run's files.

Class 2 through the CLI (a vLLM server on CPU with chunked prefill) is the last test; the
real-server tier is ``test_remote_vllm_run.py``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import trio

from conftest import run_cli
from engine.backends.hf import HFBackend
from engine.serve import SGLangServer, serve_asgi
from engine.serve._server import is_loopback
from engine.testing import build_tiny_model
from fake_servers import FakeSGLang, FakeVLLM
from test_cli_remote import serving

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
KEY = "s3cret-key-of-the-servers"
RUN = ["run", "--dataset", "builtin:arith:3", "--n-samples", "1", "--max-new-tokens", "4", "--quiet"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("keys") / "tiny", seed=0)  # "tiny": FakeVLLM's model id


def _error_lines(err):
    return [line for line in err.strip().splitlines() if not line.startswith("WARNING")]


def _files_text(out: Path) -> str:
    return "".join(p.read_text(errors="replace") for p in out.rglob("*") if p.is_file())


# -- rollout serve --------------------------------------------------------------------------


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.1.2.3", "my-host.example"])
def test_rollout_serve_beyond_loopback_without_an_api_key_is_one_line(host, tiny):
    """Regression: ``rollout serve --host 0.0.0.0`` served every route to anyone (a process
    bounded by a timeout: before the fix it served until killed)."""
    done = subprocess.run([sys.executable, "-m", "engine.serve", "--model", tiny, "--host", host, "--port", "0"],
                          cwd=ROOT, capture_output=True, text=True, timeout=45,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    lines = _error_lines(done.stderr)
    assert done.returncode == 2 and len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    assert lines[0].startswith(f"rollout serve: error: --host {host} accepts connections from other machines: "
                               "pass --api-key KEY"), lines[0]
    assert "listening" not in done.stdout  # refused before anything is bound or loaded


def test_loopback_hosts():
    assert all(is_loopback(h) for h in ("127.0.0.1", "127.0.0.2", "::1", "[::1]", "localhost", "LOCALHOST"))
    assert not any(is_loopback(h) for h in ("0.0.0.0", "::", "", "10.0.0.1", "example.com"))


async def test_rollout_serve_checks_the_key_on_every_route(tiny):
    server = SGLangServer(HFBackend(tiny), model_path=tiny, served_model_name="tiny", api_key=KEY)
    assert KEY not in repr(server)
    wrong = [{}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}, {"Authorization": f"Basic {KEY}"},
             {"Authorization": f"Bearer {KEY}x"}, {"X-Api-Key": KEY}]
    routes = [("GET", "/health"), ("GET", "/get_model_info"), ("GET", "/get_server_info"), ("GET", "/v1/models"),
              ("POST", "/generate"), ("POST", "/pause_generation"), ("POST", "/update_weights_from_disk"),
              ("POST", "/abort_request"), ("GET", "/nope")]
    with trio.fail_after(120):
        async with trio.open_nursery() as nursery:
            port = await nursery.start(serve_asgi, server.app, "127.0.0.1", 0)
            await nursery.start(server.run)
            url = f"http://127.0.0.1:{port}"
            async with httpx.AsyncClient(base_url=url, timeout=30) as client:
                for method, path in routes:
                    for headers in wrong:
                        answer = await client.request(method, path, headers=headers,
                                                      json={"model_path": tiny, "input_ids": [3]})
                        assert answer.status_code == 401, (method, path, headers, answer.text)
                        assert answer.json() == {"error": "Unauthorized"}
                        assert answer.headers["www-authenticate"] == "Bearer"
                ok = {"Authorization": f"Bearer {KEY}"}
                assert (await client.get("/health", headers=ok)).status_code == 200
                assert (await client.get("/health", headers={"Authorization": f"bearer {KEY}"})).status_code == 200
                info = (await client.get("/get_server_info", headers=ok)).json()
                assert info["paused"] is False and info["weight_version"] == "0"  # the refused calls did nothing
                generated = await client.post("/generate", headers=ok, json={
                    "input_ids": [3, 10, 20], "sampling_params": {"max_new_tokens": 3, "ignore_eos": True}})
                assert generated.status_code == 200 and len(generated.json()["output_ids"]) == 3
                assert (await client.get("/nope", headers=ok)).status_code == 404
            nursery.cancel_scope.cancel()


async def test_update_weights_from_disk_loads_only_safetensors_folders(tiny, tmp_path):
    import shutil

    import torch

    pickled = tmp_path / "pickled"
    pickled.mkdir()
    shutil.copy(Path(tiny) / "config.json", pickled / "config.json")
    torch.save({}, pickled / "pytorch_model.bin")
    a_file = tmp_path / "weights.safetensors"
    a_file.write_bytes(b"")
    server = SGLangServer(HFBackend(tiny), model_path=tiny, served_model_name="tiny")
    transport = httpx.ASGITransport(app=server.app)
    refused = {"org/some-model": "is not a folder on this server",  # a hub id: nothing is downloaded
               str(a_file): "is not a folder on this server",
               str(pickled): "is not a safetensors checkpoint",
               str(tmp_path / "missing"): "is not a folder on this server"}
    with trio.fail_after(120):
        async with trio.open_nursery() as nursery:
            await nursery.start(server.run)
            async with httpx.AsyncClient(transport=transport, base_url="http://serve") as client:
                for path, why in refused.items():
                    answer = await client.post("/update_weights_from_disk", json={"model_path": path})
                    assert answer.status_code == 400, answer.text
                    body = answer.json()
                    assert body["success"] is False and f"model_path {path!r} {why}" in body["message"]
                    assert "config.json and model.safetensors" in body["message"]
                assert server.weight_version == "0" and not server._paused and not server.backend.paused
                loaded = await client.post("/update_weights_from_disk", json={"model_path": tiny,
                                                                              "weight_version": "3"})
                assert loaded.status_code == 200 and loaded.json()["success"] is True
                assert server.weight_version == "3"
            nursery.cancel_scope.cancel()


def test_rollout_run_with_the_key_of_a_real_rollout_serve_process(tiny, tmp_path, capsys):
    """``rollout serve --api-key`` (a real process) and ``rollout run --server-api-key``."""
    log = (tmp_path / "serve.log").open("w")
    proc = subprocess.Popen([sys.executable, "-m", "engine.serve", "--model", tiny, "--port", "0", "--torch-threads",
                             "1", "--api-key", KEY], cwd=ROOT, stdout=subprocess.PIPE, stderr=log, text=True,
                            env={**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"})
    watchdog = threading.Timer(180, proc.kill)
    watchdog.start()
    try:
        url = next((line.split("ready on ", 1)[1].split()[0] for line in proc.stdout if "ready on " in line), None)
        watchdog.cancel()
        assert url is not None, (tmp_path / "serve.log").read_text()[-3000:]
        assert httpx.get(url + "/health", timeout=30).status_code == 401
        base = [*RUN, "--backend", "sglang", "--server", url, "--model", tiny]
        code, out, err = run_cli([*base, "--out", str(tmp_path / "none")], capsys)
        lines = _error_lines(err)
        assert code == 2 and len(lines) == 1, err
        assert "every server refused access" in lines[0] and "HTTP 401" in lines[0]
        assert "--server-api-key KEY or the environment variable ROLLOUT_SERVER_API_KEY" in lines[0]
        out_dir = tmp_path / "keyed"
        code, out, err = run_cli([*base, "--server-api-key", KEY, "--out", str(out_dir)], capsys)
        assert code == 0, err
        assert json.loads((out_dir / "summary.json").read_text())["accepted"] == 3
        assert KEY not in out + err + _files_text(out_dir)
    finally:
        watchdog.cancel()
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=30)
        proc.stdout.close()
        log.close()


# -- rollout run against servers with a key (fakes on real sockets) ------------------------


@pytest.mark.parametrize("kind", ["sglang", "vllm"])
def test_rollout_run_without_the_key_is_one_line_naming_the_flag(kind, tiny, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("ROLLOUT_SERVER_API_KEY", raising=False)
    fake = FakeVLLM(api_key=KEY) if kind == "vllm" else FakeSGLang(api_key=KEY)
    with serving(fake.handle) as url:
        start = time.monotonic()
        code, _, err = run_cli([*RUN, "--backend", kind, "--server", url, "--model", tiny,
                                "--out", str(tmp_path / "o")], capsys)
        assert time.monotonic() - start < 30  # at start-up, not after a retry loop
    lines = _error_lines(err)
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith(f"rollout run: error: {kind} backend: every server refused access: ")
    assert "HTTP 401" in lines[0]
    assert lines[0].endswith("the servers need an API key: pass the key they were started with (their --api-key) "
                             "with --server-api-key KEY or the environment variable ROLLOUT_SERVER_API_KEY")
    assert fake.generate_calls == []


@pytest.mark.parametrize("kind", ["sglang", "vllm"])
def test_rollout_run_with_a_wrong_key_says_the_key_is_refused_and_never_prints_it(kind, tiny, tmp_path, capsys):
    fake = FakeVLLM(api_key=KEY) if kind == "vllm" else FakeSGLang(api_key=KEY)
    with serving(fake.handle) as url:
        code, out, err = run_cli([*RUN, "--backend", kind, "--server", url, "--model", tiny,
                                  "--server-api-key", "not-the-key", "--out", str(tmp_path / "o")], capsys)
    lines = _error_lines(err)
    assert code == 2 and len(lines) == 1, err
    assert "the servers refuse the key given with --server-api-key (or ROLLOUT_SERVER_API_KEY)" in lines[0]
    assert "not-the-key" not in out + err and fake.generate_calls == []
    assert set(fake.authorizations) == {"Bearer not-the-key"}


def test_rollout_run_takes_the_key_from_the_environment_and_writes_it_nowhere(tiny, tmp_path, capsys,
                                                                                monkeypatch):
    monkeypatch.setenv("ROLLOUT_SERVER_API_KEY", KEY)
    fake = FakeVLLM(api_key=KEY)
    out_dir = tmp_path / "o"
    with serving(fake.handle) as url:
        args = [*RUN, "--backend", "vllm", "--server", url, "--model", tiny, "--out", str(out_dir)]
        code, out, err = run_cli(args, capsys)
        assert code == 0, err
        printed = run_cli([*args, "--server-api-key", KEY, "--print-config"], capsys)
    assert json.loads((out_dir / "summary.json").read_text())["accepted"] == 3
    assert len(fake.generate_calls) == 3 and set(fake.authorizations) == {f"Bearer {KEY}"}
    assert printed[0] == 0 and "server_api_key" not in printed[1] and KEY not in printed[1] + printed[2]
    assert KEY not in out + err + _files_text(out_dir)
    assert "server_api_key" not in (out_dir / "config.toml").read_text()


def test_a_config_file_with_the_key_is_refused(tmp_path, capsys):
    config = tmp_path / "run.toml"
    config.write_text(f'backend = "vllm"\nserver = ["http://127.0.0.1:1"]\nserver_api_key = "{KEY}"\n')
    code, out, err = run_cli(["run", "--config", str(config), "--out", str(tmp_path / "o")], capsys)
    lines = _error_lines(err)
    assert code == 2 and len(lines) == 1, err
    assert "key 'server_api_key' is a secret, never read from a config file" in lines[0]
    assert "ROLLOUT_SERVER_API_KEY" in lines[0] and KEY not in out + err


@pytest.mark.parametrize("bad", ["two words", "tab\there"])
def test_a_malformed_key_is_one_line_naming_the_flag(bad, tmp_path, capsys):
    code, out, err = run_cli([*RUN, "--backend", "vllm", "--server", "http://127.0.0.1:1", "--server-api-key", bad,
                              "--out", str(tmp_path / "o")], capsys)
    lines = _error_lines(err)
    assert code == 2 and len(lines) == 1, err
    assert lines[0] == ("rollout run: error: --server-api-key: the API key must be visible ASCII characters only "
                        "(no spaces or line breaks)")


# -- class 2 through the CLI -------------------------------------------------------------------


def test_rollout_run_refuses_a_cpu_vllm_server_with_chunked_prefill_in_one_line(tiny, tmp_path, capsys):
    """Issue 24, class 2: such a server dies on the first seeded prompt it splits (the real
    one: ``test_remote_vllm_run.py``); rollout run seeds every request."""
    fake = FakeVLLM(device="cpu", chunked_prefill=True)
    with serving(fake.handle) as url:
        code, _, err = run_cli([*RUN, "--backend", "vllm", "--server", url, "--model", tiny,
                                "--out", str(tmp_path / "o")], capsys)
    lines = _error_lines(err)
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith(f"rollout run: error: vllm backend: {url} is a vLLM server on CPU with chunked "
                               "prefill on, where a seeded request crashes the server")
    assert lines[0].endswith("restart the server with --no-enable-chunked-prefill (rollout run seeds every request "
                             "from --seed, so that a run repeats)")
    assert "check_seeded_sampling" not in lines[0] and fake.generate_calls == []

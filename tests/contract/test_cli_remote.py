"""Issue 13, classes 7 and 10, through ``rollout run`` / ``rollout serve`` (real sockets).

* a remote run takes its tokenizer from ``--model`` or from what the servers report, and
  refuses a mismatch at start-up; ``summary.json`` is plain JSON and names the backend,
  model, tokenizer and servers; waiting for servers is ``startup_seconds``, not part of
  ``wall_seconds``;
* ``--startup-timeout``; a server refusing access fails in seconds; a model folder without
  weights, and a busy port for ``rollout serve``, end with one line.
"""

from __future__ import annotations

import json
import queue
import socket
import threading
import time
from contextlib import contextmanager

import pytest
import trio

from engine.serve import HTTPResponse, serve_http
from engine.testing import build_tiny_model
from fake_servers import FakeSGLang, FakeVLLM
from conftest import run_cli

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny-model", seed=0)


@contextmanager
def serving(handler):
    """Serve ``handler`` on 127.0.0.1 from a thread with its own trio loop (the CLI runs
    its own ``trio.run`` in the test's thread); yields the base URL."""
    ready = queue.Queue()

    def run():
        async def main_loop():
            stop = trio.Event()
            async with trio.open_nursery() as nursery:
                port = await nursery.start(serve_http, handler, "127.0.0.1", 0)
                ready.put((port, trio.lowlevel.current_trio_token(), stop))
                await stop.wait()
                nursery.cancel_scope.cancel()

        trio.run(main_loop)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    port, token, stop = ready.get(timeout=30)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        trio.from_thread.run_sync(stop.set, trio_token=token)
        thread.join(30)


_cli = run_cli


def _error_lines(err):
    return [line for line in err.strip().splitlines() if not line.startswith("WARNING")]


def _strict_json(text):
    def refuse(name):
        raise ValueError(f"not plain JSON: {name}")

    return json.loads(text, parse_constant=refuse)


RUN = ["run", "--backend", "sglang", "--dataset", "builtin:arith:3", "--n-samples", "1", "--max-new-tokens", "4",
       "--quiet"]


class SlowToStart(FakeSGLang):
    """Answers 503 on /health for ``delay_s`` seconds from the first probe (a server
    loading its model; counted from the probe, so a slow CLI import cannot eat into it)."""

    def __init__(self, model_path, delay_s):
        super().__init__()
        self.model_path = model_path
        self.delay_s = delay_s
        self.ready_at = None

    async def handle(self, request):
        if request.path == "/health" and self.ready_at is None:
            self.ready_at = time.monotonic() + self.delay_s
        if request.path == "/health" and time.monotonic() < self.ready_at:
            return HTTPResponse(503, b"loading")
        return await super().handle(request)


def test_a_remote_run_takes_the_tokenizer_the_servers_report_and_writes_plain_json(tiny, tmp_path, capsys):
    fake = SlowToStart(tiny, delay_s=3.0)
    out = tmp_path / "out"
    with serving(fake.handle) as url:
        start = time.monotonic()
        code, _, err = _cli([*RUN, "--server", url, "--out", str(out)], capsys)  # no --model
        elapsed = time.monotonic() - start
    assert code == 0, err
    summary = _strict_json((out / "summary.json").read_text())
    assert summary["backend"] == "sglang" and summary["servers"] == [url]
    assert summary["model"] == tiny and summary["tokenizer"] == tiny  # not the built-in tokenizer
    assert summary["served_models"] == {url: tiny}
    assert summary["accepted"] == 3
    servers = summary["backend_statistics"]["servers"]
    assert isinstance(servers, list) and servers[0]["url"] == url and servers[0]["healthy"] is True
    # waiting for the server is start-up, reported apart from the rollout's wall time
    assert summary["startup_seconds"] >= 3.0
    assert summary["startup_seconds"] + summary["wall_seconds"] <= elapsed


def test_a_remote_run_refuses_a_model_the_servers_do_not_serve(tiny, tmp_path, capsys):
    fake = FakeSGLang()
    fake.model_path = "/models/Other-Model-7B"
    with serving(fake.handle) as url:
        code, _, err = _cli([*RUN, "--server", url, "--model", tiny, "--out", str(tmp_path / "o")], capsys)
    lines = _error_lines(err)
    assert code == 2 and len(lines) == 1, err
    assert "does not match the model the servers serve ('/models/Other-Model-7B')" in lines[0]
    assert fake.generate_calls == []  # refused before any request


def test_startup_timeout_option(tmp_path, capsys):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}"  # nothing listens
    start = time.monotonic()
    code, _, err = _cli([*RUN, "--server", url, "--startup-timeout", "1", "--out", str(tmp_path / "o")], capsys)
    lines = _error_lines(err)
    assert code == 2 and len(lines) == 1, err
    assert "no server answered /health within startup_timeout_s=1.0 s" in lines[0]
    assert time.monotonic() - start < 30


def test_a_server_refusing_access_fails_the_run_in_seconds(tiny, tmp_path, capsys):
    async def forbidden(request):
        return HTTPResponse(403, b'{"detail": "Forbidden"}')

    with serving(forbidden) as url:
        start = time.monotonic()
        code, _, err = _cli([*RUN, "--server", url, "--model", tiny, "--out", str(tmp_path / "o")], capsys)
        assert time.monotonic() - start < 5
    lines = _error_lines(err)
    assert code == 2 and len(lines) == 1 and "refused access" in lines[0] and "HTTP 403" in lines[0], err


def test_a_model_folder_without_weights_is_one_line(tiny, tmp_path, capsys):
    import shutil

    empty = tmp_path / "no-weights"
    empty.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(f"{tiny}/{name}", empty / name)
    code, _, err = _cli(["run", "--backend", "hf", "--model", str(empty), "--dataset", "builtin:arith:2", "--quiet",
                         "--out", str(tmp_path / "o")], capsys)
    lines = _error_lines(err)
    assert code == 2 and len(lines) == 1 and "model.safetensors" in lines[0] and "Traceback" not in err, err


def test_rollout_serve_on_a_busy_port_is_one_line(tiny, capsys):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        code, _, err = _cli(["serve", "--model", tiny, "--port", str(port)], capsys)
    lines = _error_lines(err)
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert f"cannot listen on 127.0.0.1:{port}" in lines[0] and "in use" in lines[0]


def test_choose_tokenizer_matches_names_and_vocabularies(tiny, tmp_path):
    from engine import InvalidRequestError
    from engine.backends.remote import choose_tokenizer

    a, b = "http://a:1", "http://b:1"
    assert choose_tokenizer(None, {a: tiny})[0] == tiny
    assert choose_tokenizer(tiny, {a: None})[0] == tiny  # the server does not say: --model is trusted
    # the same model under another path on the server's machine, or in a Hugging Face cache there
    assert choose_tokenizer(tiny, {a: "/srv/models/tiny-model"})[0] == tiny
    assert choose_tokenizer(tiny, {a: "/root/.cache/hub/models--org--tiny-model/snapshots/0a1b"})[0] == tiny
    with pytest.raises(InvalidRequestError, match="the servers serve different models"):
        choose_tokenizer(tiny, {a: tiny, b: "/srv/models/other"})
    with pytest.raises(InvalidRequestError, match="--model is needed: the servers do not say"):
        choose_tokenizer(None, {a: None})
    with pytest.raises(InvalidRequestError, match="--model is needed: the servers serve '/srv/nowhere/x'"):
        choose_tokenizer(None, {a: "/srv/nowhere/x"})
    other = build_tiny_model(tmp_path / "tiny-model", arch="qwen2")  # same folder name, another tokenizer
    with pytest.raises(InvalidRequestError, match="its tokenizer differs"):
        choose_tokenizer(tiny, {a: other})


def test_a_remote_run_with_shards_pickles_the_probed_backend(tiny, tmp_path, capsys):
    """Regression: ``rollout run --backend sglang|vllm --shards 2`` refused the backend it had
    probed at start-up ("cannot be pickled ... _thread.RLock": its open HTTP client)."""
    fake = FakeSGLang()
    fake.model_path = tiny
    out = tmp_path / "out"
    with serving(fake.handle) as url:
        code, _, err = _cli([*RUN, "--server", url, "--shards", "2", "--out", str(out)], capsys)
    assert code == 0, err
    assert _strict_json((out / "summary.json").read_text())["accepted"] == 3


@pytest.mark.parametrize(("fake", "problem"), [
    (FakeVLLM(logprobs_mode="raw_logprobs"), "runs --logprobs-mode raw_logprobs"),
    (FakeVLLM(dev_mode=False), "cannot read the logprobs mode"),
])
def test_a_vllm_server_without_processed_logprobs_is_one_line_saying_what_to_do_from_the_cli(
        fake, problem, tmp_path, capsys):
    """Regression (new-user trial): the error told a ``rollout run`` user to pass
    ``check_logprobs_mode=False``, a Python argument the CLI has no flag for."""
    with serving(fake.handle) as url:
        code, _, err = _cli([*RUN[:1], "--backend", "vllm", *RUN[3:], "--server", url, "--out", str(tmp_path / "o")],
                            capsys)
    lines = _error_lines(err)
    assert code == 2 and len(lines) == 1 and lines[0].startswith("rollout run: error: vllm backend: "), err
    assert problem in lines[0]
    assert "restart the server with --logprobs-mode processed_logprobs and VLLM_SERVER_DEV_MODE=1" in lines[0]
    assert "rollout run has no option to skip this check" in lines[0]
    assert "check_logprobs_mode" not in lines[0]
    assert fake.generate_calls == []  # refused before any request

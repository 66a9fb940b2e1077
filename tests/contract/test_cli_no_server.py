"""Issue 24, class 1, through ``rollout run --backend sglang`` (real sockets on 127.0.0.1).

* the only server, a real ``rollout serve`` process, is SIGKILLed mid-run and never comes
  back: the run ends within ``--no-server-timeout`` (5 s here) with exit status 75 and one
  line naming the server and its last error; the summary and the committed rows are
  intact, and ``--resume`` against a fresh server finishes the rest, each item once;
* the same server restarted inside the window (same port): the run completes;
* a server that accepts requests and never answers: ``--attempt-timeout`` fails them over
  to the other server, or, alone, the episodes fail ``backend_timeout``.

Real processes: no virtual time; the run's progress is watched on its output files (as
``tests/e2e/test_resume.py`` does), every wait bounded.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest

from conftest import run_cli
from engine.cli import load_rollouts, load_trajectories
from engine.testing import build_tiny_model
from fake_servers import FakeSGLang
from test_cli_remote import _error_lines, serving
from test_remote_serve import ServeProcess

pytestmark = pytest.mark.slow

ITEMS = 40
RUN = ["run", "--backend", "sglang", "--dataset", f"builtin:arith:{ITEMS}", "--n-samples", "1",
       "--max-new-tokens", "16", "--concurrency", "2", "--shard-episodes", "2", "--commit-interval", "0.2", "--quiet"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny-model", seed=0)


def _rows(out: Path) -> int:
    try:
        return (out / "rollouts.jsonl").read_bytes().count(b"\n")
    except FileNotFoundError:
        return 0


def kill_after_rows(server: ServeProcess, out: Path, rows: int, then=None, timeout_s: float = 120.0) -> dict:
    """From a thread: SIGKILL ``server`` once ``out`` holds ``rows`` rows (the run is mid-way),
    then call ``then()``; returns a dict that gets ``killed_at`` (monotonic seconds)."""
    seen: dict = {}

    def watch():
        deadline = time.monotonic() + timeout_s
        while _rows(out) < rows and time.monotonic() < deadline:
            time.sleep(0.01)  # polling a real process's output
        server.kill()
        seen["killed_at"] = time.monotonic()
        seen["rows_at_kill"] = _rows(out)
        if then is not None:
            then()

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    seen["thread"] = thread
    return seen


def test_the_only_server_killed_ends_the_run_at_the_window_and_resume_finishes_it(tiny, tmp_path, capsys):
    first = ServeProcess(tiny, tmp_path / "serve1.log")
    fresh = ServeProcess(tiny, tmp_path / "serve2.log")  # for the resume, started now (it takes seconds)
    try:
        url = first.wait_ready()
        out = tmp_path / "out"
        seen = kill_after_rows(first, out, rows=4)
        code, _, err = run_cli([*RUN, "--server", url, "--model", tiny, "--no-server-timeout", "5",
                                "--out", str(out)], capsys)
        ended_at = time.monotonic()
        seen["thread"].join(10)
        assert seen["rows_at_kill"] < ITEMS, "the run ended before the server was killed"
        assert code == 75, err
        assert ended_at - seen["killed_at"] < 5 + 20  # the window, a backoff, the engine's close
        lines = _error_lines(err)
        assert len(lines) == 1 and "Traceback" not in err, err
        assert lines[0].startswith("rollout run: error: no healthy sglang server for ")
        assert f"{url}: " in lines[0] and "cannot connect" in lines[0] and f"--resume {out}" in lines[0]
        summary = json.loads((out / "summary.json").read_text())
        done = summary["items_done"]
        assert summary["exit"] == "backend_unavailable" and 4 <= done < ITEMS
        assert summary["failed_by_reason"] == {"backend_unavailable": ITEMS - done}
        assert summary["accepted"] == summary["trajectories"] == done
        assert len(load_rollouts(out)) == done and load_trajectories(out).batch_size[0] == done
        assert f"{done}/{ITEMS} items done, {ITEMS - done} left" in lines[0]

        code, printed, err = run_cli(["run", "--resume", str(out), "--server", fresh.wait_ready(), "--quiet"],
                                     capsys)
        assert code == 0, err
        assert (f"{ITEMS}/{ITEMS} items accepted ({2 * ITEMS - done} episodes submitted, {ITEMS - done} again "
                "after an interruption)") in printed
    finally:
        first.kill()
        fresh.stop()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["items_done"] == ITEMS and summary["accepted"] == ITEMS
    rows = load_rollouts(out)
    assert sorted(r["task_id"] for r in rows) == list(range(ITEMS))  # every item once
    assert load_trajectories(out).batch_size[0] == ITEMS


def test_the_only_server_restarted_inside_the_window_is_used_again(tiny, tmp_path, capsys):
    server = ServeProcess(tiny, tmp_path / "serve1.log")
    restarted: dict = {}
    try:
        url = server.wait_ready()
        port = url.rsplit(":", 1)[1]

        def restart():  # the same port: the run's --server URL
            restarted["server"] = ServeProcess(tiny, tmp_path / "serve2.log", "--port", port)

        out = tmp_path / "out"
        seen = kill_after_rows(server, out, rows=4, then=restart)
        code, _, err = run_cli([*RUN, "--server", url, "--model", tiny, "--no-server-timeout", "120",
                                "--out", str(out)], capsys)
        seen["thread"].join(10)
    finally:
        server.kill()
        if "server" in restarted:
            restarted["server"].stop()
    assert seen["rows_at_kill"] < ITEMS, "the run ended before the server was killed"
    assert code == 0, err
    summary = json.loads((out / "summary.json").read_text())
    assert summary["accepted"] == summary["items_done"] == ITEMS and summary["failed"] == 0
    assert "no healthy sglang server" in err and "re-admitted" in err  # the warnings said so


def test_a_server_that_never_answers_times_out_and_fails_over(tiny, tmp_path, capsys):
    run = ["run", "--backend", "sglang", "--n-samples", "1", "--max-new-tokens", "4", "--quiet",
           "--attempt-timeout", "1"]
    hung, good = FakeSGLang(), FakeSGLang()
    hung.script = ["hang"] * 1000  # accepts every request, never answers it; /health answers
    hung.model_path = good.model_path = tiny
    with serving(hung.handle) as hung_url, serving(good.handle) as good_url:
        code, _, err = run_cli([*run, "--dataset", "builtin:arith:4", "--concurrency", "4", "--server", hung_url,
                                "--server", good_url, "--out", str(tmp_path / "two")], capsys)
    assert code == 0, err
    summary = json.loads((tmp_path / "two" / "summary.json").read_text())
    timeouts = summary["backend_statistics"]["attempt_timeouts"]
    assert summary["accepted"] == 4 and timeouts >= 1 and len(good.generate_calls) == 4
    assert len(hung.aborts) == timeouts == len(hung.generate_calls)  # each timed-out attempt aborted

    alone = FakeSGLang()
    alone.script = ["hang"] * 1000
    alone.model_path = tiny
    with serving(alone.handle) as url:
        start = time.monotonic()
        code, _, err = run_cli([*run, "--dataset", "builtin:arith:1", "--server", url, "--out", str(tmp_path / "one")],
                               capsys)
        elapsed = time.monotonic() - start
    lines = _error_lines(err)
    assert code == 1 and len(lines) == 1, err
    assert "backend_timeout x1" in lines[0] and "no answer within attempt_timeout_s=1.0 s" in lines[0]
    assert len(alone.generate_calls) == 6 and elapsed < 60  # max_attempts, each bounded

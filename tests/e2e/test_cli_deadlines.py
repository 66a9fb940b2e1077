"""``rollout run``'s deadlines (issue 24): ``--no-server-timeout``, ``--attempt-timeout``,
``--episode-timeout`` are stated in ``--help`` with their defaults, checked as one line,
and reach the settings objects that own them; a remote run's ``--resume`` takes its
``--server`` URLs again.  (The remote behaviour itself: ``tests/contract/test_cli_no_server.py``.)
"""

from __future__ import annotations

import argparse
import json

import pytest

from conftest import run_cli
from engine.cli._parser import _explicit_options, build_parser

SIM = ["run", "--backend", "sim", "--dataset", "builtin:arith:3", "--n-samples", "1", "--max-new-tokens", "4",
       "--quiet"]


def test_help_states_each_deadline_and_its_default(capsys):
    code, out, _ = run_cli(["run", "--help"], capsys)
    text = " ".join(out.split())
    assert code == 0
    assert "--no-server-timeout SECONDS" in text and "(default 300)" in text and "backend_unavailable" in text
    assert "exit status 75" in text and "--resume runs the rest" in text
    assert "--attempt-timeout SECONDS" in text and "(default 1800)" in text and "backend_timeout" in text
    assert "--episode-timeout SECONDS" in text and "episode_timeout (default: none" in text


@pytest.mark.parametrize("flag", ["--no-server-timeout", "--attempt-timeout", "--episode-timeout"])
@pytest.mark.parametrize("value", ["-1", "nan", "0", "inf", "soon"])
def test_a_bad_deadline_is_one_line_naming_the_flag(flag, value, tmp_path, capsys):
    code, _, err = run_cli([*SIM, flag, value, "--out", str(tmp_path / "o")], capsys)
    assert code == 2 and err.count("\n") == 1, err
    assert err.startswith(f"rollout run: error: argument {flag}: ") and value in err


def test_the_deadlines_reach_their_settings_objects():
    from engine.cli._deadlines import remote_deadlines
    from engine.backends.remote import make_remote_backend
    from engine.cli._run import _engine_config

    args = build_parser().parse_args([*SIM, "--no-server-timeout", "7", "--attempt-timeout", "9",
                                      "--episode-timeout", "11"])
    backend = make_remote_backend("sglang", ["http://a:1"], **remote_deadlines(args))
    assert (backend.timeouts.no_server_timeout_s, backend.timeouts.attempt_timeout_s) == (7.0, 9.0)
    assert _engine_config(args).episode_timeout_s == 11.0
    defaults = build_parser().parse_args(SIM)
    assert make_remote_backend("sglang", ["http://a:1"], **remote_deadlines(defaults)).timeouts.no_server_timeout_s == 300
    assert _engine_config(defaults).episode_timeout_s is None
    assert remote_deadlines(argparse.Namespace()) == {"no_server_timeout_s": None, "attempt_timeout_s": None}


def test_episode_timeout_fails_slow_episodes_with_their_reason(tmp_path, capsys):
    out = tmp_path / "o"
    code, _, err = run_cli([*SIM, "--sim-per-token-s", "1", "--episode-timeout", "0.2", "--out", str(out)], capsys)
    assert code == 1 and "episode_timeout x3" in err and "episode_timeout_s=0.2 s" in err, err
    summary = json.loads((out / "summary.json").read_text())
    assert summary["failed_by_reason"] == {"episode_timeout": 3} and summary["items_done"] == 3


def test_a_resume_takes_the_server_urls_again():
    """Regression: ``rollout run --resume OUT --server URL`` (how a remote run is resumed)
    crashed with a traceback: the marker default of ``_explicit_options`` was appended to."""
    argv = ["run", "--resume", "o", "--server", "http://a:1", "--server", "http://b:1"]
    assert {"resume", "server"} <= _explicit_options(argv)
    assert "server" not in _explicit_options(["run", "--resume", "o"])

"""``rollout run --scheduling length_aware`` and ``--scheduling-max-segments N`` (issue 27):
the engine's per-episode scheduling reaches the command line (``prepare_batch``'s step
policies, ``overprovision`` and ``tail_batching``, stay library settings: ``rollout run``
submits episodes, it takes no steps)."""

from __future__ import annotations

import json

import pytest

from conftest import run_cli

COMMON = ["run", "--backend", "sim", "--dataset", "builtin:arith:4", "--quiet"]


def test_length_aware_probes_each_group_and_the_summary_says_so(tmp_path, capsys):
    out = tmp_path / "o"
    code, _, err = run_cli([*COMMON, "--group-size", "4", "--scheduling", "length_aware",
                            "--scheduling-max-segments", "8", "--out", str(out)], capsys)
    assert code == 0, err
    summary = json.loads((out / "summary.json").read_text())
    scheduling = summary["scheduling"]
    assert scheduling["policy"] == "length_aware" and scheduling["probes"] == 4  # one per group of 4
    assert json.loads((out / "run.json").read_text())["options"]["scheduling"] == "length_aware"


def test_the_servers_limit_is_the_bound_the_summary_reports(tmp_path, capsys):
    out = tmp_path / "o"
    code, _, err = run_cli([*COMMON, "--group-size", "2", "--sim-max-running-seqs", "3",
                            "--scheduling-max-segments", "server", "--out", str(out)], capsys)
    assert code == 0, err
    assert json.loads((out / "summary.json").read_text())["scheduling"]["max_segments"] == 3
    assert json.loads((out / "run.json").read_text())["options"]["scheduling_max_segments"] == "server"


def test_fcfs_is_the_default_and_reports_no_scheduling(tmp_path, capsys):
    out = tmp_path / "o"
    code, _, err = run_cli([*COMMON, "--group-size", "2", "--out", str(out)], capsys)
    assert code == 0, err
    assert json.loads((out / "summary.json").read_text())["scheduling"] is None


@pytest.mark.parametrize(("args", "message"), [
    (["--scheduling", "overprovision"], "argument --scheduling: invalid choice: 'overprovision'"),
    (["--scheduling", "length_aware"], "--scheduling length_aware needs --group-size > 1"),
    (["--shards", "2", "--group-size", "2", "--scheduling", "length_aware"], "a sharded run (--shards) runs fcfs only"),
    (["--shards", "2", "--scheduling-max-segments", "4"], "a sharded run (--shards) runs fcfs only"),
    (["--scheduling-max-segments", "0"], "argument --scheduling-max-segments: must be >= 1"),
    (["--scheduling-max-segments", "servers"], "--scheduling-max-segments: expected an integer >= 1 or 'server'"),
    (["--shards", "2", "--scheduling-max-segments", "server"], "a sharded run (--shards) runs fcfs only"),
])
def test_bad_scheduling_options_are_one_line(args, message, tmp_path, capsys):
    code, _, err = run_cli([*COMMON, "--out", str(tmp_path / "o"), *args], capsys)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("rollout run: error: ") and message in lines[0], err

"""``rollout run --resume DIR`` from another directory than the run's.

Regression: a run started as ``rollout run --dataset data.jsonl --reward
my_reward.py:fn`` saved those relative paths; ``--resume`` from any other directory
(a preempted job restarted elsewhere) refused with "file not found: ./my_reward.py".
``run.json`` now records the start directory, and ``--resume`` takes relative paths
that exist there from there.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from engine.cli._journal import resolve_resume_options


def _saved_run(tmp_path: Path, options: dict, cwd: str | None) -> Path:
    out = tmp_path / "out"
    out.mkdir()
    run = {"format": 1, "options": options, "n_items": 1, "fingerprint": "x"}
    if cwd is not None:
        run["cwd"] = cwd
    (out / "run.json").write_text(json.dumps(run))
    return out


def _args(out: Path, **given) -> argparse.Namespace:
    names = ("dataset", "model", "reward", "workflow", "limit")
    return argparse.Namespace(resume=str(out), out="rollout-out", **{n: given.get(n) for n in names})


def test_relative_paths_are_taken_from_the_run_start_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    start = tmp_path / "start"
    start.mkdir()
    (start / "data.jsonl").write_text("{}\n")
    (start / "my_reward.py").write_text("def fn(*a, **k):\n    return 1.0\n")
    options = {"dataset": "data.jsonl", "reward": "my_reward.py:fn", "model": "builtin:tiny",
               "workflow": "rlvr", "limit": 4}
    out = _saved_run(tmp_path, options, str(start))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    args = _args(out)
    resolve_resume_options(args, set())
    assert args.dataset == str(start / "data.jsonl")
    assert args.reward == f"{start / 'my_reward.py'}:fn"
    assert (args.model, args.workflow, args.limit) == ("builtin:tiny", "rlvr", 4)  # not paths: as saved


def test_a_run_json_without_cwd_keeps_its_paths(tmp_path: Path) -> None:
    out = _saved_run(tmp_path, {"dataset": "data.jsonl", "reward": "my_reward.py:fn"}, None)
    args = _args(out)
    resolve_resume_options(args, set())
    assert (args.dataset, args.reward) == ("data.jsonl", "my_reward.py:fn")


def test_a_different_flag_is_still_refused(tmp_path: Path) -> None:
    out = _saved_run(tmp_path, {"dataset": "data.jsonl"}, str(tmp_path))
    with pytest.raises(ValueError, match="--dataset other.jsonl differs from the run's --dataset data.jsonl"):
        resolve_resume_options(_args(out, dataset="other.jsonl"), {"dataset"})


def test_how_the_run_executed_is_kept_unless_given_again(tmp_path: Path) -> None:
    """Regression (new-user trial): `rollout run --resume OUT` of a `--shards 2` run ran in one
    process and rewrote config.toml without the shards: execution options were not saved."""
    saved = {"dataset": "data.jsonl", "shards": 2, "shard_backend": "process", "concurrency": 32,
             "reward_backend": "local"}
    out = _saved_run(tmp_path, saved, str(tmp_path))
    args = _args(out)
    args.shards, args.shard_backend, args.concurrency, args.reward_backend = None, "process", 64, "local"
    resolve_resume_options(args, set())
    assert (args.shards, args.concurrency) == (2, 32)
    args = _args(out)
    args.shards, args.shard_backend, args.concurrency, args.reward_backend = 3, "process", 64, "local"
    resolve_resume_options(args, {"shards"})  # given again: the new value wins (not what episodes mean)
    assert (args.shards, args.concurrency) == (3, 32)


def test_run_json_saves_how_the_run_executed(tmp_path: Path) -> None:
    from engine.cli import main

    out = tmp_path / "run"
    assert main(["run", "--backend", "sim", "--dataset", "builtin:arith:2", "--n-samples", "1", "--max-new-tokens",
                 "8", "--concurrency", "3", "--quiet", "--out", str(out)]) == 0
    options = json.loads((out / "run.json").read_text())["options"]
    assert options["concurrency"] == 3 and options["shards"] is None and options["reward_backend"] == "local"

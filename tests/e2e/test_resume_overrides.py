"""``rollout run --resume DIR`` with ``--print-config``, and options given again.

Regressions (new-user trial):

* ``--resume DIR --print-config`` printed the defaults (``backend = "hf"``,
  ``dataset = "builtin:arith"``, ``concurrency = 64``, ``out = "rollout-out"``), not the run
  being resumed; it now prints what the resume would run, overrides included.
* ``--resume h2 --shards 3`` wrote ``shards = 3`` into ``config.toml`` but left 2 in
  ``run.json``, so the next plain ``--resume`` ran 2 shards: an option of how the run
  executes (``engine.cli._journal.KEPT_OPTIONS``) given again on ``--resume`` is now the run's
  from then on: ``run.json``, ``config.toml`` and every later ``--resume`` agree.
"""

from __future__ import annotations

import json
from pathlib import Path

from conftest import run_cli
from engine.cli._config_file import tomllib

RUN = ["run", "--backend", "sim", "--dataset", "builtin:arith:3", "--n-samples", "1", "--max-new-tokens", "8",
       "--quiet"]


def _options(out: Path) -> dict:
    return json.loads((out / "run.json").read_text())["options"]


def _printed(argv: list[str], capsys) -> dict:
    code, printed, err = run_cli([*argv, "--print-config"], capsys)
    assert code == 0, err
    return tomllib.loads(printed)


def _unfinish(out: Path) -> None:
    """Make ``out`` a run killed before its first commit (its segment line only): the
    next ``--resume`` runs every item again."""
    journal = out / "progress.jsonl"
    journal.write_text(journal.read_text().splitlines()[0] + "\n")


def test_print_config_with_resume_prints_the_resumed_run(tmp_path, capsys):
    out = tmp_path / "run"
    code, _, err = run_cli([*RUN, "--concurrency", "3", "--temperature", "0.5", "--out", str(out)], capsys)
    assert code == 0, err
    before = (out / "run.json").read_text(), (out / "config.toml").read_text()
    config = _printed(["run", "--resume", str(out), "--quiet"], capsys)
    assert (config["backend"], config["dataset"], config["out"]) == ("sim", "builtin:arith:3", str(out))
    assert (config["concurrency"], config["temperature"], config["n_samples"]) == (3, 0.5, 1)
    assert config == tomllib.loads(before[1])  # what the run saved (--quiet: given each time, as then)
    config = _printed(["run", "--resume", str(out), "--concurrency", "5"], capsys)  # an override: shown
    assert config["concurrency"] == 5 and config["temperature"] == 0.5
    assert ((out / "run.json").read_text(), (out / "config.toml").read_text()) == before  # printing runs nothing
    code, _, err = run_cli(["run", "--resume", str(tmp_path / "nothing"), "--print-config"], capsys)
    assert code == 2 and "no run to resume there" in err, err


def test_an_option_given_again_on_resume_is_the_runs_from_then_on(tmp_path, capsys):
    out = tmp_path / "run"
    code, _, err = run_cli([*RUN, "--concurrency", "3", "--out", str(out)], capsys)
    assert code == 0, err
    _unfinish(out)
    code, _, err = run_cli(["run", "--resume", str(out), "--concurrency", "5", "--quiet"], capsys)
    assert code == 0, err
    assert json.loads((out / "summary.json").read_text())["items_done"] == 3
    assert _options(out)["concurrency"] == 5
    assert tomllib.loads((out / "config.toml").read_text())["concurrency"] == 5
    assert _printed(["run", "--resume", str(out)], capsys)["concurrency"] == 5  # the next plain --resume


def test_shards_given_again_on_resume_reach_run_json_config_toml_and_the_next_resume(tmp_path, capsys):
    """The trial's case: a --shards 2 run resumed with --shards 3 (here with nothing left to
    run, so no shard process starts: the run folder is what is checked)."""
    out = tmp_path / "run"
    code, _, err = run_cli([*RUN, "--out", str(out)], capsys)
    assert code == 0, err
    run = json.loads((out / "run.json").read_text())
    run["options"]["shards"] = 2  # (as a --shards 2 run saves it)
    (out / "run.json").write_text(json.dumps(run))
    code, printed, err = run_cli(["run", "--resume", str(out), "--shards", "3", "--quiet"], capsys)
    assert code == 0 and "nothing to resume" in printed, err
    saved = json.loads((out / "run.json").read_text())
    assert saved["options"]["shards"] == 3
    assert {k: v for k, v in saved.items() if k != "options"} == {k: v for k, v in run.items() if k != "options"}
    assert tomllib.loads((out / "config.toml").read_text())["shards"] == 3
    assert _printed(["run", "--resume", str(out)], capsys)["shards"] == 3
    # a resume that gives nothing again keeps the run's values (and leaves run.json as it is)
    code, _, err = run_cli(["run", "--resume", str(out), "--quiet"], capsys)
    assert code == 0 and _options(out)["shards"] == 3, err


def test_resuming_a_finished_run_keeps_what_its_engine_reported(tmp_path, capsys):
    """Regression (new-user trial): "nothing to resume" rewrote summary.json from the run
    options alone, dropping backend_statistics, reward_statistics, scheduling, ..."""
    out = tmp_path / "run"
    code, _, err = run_cli([*RUN, "--out", str(out)], capsys)
    assert code == 0, err
    before = json.loads((out / "summary.json").read_text())
    assert "backend_statistics" in before and "reward_statistics" in before and "scheduling" in before
    code, printed, err = run_cli(["run", "--resume", str(out), "--quiet"], capsys)
    assert code == 0 and "nothing to resume" in printed, err
    after = json.loads((out / "summary.json").read_text())
    assert set(after) >= set(before)
    for key in ("backend_statistics", "reward_statistics", "scheduling", "items_done", "accepted"):
        assert after[key] == before[key], key

"""``rollout run``'s options after the new-user trial of the sharded engine (issue 16).

* every error about the options is one line with argparse's own prefix for the
  subcommand (``rollout run: error: ...``) and exit status 2, whether argparse or
  the CLI's own checks found it (was ``rollout: error: --shards ...`` next to
  ``rollout run: error: argument --shards ...``);
* options are matched by their whole name (``--out`` was taken as
  ``--out-len-median`` by a benchmark script's argparse prefix matching);
* ``--shard-timeout SECONDS`` reaches ``open_sharded_engine(shard_timeout_s=)`` and is
  kept on ``--resume`` like the other shard options.
"""

from __future__ import annotations

import json
import sys

import pytest

import engine.shards
from conftest import run_cli
from engine.cli._parser import _explicit_options, build_parser


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--backend", "vllm"], "--backend vllm needs at least one --server URL"),
        (["--max-head-offpolicyness", "1"], "--max-head-offpolicyness needs --consumer-batch-size"),
        (["--shard-timeout", "5"], "--shard-timeout applies to --shards N"),
        (["--sim-text", ""], "--sim-text: must not be empty"),
        (["--out", "{file}"], "is a file, not a folder"),
        (["--n-samples", "0"], "argument --n-samples: must be >= 1"),
        (["--conc", "4"], "unrecognized arguments: --conc 4"),  # an abbreviation of --concurrency
        (["--shard", "2"], "unrecognized arguments: --shard 2"),  # of --shards / --shard-backend ...
    ],
)
def test_option_errors_are_one_line_with_argparse_s_prefix(args, message, tmp_path, capsys):
    afile = tmp_path / "afile"
    afile.write_text("")
    args = [str(afile) if a == "{file}" else a for a in args]
    code, _, err = run_cli(["run", "--backend", "sim", "--dataset", "builtin:arith:2", "--quiet",
                            "--out", str(tmp_path / "o"), *args], capsys)
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("rollout run: error: ") and message in lines[0], err


SHARD_TIMEOUT_RULE = ("must be a number of seconds above the shards' statistics interval, 0.5 s (a live shard "
                      "reports every 0.5 s), got ")


@pytest.mark.parametrize(("value", "toml"), [("-1", "-1"), ("0", "0"), ("0.5", "0.5"), ("0.25", "0.25"),
                                             ("soon", '"soon"'), ("inf", "inf"), ("nan", "nan")])
def test_every_bad_shard_timeout_gets_the_one_message_with_the_real_rule(value, toml, tmp_path, capsys):
    """Regression (new-user trial): -1 said ">= 0", 0 said "> 0" and 0.5 said "> 0.5 s";
    the rule is one: a number above the shards' statistics interval (0.5 s)."""
    common = ["run", "--backend", "sim", "--shards", "2", "--quiet", "--out", str(tmp_path / "o")]
    code, _, err = run_cli([*common, "--shard-timeout", value], capsys)
    assert code == 2 and err == f"rollout run: error: argument --shard-timeout: {SHARD_TIMEOUT_RULE}{value}\n", err
    config = tmp_path / "run.toml"
    config.write_text(f"shard_timeout = {toml}\n")
    code, _, err = run_cli([*common, "--config", str(config)], capsys)
    assert code == 2 and err == f"rollout run: error: --config {config}: key 'shard_timeout': {SHARD_TIMEOUT_RULE}" \
        f"{value}\n", err
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["serve", "--mod", "x"], "rollout serve: error: unrecognized arguments: --mod x"),
        (["report", "somewhere", "--ou", "x"], "rollout report: error: unrecognized arguments: --ou x"),
        (["bench", "--out-len", "3"], "rollout bench: error: unrecognized arguments: --out-len 3"),
    ],
)
def test_other_subcommands_take_whole_option_names_only(argv, expected, capsys):
    code, _, err = run_cli(argv, capsys)
    assert code == 2 and err.strip() == expected, err


def test_a_benchmark_script_does_not_take_out_for_out_len_median(monkeypatch, capsys):
    """Regression (new-user trial): ``bench_sweep.py --out x.json`` ran with
    ``--out-len-median x.json`` (argparse prefix matching)."""
    from benchmarks import bench_sweep

    monkeypatch.setattr(sys, "argv", ["bench_sweep.py", "--out", "x.json"])
    with pytest.raises(SystemExit) as exc:
        bench_sweep.main()
    assert exc.value.code == 2
    assert "unrecognized arguments: --out x.json" in capsys.readouterr().err


@pytest.mark.slow  # (reward worker processes)
def test_shard_timeout_reaches_the_engine_and_is_kept_on_resume(tmp_path, capsys, monkeypatch):
    real, seen = engine.shards.open_sharded_engine, {}

    def spy(*args, **kwargs):
        seen.update(kwargs)
        return real(*args, **{**kwargs, "shard_backend": "inline"})  # (same coordinator, no processes)

    monkeypatch.setattr(engine.shards, "open_sharded_engine", spy)
    out = tmp_path / "out"
    code, _, err = run_cli(["run", "--backend", "sim", "--shards", "2", "--shard-timeout", "7.5", "--dataset",
                            "builtin:arith:4", "--n-samples", "1", "--max-new-tokens", "4", "--quiet",
                            "--out", str(out)], capsys)
    assert code == 0, err
    assert (seen["shards"], seen["shard_timeout_s"]) == (2, 7.5)
    assert seen["stats_interval_s"] < seen["shard_timeout_s"]
    options = json.loads((out / "run.json").read_text())["options"]
    assert (options["shards"], options["shard_timeout"]) == (2, 7.5)
    assert "shard_timeout = 7.5" in (out / "config.toml").read_text()

    for argv, expected in ((["run", "--resume", str(out)], 7.5),
                           (["run", "--resume", str(out), "--shard-timeout", "30"], 30.0)):  # given again: wins
        from engine.cli._journal import resolve_resume_options

        args = build_parser().parse_args(argv)
        resolve_resume_options(args, _explicit_options(argv))
        assert (args.shards, args.shard_timeout) == (2, expected)

"""``rollout run --config FILE`` / ``--print-config`` / ``config.toml`` (issue 15).

Unit tier: merging and checking (no run).  End-to-end tier: the round trip on the
sim backend: ``--print-config`` equals the saved ``config.toml``, and a rerun from
it gives the same summary and the same rollouts.
"""

from __future__ import annotations

import json

import pytest

from engine.cli._parser import build_parser
from engine.cli._config_file import ConfigError, config_dict, merge_config_file, tomllib
from conftest import run_cli

TIMING = ("wall_seconds", "startup_seconds", "generated_tokens_per_second", "reward_statistics", "backend_statistics")


_cli = run_cli


def _untimed(summary):
    """A summary without its clocks (wall and start-up seconds, rates, latencies)."""
    out = {k: v for k, v in summary.items() if k not in TIMING}
    out["segments"] = [{k: v for k, v in seg.items() if k != "wall_seconds"} for seg in summary["segments"]]
    return out


def _merged(argv):
    return merge_config_file(build_parser, argv, build_parser().parse_args(argv))


def test_every_run_option_has_a_key_and_flags_override_the_file(tmp_path):
    config = tmp_path / "run.toml"
    config.write_text('n-samples = 4\nmax_new_tokens = 32\nbackend = "sim"\nshuffle = true\nout = "o"\n'
                      'server = "http://a:1"\nworkflow_kwargs = {max_turns = 3}\nsim_per_token_s = 0.01\n'
                      'reward_timeout = 5\n')
    args = _merged(["run", "--config", str(config), "--n-samples", "3"])
    assert (args.n_samples, args.max_new_tokens, args.backend, args.shuffle) == (3, 32, "sim", True)
    assert args.server == ["http://a:1"] and args.workflow_kwargs == {"max_turns": 3}
    assert args.sim_per_token_s == 0.01 and args.reward_timeout == 5.0 and str(args.out) == "o"
    keys = set(config_dict(build_parser, build_parser().parse_args(["run", "--consumer-batch-size", "2",
                                                                     "--limit", "1", "--model", "m"])))
    run = next(a for a in build_parser()._actions if a.dest == "command").choices["run"]
    options = {a.dest for a in run._actions if a.option_strings} - {"help", "config", "print_config"}
    unset = {a.dest for a in run._actions if a.option_strings and a.default is None} - {"consumer_batch_size",
                                                                                          "limit", "model"}
    assert keys == options - unset - {"server"}  # None and empty lists are left out


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("n_sample = 2\n", "unknown key 'n_sample'"),
        ("n_samples = 0\n", "key 'n_samples': must be >= 1, got 0"),
        ("n_samples = \"two\"\n", "key 'n_samples': expected an integer, got 'two'"),
        ("backend = \"gpu\"\n", "key 'backend': 'gpu' is not one of hf, sim, sglang, vllm"),
        ("shuffle = 1\n", "key 'shuffle': expected true or false"),
        ("dataset = 3\n", "key 'dataset': expected a string"),
        ("temperature = [1]\n", "key 'temperature'"),
        ("n_samples = \n", "not valid TOML"),
    ],
)
def test_a_bad_config_file_is_one_error_naming_the_key(tmp_path, capsys, text, needle):
    config = tmp_path / "run.toml"
    config.write_text(text)
    with pytest.raises(ConfigError, match="run.toml"):
        _merged(["run", "--config", str(config)])
    code, _, err = _cli(["run", "--config", str(config), "--quiet"], capsys)
    assert code == 2 and needle in err and len(err.strip().splitlines()) == 1, err
    code, _, err = _cli(["run", "--config", str(tmp_path / "missing.toml")], capsys)
    assert code == 2 and "missing.toml: file not found" in err


@pytest.mark.slow
def test_print_config_equals_the_saved_config_and_a_rerun_repeats_the_run(tmp_path, capsys):
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"problem": f"{i} + 1 = ?", "solution": str(i + 1)}) + "\n" for i in range(5)))
    config = tmp_path / "run.toml"
    config.write_text(f'backend = "sim"\ndataset = "{data}"\nreward = "math"\nn_samples = 2\nseed = 11\n'
                      f'max_new_tokens = 24\nsim_out_len_sigma = 0.8\nquiet = true\n')
    first = tmp_path / "first"
    argv = ["run", "--config", str(config), "--shuffle", "--out", str(first)]
    code, printed, err = _cli([*argv, "--print-config"], capsys)
    assert code == 0 and not first.exists(), err  # printing runs nothing
    assert tomllib.loads(printed)["shuffle"] is True and tomllib.loads(printed)["seed"] == 11
    code, _, err = _cli(argv, capsys)
    assert code == 0, err
    saved = (first / "config.toml").read_text()
    assert saved == printed
    second = tmp_path / "second"
    code, _, err = _cli(["run", "--config", str(first / "config.toml"), "--out", str(second)], capsys)
    assert code == 0, err
    one, two = (_untimed(json.loads((d / "summary.json").read_text())) for d in (first, second))
    assert one == two and one["accepted"] == 5
    rollouts = [sorted((d / "rollouts.jsonl").read_text().splitlines()) for d in (first, second)]  # end order varies
    assert rollouts[0] == rollouts[1] and len(rollouts[0]) == 10
    assert tomllib.loads((second / "config.toml").read_text()) == {**tomllib.loads(saved), "out": str(second)}

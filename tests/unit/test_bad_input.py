"""Issue 13, class 8: bad input is refused with one line naming the field (file:line for
data) before any work; reward errors that cannot go away on retry fail at once.

Covers ``n_samples=0``, an empty question, a row without ``answer`` for the GSM8K reward, a
non-UTF-8 line, ``--out`` pointing at a file, a reward with a wrong signature or reading a
missing data key (no retries), reward functions checked at start-up, and a run with 0
accepted episodes exiting non-zero.
"""

from __future__ import annotations

import sys
import threading

import pytest
import torch
from tensordict import TensorDict

import reward_fixtures as fx
from engine import DatasetError, InvalidRequestError, MockBackend, ModelResponse, RewardError, open_rollout_engine
from engine.datasets import load_dataset
from engine.types import GenerationHyperparameters
from rewards import gsm8k_reward, open_reward_pool
from conftest import run_cli

ARGS = ("prompt", "completion", [1, 2], [3])


_cli = run_cli


def _one_line(err):
    return len(err.strip().splitlines()) == 1 and "Traceback" not in err


# -- gconfig and workflow ---------------------------------------------------------------------


def test_n_samples_zero_is_refused_when_the_workflow_is_built():
    from engine.testing import build_tiny_tokenizer
    from workflows.rlvr import RLVRWorkflow

    with pytest.raises(InvalidRequestError, match="n_samples must be >= 1, got 0"):
        RLVRWorkflow(gsm8k_reward, GenerationHyperparameters(n_samples=0), build_tiny_tokenizer())


class _ZeroRows:
    async def arun_episode(self, engine, data):
        return TensorDict({"input_ids": torch.zeros(0, 3, dtype=torch.int32)}, batch_size=[0])


async def test_a_trajectory_with_zero_rows_is_not_accepted(reward_pool):
    async def never(req, budget):  # pragma: no cover - the workflow does not generate
        return ModelResponse()

    async with open_rollout_engine(MockBackend(never), reward_pool=reward_pool) as engine:
        engine.submit({"x": 1}, _ZeroRows())
        [result] = await engine.wait_results(1)
    assert result.status == "failed" and result.reason == "workflow_error"
    assert "0 rows" in result.error_message


# -- datasets ---------------------------------------------------------------------------------


def test_an_empty_question_names_file_line_and_field(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"question": "1+1?", "answer": "#### 2"}\n{"question": "  ", "answer": "#### 3"}\n')
    with pytest.raises(DatasetError, match=r"d\.jsonl:2: field 'question' is empty"):
        load_dataset(str(path))


def test_a_row_without_a_required_field_names_file_line_and_field(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"question": "1+1?", "answer": "#### 2"}\n\n{"question": "2+2?"}\n')
    assert len(load_dataset(str(path))) == 2  # answer is optional for the loader itself
    with pytest.raises(DatasetError, match=r"d\.jsonl:3: row has no field 'answer'"):
        load_dataset(str(path), required=("answer",))


def test_a_non_utf8_line_names_file_and_line(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_bytes(b'{"question": "ok", "answer": "#### 1"}\n{"question": "caf\xe9", "answer": "#### 1"}\n')
    with pytest.raises(DatasetError, match=r"d\.jsonl:2: not valid UTF-8"):
        load_dataset(str(path))


@pytest.mark.parametrize(
    ("rows", "needle"),
    [
        (b'{"question": "ok", "answer": "#### 1"}\n{"question": "no answer"}\n',
         "bad.jsonl: row index 1: field 'answer' is missing or null (the reward needs it)"),
        (b'{"question": "", "answer": "#### 1"}\n', "bad.jsonl: row index 0: field 'question' is empty"),
        (b'{"question": "caf\xe9", "answer": "#### 1"}\n', "bad.jsonl: row index 0: not valid UTF-8"),
    ],
)
def test_rollout_run_refuses_bad_rows_in_one_line_before_any_work(tmp_path, capsys, monkeypatch, rows, needle):
    import engine.cli._backend
    import engine.cli._main

    def no_work(*args, **kwargs):
        raise AssertionError("no backend may be built for bad input")

    monkeypatch.setattr(engine.cli._backend, "tokenizer_and_backend", no_work)
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(rows)
    code, _, err = _cli(["run", "--backend", "sim", "--quiet", "--dataset", str(bad), "--out", str(tmp_path / "o")],
                        capsys)
    assert code == 2 and needle in err and _one_line(err), err


def test_out_pointing_at_a_file_is_refused_at_start_up(tmp_path, capsys, monkeypatch):
    import engine.cli._backend
    import engine.cli._main

    def no_work(*args, **kwargs):
        raise AssertionError("no backend may be built for bad input")

    monkeypatch.setattr(engine.cli._backend, "tokenizer_and_backend", no_work)
    target = tmp_path / "a-file"
    target.write_text("not a folder")
    code, _, err = _cli(["run", "--backend", "sim", "--quiet", "--out", str(target)], capsys)
    assert code == 2 and "--out" in err and "not a folder" in err and _one_line(err), err
    assert target.read_text() == "not a folder"


# -- reward errors that cannot go away on retry -------------------------------------------------


@pytest.mark.slow
async def test_deterministic_reward_errors_fail_at_once_in_a_worker(tmp_path):
    log = tmp_path / "attempts"
    async with open_reward_pool(max_workers=1, timeout_seconds=30.0, max_retries=3) as pool:
        with pytest.raises(RewardError, match="raised KeyError.*not retried") as info:
            await pool.score(fx.raise_key_error, *ARGS, log=str(log))
        assert isinstance(info.value.__cause__, KeyError)
        with pytest.raises(RewardError, match="raised TypeError.*not retried"):
            await pool.score(fx.wrong_signature, *ARGS, log=str(log))
        stats = pool.statistics()
    assert (stats.errors, stats.retries) == (2, 0)
    assert len(log.read_text().split()) == 1  # the KeyError reward ran once; the TypeError one never started


async def test_a_worker_that_re_ran_an_unguarded_script_fails_at_once_naming_the_guard():
    # a new-user trial: TRL's README program without `if __name__ == "__main__":` made every reward
    # worker start an engine of its own; the spawn guard's RuntimeError was retried as a flaky reward
    calls = []

    async def unguarded(prompt, completions, prompt_ids, completion_ids, **data):
        calls.append(1)
        raise RuntimeError("An attempt has been made to start a new process before the current process has "
                           "finished its bootstrapping phase.")

    async with open_reward_pool(max_workers=1, timeout_seconds=30.0, max_retries=3) as pool:
        with pytest.raises(RewardError, match=r're-ran your script.*if __name__ == "__main__":.*not retried'):
            await pool.score(unguarded, *ARGS)
    assert calls == [1]


async def test_transient_reward_errors_are_still_retried():
    calls = []

    async def flaky(prompt, completions, prompt_ids, completion_ids, **data):
        calls.append(1)
        raise ConnectionError("judge unreachable")

    async def missing_key(prompt, completions, prompt_ids, completion_ids, **data):
        calls.append(2)
        return data["answer"]

    async with open_reward_pool(max_workers=1, timeout_seconds=30.0, max_retries=2) as pool:
        with pytest.raises(RewardError, match="ConnectionError"):
            await pool.score(flaky, *ARGS)
        assert calls == [1, 1, 1]  # retried: an I/O error may go away
        with pytest.raises(RewardError, match="KeyError"):
            await pool.score(missing_key, *ARGS)
        assert calls == [1, 1, 1, 2]  # not retried


# -- reward functions checked at start-up -------------------------------------------------------


def _ghost_module_reward(tmp_path, name: str, imports: str = ""):
    """A module-level function of a module loaded by path (a spawned worker cannot import it
    by name: it travels by file path); ``imports`` heads its source."""
    import importlib.util

    source = tmp_path / f"{name}.py"
    source.write_text(imports + "def reward(prompt, completions, prompt_ids, completion_ids, **data):\n"
                      "    return 1.0\n")
    spec = importlib.util.spec_from_file_location(name, source)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules[spec.name] = module
    return module.reward


@pytest.mark.slow
async def test_reward_functions_are_checked_at_start_up(tmp_path):
    import types

    by_path = _ghost_module_reward(tmp_path, "ghost_rewards_not_on_path")
    sys.modules["ghost_helper_of_this_process"] = types.ModuleType("ghost_helper_of_this_process")
    ghost = _ghost_module_reward(tmp_path, "ghost_rewards_needing_a_helper", "import ghost_helper_of_this_process\n")
    try:
        async with open_reward_pool(max_workers=1, timeout_seconds=30.0) as pool:
            await pool.check_reward_fn(gsm8k_reward, {"question": "q", "answer": "#### 1", "messages": []})
            with pytest.raises(RewardError, match="not callable"):
                await pool.check_reward_fn(42)
            with pytest.raises(RewardError, match="cannot be pickled"):
                await pool.check_reward_fn(lambda *a, lock=threading.Lock(): 1.0)  # noqa: B008
            with pytest.raises(RewardError, match="missing a required argument: 'answer'"):
                await pool.check_reward_fn(gsm8k_reward, {"question": "q", "messages": []})
            with pytest.raises(RewardError, match="wrong_signature.*cannot be called"):
                await pool.check_reward_fn(fx.wrong_signature, {})
            await pool.check_reward_fn(by_path)  # its file is loaded in the worker (issue 24)
            with pytest.raises(RewardError, match="ghost_rewards_needing_a_helper.reward or its arguments could not be unpickled "
                                                  "in the worker.*ghost_helper_of_this_process"):
                await pool.check_reward_fn(ghost)
            stats = pool.statistics()
        assert stats.calls == 0  # checks are not calls
    finally:
        for name in ("ghost_rewards_not_on_path", "ghost_rewards_needing_a_helper", "ghost_helper_of_this_process"):
            sys.modules.pop(name, None)


# -- a run with nothing accepted ----------------------------------------------------------------


@pytest.mark.slow
def test_a_run_with_zero_accepted_episodes_exits_non_zero_with_one_line(tmp_path, capsys, monkeypatch):
    out = tmp_path / "out"
    code, _, err = _cli(["run", "--backend", "sim", "--quiet", "--dataset", "builtin:arith:2", "--n-samples", "1",
                         "--reward", f"{fx.__file__}:raise_value_error",
                         "--max-new-tokens", "4", "--reward-timeout", "10", "--out", str(out)], capsys)
    assert code == 1
    lines = [line for line in err.strip().splitlines() if not line.startswith("WARNING")]
    assert len(lines) == 1 and "0 of 2 episodes accepted" in lines[0] and "reward_error" in lines[0], err
    assert (out / "summary.json").is_file()  # what there is, is still written


@pytest.mark.slow
def test_a_run_whose_every_reward_timed_out_is_not_a_success(tmp_path, capsys):
    """Regression (new-user trial): all rewards were the 0.0 timeout fallback and the run exited 0."""
    out = tmp_path / "out"
    code, _, err = _cli(["run", "--backend", "sim", "--quiet", "--dataset", "builtin:arith:2", "--n-samples", "1",
                         "--reward", f"{fx.__file__}:sleep_forever", "--max-new-tokens", "4",
                         "--reward-timeout", "0.5", "--out", str(out)], capsys)
    assert code == 1 and "every reward timed out (2 fallback rewards of 0.0 for 2 trajectories)" in err, err

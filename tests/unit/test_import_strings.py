"""Contract tier: workflows and reward functions given as import strings are
resolved once, at construction; a bad one is one clear error there, and a
function from a file reaches spawned reward worker processes."""

from __future__ import annotations

import os
import pickle
import textwrap

import pytest

import import_fixtures
import reward_fixtures
from engine import (
    EngineConfig,
    GenerationHyperparameters,
    RewardError,
    SimBackend,
    SimConfig,
    WorkflowError,
    open_rollout_engine,
)
from engine.datasets import builtin_arith, to_item
from engine.imports import FileFunction, import_object, resolve_reward_fn
from engine.testing import build_tiny_tokenizer
from workflows import MultiTurnWorkflow, RLVRWorkflow, resolve_workflow

REWARD_FILE = '''
import os

CALLS = []

def pid_reward(prompt, completions, prompt_ids, completion_ids, **data):
    CALLS.append(1)  # module state of the process that runs it
    return float(os.getpid())

async def async_reward(prompt, completions, prompt_ids, completion_ids, **data):
    return 2.0

class Holder:
    def __call__(self, *args, **kwargs):
        return 1.0

holder = Holder()
'''


@pytest.fixture
def reward_file(tmp_path):
    path = tmp_path / "my_rewards.py"
    path.write_text(textwrap.dedent(REWARD_FILE))
    return path


def _sim(tok):
    return SimBackend(SimConfig(vocab_size=len(tok), eos_token_id=tok.eos_token_id, first_token_id=5,
                                out_len_median=4, seed=1))


def test_dotted_and_colon_paths_name_the_same_function():
    assert resolve_reward_fn("reward_fixtures.length_reward") is reward_fixtures.length_reward
    assert resolve_reward_fn("reward_fixtures:length_reward") is reward_fixtures.length_reward
    assert resolve_reward_fn(reward_fixtures.length_reward) is reward_fixtures.length_reward
    actor = resolve_reward_fn("import_fixtures:HalfActor")  # a RewardActor class: one instance
    assert isinstance(actor, import_fixtures.HalfActor)
    assert import_object("workflows.multi_turn:MultiTurnWorkflow") is MultiTurnWorkflow
    assert import_object("workflows.multi_turn.MultiTurnWorkflow") is MultiTurnWorkflow


@pytest.mark.parametrize(
    ("spec", "needle"),
    [
        ("no_such_module:fn", "cannot import module 'no_such_module'"),
        ("reward_fixtures:no_such_fn", "module 'reward_fixtures' has no attribute 'no_such_fn'"),
        ("import_fixtures:NOT_CALLABLE", "int object is not callable"),
        ("import_fixtures:NotAReward", "is a class, not a function"),
        ("import_fixtures:locked_reward", "cannot be sent to a reward worker process"),
        ("no/such/file.py:fn", "file not found"),
        ("justaname", "expected 'pkg.module:name'"),
        ("{file}:missing", "has no attribute 'missing'"),
        ("{file}:holder", "from a file, name a plain function"),
        ("{broken}:fn", "loading .*broken.py raised ZeroDivisionError"),
    ],
)
def test_a_bad_reward_is_one_clear_error_at_construction(spec, needle, reward_file, tmp_path):
    broken = tmp_path / "broken.py"
    broken.write_text("x = 1 / 0\ndef fn(*a, **k):\n    return 1.0\n")
    spec = spec.replace("{file}", str(reward_file)).replace("{broken}", str(broken))
    tok = build_tiny_tokenizer()
    for build in (lambda: RLVRWorkflow(spec, GenerationHyperparameters(), tok),
                  lambda: MultiTurnWorkflow(spec, GenerationHyperparameters(), tok, max_turns=2)):
        with pytest.raises(RewardError, match=needle) as info:
            build()
        message = str(info.value)
        assert message.startswith(f"reward function {spec!r}: ") and "\n" not in message


def test_a_workflow_spec_with_a_bad_reward_fails_at_submit_not_per_episode():
    tok = build_tiny_tokenizer()
    kwargs = {"reward_fn": "reward_fixtures:nope", "gconfig": GenerationHyperparameters(), "tokenizer": tok}
    with pytest.raises(RewardError, match="reward_fixtures:nope"):
        resolve_workflow("workflows.multi_turn:MultiTurnWorkflow", kwargs)
    kwargs["reward_fn"] = "reward_fixtures:length_reward"
    assert isinstance(resolve_workflow("workflows.multi_turn.MultiTurnWorkflow", kwargs), MultiTurnWorkflow)
    with pytest.raises(WorkflowError, match="cannot import module 'workflows.nope'"):
        resolve_workflow("workflows.nope:Flow", kwargs)


def test_a_workflow_class_from_a_file(tmp_path):
    flow = tmp_path / "my_flow.py"
    flow.write_text("class Flow:\n    def __init__(self, tag):\n        self.tag = tag\n"
                    "    async def arun_episode(self, engine, data):\n        return None\n")
    wf = resolve_workflow(f"{flow}:Flow", {"tag": 3})
    assert type(wf).__name__ == "Flow" and wf.tag == 3


def test_a_file_function_pickles_by_path(reward_file):
    fn = resolve_reward_fn(f"{reward_file}:pid_reward")
    assert isinstance(fn, FileFunction) and fn.path == str(reward_file)
    data = pickle.dumps(fn)
    assert b"_rollout_file_" not in data  # not by reference to a module a worker cannot import
    again = pickle.loads(data)
    assert again(None, None, [], []) == float(os.getpid())
    assert resolve_reward_fn(f"{reward_file}:async_reward").__name__ == "async_reward"  # in-process: as is


@pytest.mark.slow
async def test_a_file_reward_runs_in_spawned_reward_workers(reward_file):
    tok = build_tiny_tokenizer()
    items = [to_item(row) for row in builtin_arith(3)]
    wf = RLVRWorkflow(f"{reward_file}:pid_reward", GenerationHyperparameters(max_new_tokens=4), tok)
    config = EngineConfig(reward_max_workers=1, reward_worker_type="spawn")
    async with open_rollout_engine(_sim(tok), config) as engine:
        batch = await engine.rollout_batch(items, wf)
        stats = engine.statistics()
    assert stats.accepted == 3 and stats.failed == 0
    pids = set(batch["rewards"].tolist())
    assert len(pids) == 1 and pids != {float(os.getpid())}  # scored in the (one) worker process

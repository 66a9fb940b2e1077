"""Issue 24, class 4: reward functions from a module loaded by path
(``importlib.util.spec_from_file_location``, verl's ``custom_reward_function.path``), which a
fresh worker process cannot import by name, reach the workers (by file path); and a reward
that cannot be loaded in a worker is one error at start-up, before any episode, on the API
path too.

Tier: contract (real spawn workers; an engine on the simulated backend).
"""

from __future__ import annotations

import importlib.util
import sys
import textwrap

import pytest
import trio

from engine.errors import RewardError
from rewards import AsyncRewardWrapper, open_reward_pool

pytestmark = pytest.mark.slow

ARGS = ("prompt", "the answer is 42", [1, 2], [3])

REWARD_SOURCE = """
import re
from rewards import RewardActor

_NUMBER = re.compile(r"\\d+")
CALLS = []


def reward(prompt, completions, prompt_ids, completion_ids, **data):
    CALLS.append(1)  # module state lives on in the worker, as for an imported module
    return float(_NUMBER.search(completions).group()) + len(CALLS) / 1000


class Judge(RewardActor):
    def setup(self):
        self.bonus = 0.5

    def __call__(self, prompt, completions, prompt_ids, completion_ids, **data):
        return reward(prompt, completions, prompt_ids, completion_ids) + self.bonus
"""


def _load(tmp_path, name: str, source: str, filename: str = "custom_reward.py"):
    """Load ``source`` as module ``name`` from a file, as verl does (registered in sys.modules)."""
    path = tmp_path / filename
    path.write_text(textwrap.dedent(source))
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def custom_module(tmp_path):
    yield _load(tmp_path, "custom_module", REWARD_SOURCE)
    sys.modules.pop("custom_module", None)


@pytest.mark.parametrize("batch_size", [1, 64])
async def test_a_reward_from_a_module_loaded_by_path_runs_in_the_workers(custom_module, batch_size):
    async with open_reward_pool(max_workers=1, timeout_seconds=60.0, max_retries=0, batch_size=batch_size) as pool:
        await pool.check_reward_fn(custom_module.reward)  # loads in a real worker
        first = await pool.score(custom_module.reward, *ARGS)
        second = await pool.score(custom_module.reward, *ARGS)
        actor = await pool.score(custom_module.Judge(), *ARGS)
        wrapped = await AsyncRewardWrapper(custom_module.reward).score(*ARGS)
        stats = pool.statistics()
    assert (first.reward, second.reward) == (42.001, 42.002)  # the worker loaded the file once
    assert actor.reward == 42.503 and wrapped.reward == 42.004
    assert stats.errors == 0 and custom_module.CALLS == []  # ran in the worker, not here


async def test_a_reward_from_a_module_built_in_memory_travels_by_value():
    import types

    module = types.ModuleType("in_memory_rewards")  # no file to load in the worker
    exec("def reward(prompt, completions, prompt_ids, completion_ids, **data):\n    return 0.75\n",
         module.__dict__)
    sys.modules["in_memory_rewards"] = module
    try:
        async with open_reward_pool(max_workers=1, timeout_seconds=60.0, max_retries=0) as pool:
            await pool.check_reward_fn(module.reward)
            outcome = await pool.score(module.reward, *ARGS)
    finally:
        sys.modules.pop("in_memory_rewards", None)
    assert outcome.reward == 0.75


async def test_an_engine_runs_a_workflow_whose_reward_is_loaded_by_path(tmp_path):
    from engine import EngineConfig, SimBackend, SimConfig, open_rollout_engine
    from engine.datasets import builtin_arith, to_item
    from engine.testing import build_tiny_tokenizer
    from engine.types import GenerationHyperparameters
    from workflows.rlvr import RLVRWorkflow

    tok = build_tiny_tokenizer()
    sim = SimBackend(SimConfig(vocab_size=len(tok), eos_token_id=tok.eos_token_id, first_token_id=0,
                               out_len_median=6, seed=1))
    source = "def reward(prompt, completions, prompt_ids, completion_ids, **data):\n    return 0.25\n"
    module = _load(tmp_path, "verl_custom_module", source, "other_reward.py")
    try:
        workflow = RLVRWorkflow(module.reward, GenerationHyperparameters(max_new_tokens=4), tok)
        async with open_rollout_engine(sim, EngineConfig(reward_max_workers=1)) as engine:
            batch = await engine.rollout_batch([to_item(row) for row in builtin_arith(4)], workflow)
            stats = engine.statistics()
    finally:
        sys.modules.pop("verl_custom_module", None)
    assert batch.batch_size[0] == 4 and batch["rewards"].tolist() == [0.25] * 4
    assert stats.rewards.errors == 0


class AReaLStyleWorkflow:
    """An AReaL-style workflow: its reward in an ``AsyncRewardWrapper`` attribute."""

    def __init__(self, reward_fn) -> None:
        self.async_reward_fn = AsyncRewardWrapper(reward_fn)

    async def arun_episode(self, engine, data):
        raise AssertionError("no episode may start")


@pytest.mark.parametrize("style", ["rlvr", "areal"])
async def test_a_reward_that_cannot_load_in_a_worker_is_one_error_before_any_episode(tmp_path, style):
    from engine import EngineConfig, SimBackend, SimConfig, open_rollout_engine
    from engine.datasets import builtin_arith, to_item
    from engine.testing import build_tiny_tokenizer
    from engine.types import GenerationHyperparameters
    from workflows.rlvr import RLVRWorkflow

    # its helper is a module of this process only (loaded by path, on no sys.path): the reward's
    # own file loads in a worker, its import of the helper does not
    _load(tmp_path, "host_only_helper", "SCALE = 2.0\n", "helper.py")
    module = _load(tmp_path, "needs_helper", (
        "from host_only_helper import SCALE\n"
        "def reward(prompt, completions, prompt_ids, completion_ids, **data):\n    return SCALE\n"
    ), "needs_helper.py")
    tok = build_tiny_tokenizer()
    sim = SimBackend(SimConfig(vocab_size=len(tok), eos_token_id=tok.eos_token_id, first_token_id=0,
                               out_len_median=6, seed=1))
    try:
        if style == "rlvr":
            workflow = RLVRWorkflow(module.reward, GenerationHyperparameters(max_new_tokens=4), tok)  # fine here
        else:
            workflow = AReaLStyleWorkflow(module.reward)
        async with open_rollout_engine(sim, EngineConfig(reward_max_workers=1)) as engine:
            with pytest.raises(RewardError, match=r"needs_helper\.reward.*host_only_helper") as raised:
                await engine.rollout_batch([to_item(row) for row in builtin_arith(8)], workflow)
            stats = engine.statistics()
            with pytest.raises(RewardError, match=r"needs_helper\.reward"):  # and again, at once
                with trio.fail_after(30):
                    await engine.prepare_batch([to_item(row) for row in builtin_arith(8)], workflow)
    finally:
        sys.modules.pop("host_only_helper", None)
        sys.modules.pop("needs_helper", None)
    assert "ModuleNotFoundError" in str(raised.value)
    assert stats.submitted == 0  # no episode was started
    assert stats.rewards.calls == 0

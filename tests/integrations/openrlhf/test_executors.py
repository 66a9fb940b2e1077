"""OpenRLHF tier: OpenRLHF 0.11.2's own executors (``openrlhf.utils.agent``) generating on our engine.

The executors (``MultiTurnAgentExecutor``, ``SingleTurnAgentExecutor`` with a reward function
file) run unmodified with :class:`engine.integrations.openrlhf.OpenRLHFEngine` as their
``llm_engine``, over the ``hf`` backend on the tiny model; their rows go through OpenRLHF's own
``SamplesGenerator._process_response_into_experience`` into ``Experience`` objects, which are
checked field by field, and the behaviour logprobs against OpenRLHF's ``Actor.forward``
recomputation (``_openrlhf_support.openrlhf_logprobs``).  Run in the venv of
``tests/integrations/openrlhf/venv.sh`` (``make test-integrations``).
"""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("openrlhf", reason="needs the openrlhf venv: make test-integrations")

import torch  # noqa: E402
from openrlhf.utils.agent import AgentInstanceBase, MultiTurnAgentExecutor, SingleTurnAgentExecutor  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from engine import BackendError, HFBackend, RolloutEngineThread  # noqa: E402
from engine.integrations.openrlhf import (IncompleteGroupError, OpenRLHFConfig, OpenRLHFEngine,  # noqa: E402
                                          SamplingParams)
from engine.testing import build_tiny_model  # noqa: E402

from _openrlhf_support import openrlhf_logprobs, samples_generator  # noqa: E402

pytestmark = pytest.mark.filterwarnings(
    # OpenRLHF's SamplesGenerator module imports tqdm, whose notebook check warns on some setups
    "ignore::DeprecationWarning:tqdm.*")

MAX_LEN = 96
TEMPERATURE = 0.7
FEEDBACK = "\nfeedback\n"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny"), seed=0)


@pytest.fixture(scope="module")
def tok(model_dir):
    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def policy(model_dir):
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture
def thread(model_dir, tok):
    with RolloutEngineThread(HFBackend(model_dir, tok, device="cpu", dtype="float32")) as engine:
        yield engine


@pytest.fixture
def generator(monkeypatch):
    """OpenRLHF's own ``SamplesGenerator`` (its row -> Experience step needs no state)."""
    module = samples_generator(monkeypatch)
    return module.SamplesGenerator.__new__(module.SamplesGenerator)


def openrlhf_params(**overrides):
    """What ``SamplesGenerator._dispatch_prompts_to_vllm`` builds (``--max_new_tokens`` unset,
    importance-sampling correction on, so ``logprobs=1``)."""
    base = dict(temperature=TEMPERATURE, top_p=1.0, top_k=-1, max_tokens=None, min_tokens=1,
                skip_special_tokens=False, logprobs=1)
    return SamplingParams(**{**base, **overrides})


class TwoTurns(AgentInstanceBase):
    """Reward 1 then 2; feedback text after each turn; done after the second."""

    def __init__(self, *args, **kwargs):
        self.turn = 0

    async def step(self, states, **kwargs):
        self.turn += 1
        return {"rewards": torch.tensor(float(self.turn)), "scores": torch.tensor(float(self.turn)),
                "environment_feedback": FEEDBACK, "done": self.turn >= 2}


def check_experience(exp, row, tok, policy, *, versions: set[int], feedback: bool, min_tokens_masked: bool = True):
    """The Experience OpenRLHF builds from ``row``: tokens, action mask, logprobs (vs OpenRLHF's
    recomputation, 1e-4), versions."""
    tokens = row["observation_tokens"][:MAX_LEN]
    assert exp.sequences.shape == (1, len(tokens)) and exp.sequences[0].tolist() == tokens
    assert exp.action_mask.shape == (1, len(tokens) - 1)
    mask = torch.zeros(len(tokens), dtype=torch.long)
    for start, end in row["action_ranges"]:
        mask[start:end] = 1
    assert exp.action_mask[0].tolist() == mask[1:].tolist()
    if feedback:  # between two actions: the feedback's own tokens, not trained
        fb = tok(text=FEEDBACK, add_special_tokens=False)["input_ids"]
        (_, end0), (start1, _) = row["action_ranges"][:2]
        assert row["observation_tokens"][end0:start1] == fb
    assert exp.rollout_log_probs.shape == exp.action_mask.shape
    behaviour = exp.rollout_log_probs[0]
    assert torch.all(behaviour[exp.action_mask[0] == 0] == 0)
    recomputed, dist = openrlhf_logprobs(policy, exp, TEMPERATURE, full=True)
    recomputed = recomputed[0].clone()
    if min_tokens_masked:
        # OpenRLHF always sends min_tokens=1: at the first token of each turn the engine samples with
        # EOS masked, and its (processed) logprob is of that distribution: log p - log(1 - p_eos)
        for start, _ in row["action_ranges"]:
            if start - 1 < len(recomputed):
                recomputed[start - 1] -= torch.log1p(-dist[0, start - 1, tok.eos_token_id].exp())
    on = exp.action_mask[0].bool()
    assert on.any() and (recomputed - behaviour)[on].abs().max().item() < 1e-4
    want = [-1] * len(row["observation_tokens"])
    for start, end in row["action_ranges"]:
        want[start:end] = row["rollout_versions"][start:end]
    assert row["rollout_versions"] == want
    assert {row["rollout_versions"][i] for i in range(len(tokens)) if mask[i]} == versions


@pytest.mark.parametrize("min_tokens", [1, 0])
def test_multi_turn_executor_rows_become_openrlhf_experiences(thread, tok, policy, generator, min_tokens):
    llm = OpenRLHFEngine(thread, tok, OpenRLHFConfig(max_model_len=MAX_LEN), executor=MultiTurnAgentExecutor(TwoTurns))
    rows = asyncio.run(llm.generate_responses("what is 2+3?", "5", openrlhf_params(min_tokens=min_tokens), MAX_LEN,
                                              tok, num_samples=4))
    assert len(rows) == 4
    two_turns = 0
    for row in rows:
        assert row["prompt"] == "what is 2+3?" and row["label"] == "5"
        exp = generator._process_response_into_experience(row, max_len=MAX_LEN)
        turns = len(row["action_ranges"])
        two_turns += turns == 2
        assert exp.rewards.item() == sum(range(1, turns + 1))
        check_experience(exp, row, tok, policy, versions={0}, feedback=turns == 2, min_tokens_masked=min_tokens == 1)
    assert two_turns >= 1, "no row reached its second turn: the feedback check never ran"
    stats = llm.statistics()
    assert stats.samples == 4 and stats.attempts_failed == 0 and stats.generating == 0
    assert stats.generate_calls == sum(len(r["action_ranges"]) for r in rows)


def write_reward_file(tmp_path, *, fail_first: bool):
    path = tmp_path / "reward.py"
    path.write_text(f'''
calls = 0


def reward_func(queries, prompts, labels):
    global calls
    calls += 1
    if {fail_first!r} and calls == 1:
        raise RuntimeError("reward service hiccup")
    return {{"rewards": float(len(queries[0]) % 5), "scores": 1.0, "extra_logs": {{"length": float(len(queries[0]))}}}}
''')
    return str(path)


def test_single_turn_executor_with_a_reward_function_file(thread, tok, policy, generator, tmp_path):
    llm = OpenRLHFEngine(thread, tok, OpenRLHFConfig(max_model_len=MAX_LEN),
                         executor=SingleTurnAgentExecutor(write_reward_file(tmp_path, fail_first=False)))
    rows = asyncio.run(llm.generate_responses("hello", "x", openrlhf_params(max_tokens=12, ignore_eos=True),
                                              MAX_LEN, tok, num_samples=2))
    for row in rows:
        query = tok.decode(row["observation_tokens"], skip_special_tokens=False)
        assert row["reward"] == float(len(query) % 5) and row["extra_logs"] == {"length": float(len(query))}
        (start, end), = row["action_ranges"]
        assert end - start == 12 and row["truncated"] is True  # finish_reason "length"
        exp = generator._process_response_into_experience(row, max_len=MAX_LEN)
        assert exp.truncated.item() is True and exp.info["length"].item() == float(len(query))
        check_experience(exp, row, tok, policy, versions={0}, feedback=False, min_tokens_masked=False)


def test_a_reward_that_fails_once_is_run_again_not_a_row_without_reward(thread, tok, tmp_path):
    """OpenRLHF's SingleTurnAgentExecutor turns a failing reward into ``reward=None`` (logged at
    INFO); the adapter runs that sample again, so the group stays whole and every row is scored."""
    executor = SingleTurnAgentExecutor(write_reward_file(tmp_path, fail_first=True))
    unguarded = OpenRLHFEngine(thread, tok, OpenRLHFConfig(max_model_len=MAX_LEN, require_reward=False),
                               executor=executor)
    params = openrlhf_params(max_tokens=6, ignore_eos=True)
    rows = asyncio.run(unguarded.generate_responses("p", "l", params, MAX_LEN, tok, num_samples=1))
    assert rows[0]["reward"] is None  # the pitfall, as OpenRLHF has it

    executor = SingleTurnAgentExecutor(write_reward_file(tmp_path, fail_first=True))
    llm = OpenRLHFEngine(thread, tok, OpenRLHFConfig(max_model_len=MAX_LEN), executor=executor)
    rows = asyncio.run(llm.generate_responses("p", "l", params, MAX_LEN, tok, num_samples=3))
    assert len(rows) == 3 and all(r["reward"] is not None for r in rows)
    assert llm.statistics().attempts_failed == 1 and llm.statistics().samples == 3


def test_versions_follow_a_weight_update(thread, tok, policy, model_dir, generator):
    llm = OpenRLHFEngine(thread, tok, OpenRLHFConfig(max_model_len=MAX_LEN), executor=MultiTurnAgentExecutor(TwoTurns))
    params = openrlhf_params(max_tokens=10)
    before = asyncio.run(llm.generate_responses("v", "l", params, MAX_LEN, tok, num_samples=2))
    trained = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        for p in trained.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(1)))
    # what OpenRLHF's broadcast_to_vllm sends: named_parameters() (no tied lm_head.weight)
    assert asyncio.run(llm.update_weights({n: p.detach().clone() for n, p in trained.named_parameters()})) == 1
    assert asyncio.run(llm.get_version()) == 1
    after = asyncio.run(llm.generate_responses("v", "l", params, MAX_LEN, tok, num_samples=2))
    for row in before:
        check_experience(generator._process_response_into_experience(row, max_len=MAX_LEN), row, tok, policy,
                         versions={0}, feedback=len(row["action_ranges"]) == 2)
    for row in after:
        exp = generator._process_response_into_experience(row, max_len=MAX_LEN)
        check_experience(exp, row, tok, trained, versions={1}, feedback=len(row["action_ranges"]) == 2)
        on = exp.action_mask[0].bool()
        stale = openrlhf_logprobs(policy, exp, TEMPERATURE)[0]
        assert (stale - exp.rollout_log_probs[0])[on].abs().max().item() > 1e-3  # the old weights would not match
    assert llm.statistics().weight_syncs == 1 and llm.statistics().version == 1


class FailsFirstStep(TwoTurns):
    failures = 0
    limit = 1

    async def step(self, states, **kwargs):
        if type(self).failures < type(self).limit:
            type(self).failures += 1
            raise ValueError("environment crashed")
        return await super().step(states, **kwargs)


def test_groups_stay_whole_and_aligned_when_an_agent_step_fails_once(thread, tok):
    class Agent(FailsFirstStep):
        failures, limit = 0, 1

    llm = OpenRLHFEngine(thread, tok, OpenRLHFConfig(max_model_len=MAX_LEN), executor=MultiTurnAgentExecutor(Agent))
    params = openrlhf_params(max_tokens=8)

    async def both():
        return await asyncio.gather(*(llm.generate_responses(f"prompt {i}", f"label {i}", params, MAX_LEN, tok,
                                                             num_samples=3) for i in range(2)))

    groups = asyncio.run(both())
    assert [len(g) for g in groups] == [3, 3]
    for i, group in enumerate(groups):
        assert all(r["prompt"] == f"prompt {i}" and r["label"] == f"label {i}" for r in group)
        assert all(r["reward"] >= 1 for r in group)
    assert Agent.failures == 1 and llm.statistics().attempts_failed == 1 and llm.statistics().samples == 6


def test_a_backend_request_that_fails_once_is_run_again(model_dir, tok):
    class FlakyHF(HFBackend):
        failed = False

        async def generate(self, request, budget):
            if not FlakyHF.failed:
                FlakyHF.failed = True
                raise BackendError("injected: the server dropped the request")
            return await super().generate(request, budget)

    with RolloutEngineThread(FlakyHF(model_dir, tok, device="cpu", dtype="float32")) as engine:
        llm = OpenRLHFEngine(engine, tok, OpenRLHFConfig(max_model_len=MAX_LEN),
                             executor=MultiTurnAgentExecutor(TwoTurns))
        rows = asyncio.run(llm.generate_responses("b", "l", openrlhf_params(max_tokens=6), MAX_LEN, tok,
                                                  num_samples=2))
    assert FlakyHF.failed and len(rows) == 2 and all(r["action_ranges"] for r in rows)
    assert llm.statistics().attempts_failed == 1


def test_a_sample_failing_every_attempt_raises_naming_the_prompt(thread, tok):
    class Agent(FailsFirstStep):
        failures, limit = 0, 10**6

    llm = OpenRLHFEngine(thread, tok, OpenRLHFConfig(max_model_len=MAX_LEN, max_attempts=2),
                         executor=MultiTurnAgentExecutor(Agent))
    with pytest.raises(IncompleteGroupError, match="'doomed prompt'.*ValueError: environment crashed") as info:
        asyncio.run(llm.generate_responses("doomed prompt", "l", openrlhf_params(max_tokens=4), MAX_LEN, tok,
                                           num_samples=2))
    assert len(info.value.reasons) == 2 and Agent.failures == 4
    assert llm.statistics().samples_given_up == 2 and llm.statistics().samples == 0

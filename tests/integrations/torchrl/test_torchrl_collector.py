"""Integration tier (torchrl 0.14.1, tensordict 0.14.3; its own venv): torchrl's own
``LLMCollector`` and ``ChatEnv``, unmodified, generating through
``engine.integrations.torchrl.EngineWrapper`` on the tiny random Llama behind the in-process
``hf`` backend, scoring through ``EngineReward`` in the engine's reward pool, and updating
weights through ``collector.update_policy_weights_``.

Checked: torchrl's collector template (``test/llm/test_llm_collectors.py::_run_collector_test``)
for several batches; the output fields equal to torchrl's own ``TransformersWrapper`` on the
same prompts (greedy, every input mode); the engine's log-probs equal to torchrl's own scorer
(``TransformersWrapper(generate=False, return_log_probs=True)``) within 1e-4, over a
multi-turn ChatEnv too; token versions (and torchrl's ``policy_version``) after each weight
update, with log-probs of the updated weights; rows in order when a backend request or a
reward fails once; a row that keeps failing, named; a trio-native engine.

Run: ``make test-integrations INTEGRATIONS=torchrl`` (or
``.venv-torchrl/bin/python -m pytest tests/integrations/torchrl -q -p no:cacheprovider``).
"""

from __future__ import annotations

import copy

import pytest

pytest.importorskip("torchrl", reason="needs the torchrl venv: make test-integrations")

import torch  # noqa: E402
import trio  # noqa: E402
from tensordict import set_list_to_stack  # noqa: E402
from torchrl.collectors.llm import LLMCollector  # noqa: E402
from torchrl.data import LazyStackStorage, ReplayBuffer  # noqa: E402
from torchrl.envs import StepCounter  # noqa: E402
from torchrl.envs.llm import ChatEnv  # noqa: E402
from torchrl.modules.llm import TransformersWrapper  # noqa: E402
from torchrl.testing import DummyStrDataLoader  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from engine import EngineConfig, HFBackend, RolloutEngineThread, open_rollout_engine  # noqa: E402
from engine.errors import BackendError, InvalidRequestError  # noqa: E402
from engine.integrations.torchrl import (  # noqa: E402
    EngineReward, EngineWeightUpdater, EngineWrapper, TorchRLConfig)
from engine.testing import InProcessRewardPool, build_tiny_model  # noqa: E402

pytestmark = [
    # torchrl 0.14.1's own warnings, raised the same with its TransformersWrapper:
    # LLMCollector -> Collector asks every nn.Module policy for an InitTracker (not an LLM's need)
    pytest.mark.filterwarnings("ignore:The env passed to LLMCollector is missing transforms:FutureWarning"),
    # its scorer calls F.cross_entropy(reduce=False)
    pytest.mark.filterwarnings("ignore:size_average and reduce args will be deprecated:UserWarning"),
    # its collector template's 10 dialog turns over batches of 4
    pytest.mark.filterwarnings("ignore:total_frames .* is not exactly divisible:UserWarning"),
]

B = 4
GREEDY = {"max_new_tokens": 8, "do_sample": False}


@pytest.fixture(scope="module", autouse=True)
def _list_to_stack():
    with set_list_to_stack(True):  # as torchrl's own LLM tests (test_llm_collectors.py)
        yield


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("torchrl") / "tiny")


@pytest.fixture(scope="module")
def tok(tiny):
    return AutoTokenizer.from_pretrained(tiny)


@pytest.fixture(scope="module")
def model(tiny):
    return AutoModelForCausalLM.from_pretrained(tiny).eval()


class FlakyHF(HFBackend):
    """The hf backend, whose next ``fail`` generate calls raise :class:`BackendError`
    (``fail_prompt``: only requests whose prompt ends with those ids)."""

    fail = 0
    fail_prompt: list[int] | None = None

    async def generate(self, request, budget):
        tail = self.fail_prompt
        if self.fail and (tail is None or request.input_ids[-len(tail):] == tail):
            self.fail -= 1
            raise BackendError("injected: the server dropped the request")
        return await super().generate(request, budget)


@pytest.fixture(scope="module")
def backend(tiny, tok):
    return FlakyHF(tiny, tok, device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def engine(backend):
    """Never updated: its weights stay those of ``model`` (the reference of the comparisons)."""
    with RolloutEngineThread(backend, EngineConfig(), reward_pool=InProcessRewardPool()) as engine:
        yield engine


@pytest.fixture(autouse=True)
def _reset_faults(backend):
    backend.fail, backend.fail_prompt = 0, None


def chat_env(mode="history", batch_size=B, tok=None):
    return ChatEnv.from_dataloader(dataloader=DummyStrDataLoader(batch_size), batch_size=batch_size,
                                   group_repeats=True, input_mode=mode, tokenizer=tok)


def scorer(model, tok):
    """torchrl's own log-prob recomputation: the full sequence through the model."""
    return TransformersWrapper(model, tokenizer=tok, input_mode="tokens", generate=False, return_log_probs=True)


def max_logprob_gap(data, model, tok):
    """max |engine log-prob - torchrl scorer log-prob| over every response token of ``data``."""
    flat = data.reshape(-1)
    scored = scorer(model, tok)(flat.select(("tokens", "full")).copy())
    gap = 0.0
    for full_lp, resp_lp in zip(scored.get(("log_probs", "full"), as_list=True),
                                flat.get(("log_probs", "response"), as_list=True)):
        n = resp_lp.numel()
        assert n > 0
        gap = max(gap, (full_lp[-n:] - resp_lp).abs().max().item())
    return gap


def as_lists(td, key):
    return [t.tolist() for t in td.get(key, as_list=True)]


# -- torchrl's own collector template ------------------------------------------------------------
@pytest.mark.parametrize("rb", [False, True], ids=["yield", "replay_buffer"])
def test_llm_collector_template_runs_on_the_engine(engine, tok, model, rb):
    """torchrl's ``_run_collector_test`` (history ChatEnv, B=4, 10 dialog turns), policy swapped."""
    total_steps = 10
    policy = EngineWrapper(engine, tokenizer=tok, generate_kwargs={"max_new_tokens": 8})
    env = chat_env()
    buffer = ReplayBuffer(storage=LazyStackStorage(max_size=total_steps * 2)) if rb else None
    collector = LLMCollector(env=env, policy_factory=lambda: policy, dialog_turns_per_batch=env.batch_size[0],
                             replay_buffer=buffer, total_dialog_turns=total_steps)
    stack = []
    for data in collector:
        if buffer is not None:
            assert data is None
        else:
            stack.append(data)
    if buffer is not None:
        assert len(buffer) >= total_steps
        sample = buffer.sample(4)
        assert sample.shape == (4,)
        assert not sample._has_exclusive_keys
        assert len(sample["text", "prompt"]) == 4
        for i in range(4):
            assert len(sample["history", "prompt"][i]) < len(sample["next", "history", "prompt"][i])
        data = sample
    else:
        stack = torch.cat(stack)
        assert not stack._has_exclusive_keys
        assert stack.numel() == max(-(total_steps // -4) * 4, 4)
        data = stack = stack.view(-1)
        for i in range(stack.numel()):
            assert len(stack["history", "prompt"][i]) < len(stack["next", "history", "prompt"][i])
    assert collector._frames >= total_steps
    assert policy.statistics().calls == -(total_steps // -B)  # one engine hop per env step, B rows each
    for tokens, lps, versions in zip(data.get(("tokens", "response"), as_list=True),
                                     data.get(("log_probs", "response"), as_list=True),
                                     data.get(("engine", "versions"), as_list=True)):
        assert tokens.shape == lps.shape == versions.shape and tokens.dtype == torch.int64
        assert lps.dtype == torch.float32 and versions.tolist() == [0] * len(versions)
    assert max_logprob_gap(data, model, tok) < 1e-4


# -- the same fields as torchrl's own wrapper ------------------------------------------------------
@pytest.mark.parametrize("mode,pad_output", [("history", False), ("history", True), ("text", False),
                                             ("tokens", False)])
def test_outputs_equal_torchrls_transformers_wrapper(engine, tok, model, mode, pad_output):
    env = chat_env(mode, tok=tok)
    td = env.reset()
    kw = dict(tokenizer=tok, input_mode=mode, pad_output=pad_output, return_log_probs=True)
    ours = EngineWrapper(engine, generate_kwargs=GREEDY, **kw)(td.clone())
    theirs = TransformersWrapper(model, generate=True, generate_kwargs=GREEDY, **kw)(td.clone())

    def keys(t):
        return {k for k in t.keys(True, True, is_leaf=lambda c: not hasattr(c, "keys")) if k[0] != "engine"}

    assert keys(ours) == keys(theirs)
    for key in sorted(keys(theirs), key=str):
        a, b = ours.get(key, as_list=True), theirs.get(key, as_list=True)
        if key == ("log_probs", "response"):  # torchrl's generate sets the first one to 0; ours is the real one
            real = [r != tok.pad_token_id for r in theirs.get(("tokens", "response"), as_list=True)]
            for x, y, m in zip(a, b, real):  # (padded: torchrl's values on pad tokens are junk, ours are 0)
                assert x.shape == y.shape and x.dtype == y.dtype
                assert (x[1:][m[1:]] - y[1:][m[1:]]).abs().max() < 1e-4
        elif isinstance(b, list) and b and isinstance(b[0], torch.Tensor):
            assert [(x.dtype, x.tolist()) for x in a] == [(y.dtype, y.tolist()) for y in b], key
        elif isinstance(b, torch.Tensor):
            assert a.dtype == b.dtype and a.tolist() == b.tolist(), key
        else:
            assert _plain(a) == _plain(b), key
    assert len(_plain(ours["engine", "stop_reason"])) == B
    assert set(_plain(ours["engine", "stop_reason"])) <= {"stop", "length"}


def _plain(v):
    if hasattr(v, "tolist"):
        v = v.tolist()
    if isinstance(v, (list, tuple)) or type(v).__name__ == "LinkedList":
        return [_plain(x) for x in v]
    return v


# -- multi-turn ChatEnv, rewards in the engine's pool -----------------------------------------------
def answer_reward(prompt, completions, prompt_ids, completion_ids, answer, **data):
    """Depends on the row's own dataset ``answer`` and completion: a misaligned row would show."""
    return float(int(answer) * 100 + len(completion_ids))


def qa_loader(n=32):
    """A dataset of ``{"query", "answer"}`` rows (torch's default collate: torchrl's
    DataLoadingPrimer carries every column into the env's tensordict)."""
    rows = [{"query": f"question {i}?", "answer": str(i)} for i in range(n)]
    return torch.utils.data.DataLoader(rows, batch_size=B, shuffle=False)


def test_multi_turn_chat_env_with_engine_reward(engine, tok, model):
    turns = 3
    policy = EngineWrapper(engine, tokenizer=tok, generate_kwargs={"max_new_tokens": 6})
    reward = EngineReward(engine, answer_reward, data_keys=["answer"])
    env = ChatEnv.from_dataloader(dataloader=qa_loader(), batch_size=B, group_repeats=True)
    env = env.append_transform(StepCounter(max_steps=turns)).append_transform(reward)
    collector = LLMCollector(env=env, policy=policy, dialog_turns_per_batch=B * turns, total_dialog_turns=B * turns,
                             yield_completed_trajectories=True)
    data = torch.cat(list(collector))
    assert data.numel() == B * turns
    by_query: dict[str, list] = {}
    for step in data.reshape(-1).unbind(0):
        by_query.setdefault(step["query"], []).append(step)
    assert len(by_query) == B and all(len(v) == turns for v in by_query.values())  # B dialogs of 3 turns
    for query, steps in by_query.items():
        steps.sort(key=lambda s: int(s["next", "step_count"]))
        for t, step in enumerate(steps):
            full, prompt = step["history", "full"], step["history", "prompt"]
            assert _plain(full.role)[-1] == "assistant" and len(_plain(full.role)) > len(_plain(prompt.role))
            assert step["answer"] == query.split()[1].rstrip("?")
            expected = answer_reward(None, None, None, step["tokens", "response"].tolist(), answer=step["answer"])
            assert step["next", "reward"].item() == expected and not step["next", "reward_fallback"].item()
            if t + 1 < turns:  # ChatEnv: this turn's full history is the next turn's prompt
                assert _plain(steps[t + 1]["history", "prompt"].content) == _plain(full.content)
        assert bool(steps[-1]["next", "done"].item()) and int(steps[-1]["next", "step_count"]) == turns
    assert reward.statistics().rows == B * turns and reward.statistics().fallbacks == 0
    assert max_logprob_gap(data, model, tok) < 1e-4


# -- weight updates -------------------------------------------------------------------------------
@pytest.mark.parametrize("how", ["auto", "explicit"])
def test_versions_follow_update_policy_weights(tiny, tok, model, how):
    trainer = copy.deepcopy(model)
    backend = HFBackend(tiny, tok, device="cpu", dtype="float32")
    with RolloutEngineThread(backend, EngineConfig(), reward_pool=InProcessRewardPool()) as engine:
        policy = EngineWrapper(engine, tokenizer=tok, model=trainer, generate_kwargs={"max_new_tokens": 6})
        extra = {}
        if how == "explicit":
            extra["weight_updater"] = EngineWeightUpdater(engine, source=trainer)
        with pytest.warns(DeprecationWarning, match="WeightUpdaterBase is deprecated") if extra else _nothing():
            collector = LLMCollector(env=chat_env(), policy=policy, dialog_turns_per_batch=B,
                                     total_dialog_turns=3 * B, track_policy_version=True, **extra)
        assert isinstance(collector.weight_updater, EngineWeightUpdater)
        for i, data in enumerate(collector):
            data = data.reshape(-1)
            assert [set(v.tolist()) for v in data.get(("engine", "versions"), as_list=True)] == [{i}] * B
            assert data["next", "policy_version"].reshape(-1).tolist() == [i] * B  # torchrl's own tag agrees
            assert max_logprob_gap(data, trainer, tok) < 1e-4  # generated with the trainer's current weights
            with torch.no_grad():
                for p in trainer.parameters():
                    p.add_(0.05 * torch.randn_like(p))
            if i % 2:
                collector.update_policy_weights_(trainer)
            else:
                collector.update_policy_weights_()  # the updater's source: the trainer's model
            assert engine.version == collector.policy_version == i + 1
        assert collector.weight_updater.updates == 3


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def test_scorer_from_get_new_version_is_torchrls(engine, tok, model):
    policy = EngineWrapper(engine, tokenizer=tok, model=model, generate_kwargs={"max_new_tokens": 6})
    actor = policy.get_new_version(generate=False, input_mode="tokens")
    assert type(actor) is TransformersWrapper and actor.model is model and not actor.generate
    data = policy(chat_env().reset())
    scored = actor(data.select(("tokens", "full")).copy())
    for full_lp, resp_lp in zip(scored.get(("log_probs", "full"), as_list=True),
                                data.get(("log_probs", "response"), as_list=True)):
        assert (full_lp[-resp_lp.numel():] - resp_lp).abs().max() < 1e-4
    again = policy.get_new_version(pad_output=True)
    assert isinstance(again, EngineWrapper) and again.engine is engine and again.pad_output
    with pytest.raises(ValueError, match="no model to score with"):
        EngineWrapper(engine, tokenizer=tok).get_new_version(generate=False)


# -- failures: rows stay aligned -----------------------------------------------------------------
def test_rows_stay_aligned_when_a_backend_request_fails_once(engine, backend, tok, model):
    td = chat_env().reset()
    reference = TransformersWrapper(model, tokenizer=tok, generate=True, generate_kwargs=GREEDY)(td.clone())
    policy = EngineWrapper(engine, tokenizer=tok, generate_kwargs=GREEDY)
    third = as_lists(reference, ("tokens", "prompt"))[2]
    backend.fail, backend.fail_prompt = 1, third  # only row 2's request fails, once
    out = policy(td.clone())
    assert backend.fail == 0 and policy.statistics().rows_retried == 1
    assert as_lists(out, ("tokens", "prompt")) == as_lists(reference, ("tokens", "prompt"))
    assert as_lists(out, ("tokens", "response")) == as_lists(reference, ("tokens", "response"))
    assert _plain(out["text", "response"]) == _plain(reference["text", "response"])


def test_a_row_that_keeps_failing_is_named_and_the_call_raises(engine, backend, tok):
    policy = EngineWrapper(engine, tokenizer=tok, generate_kwargs=GREEDY, config=TorchRLConfig(max_attempts=2))
    td = chat_env().reset()
    row1 = policy(td.clone()).get(("tokens", "prompt"), as_list=True)[1].tolist()
    backend.fail, backend.fail_prompt = 5, row1
    with pytest.raises(BackendError, match=r"row 1 failed 2 attempt\(s\); last: BackendError: injected") as info:
        policy(td.clone())
    assert isinstance(info.value.__cause__, BackendError)
    assert backend.fail == 3


def flaky_reward_factory():
    failed = []

    async def flaky(prompt, completions, prompt_ids, completion_ids, answer, **data):
        if not failed:  # the first call (some row's first attempt)
            failed.append(answer)
            raise RuntimeError("injected: the verifier crashed once")
        return answer_reward(prompt, completions, prompt_ids, completion_ids, answer=answer)

    return flaky, failed


def test_rows_stay_aligned_when_a_reward_fails_once_in_the_reward_pool(tiny, tok):
    """The engine's own reward pool (retries; async rewards run in-process under its policy)."""
    backend = HFBackend(tiny, tok, device="cpu", dtype="float32")
    with RolloutEngineThread(backend, EngineConfig(reward_max_retries=1)) as engine:
        flaky, failed = flaky_reward_factory()
        env = ChatEnv.from_dataloader(dataloader=qa_loader(), batch_size=B, group_repeats=True)
        env = env.append_transform(EngineReward(engine, flaky, data_keys=["answer"], done_on_reward=True))
        collector = LLMCollector(env=env, policy=EngineWrapper(engine, tokenizer=tok, generate_kwargs=GREEDY),
                                 dialog_turns_per_batch=B, total_dialog_turns=B)
        data = next(iter(collector)).reshape(-1)
        assert len(failed) == 1 and failed[0] in [data[i]["answer"] for i in range(B)]  # it failed, was retried
        for i in range(B):
            want = answer_reward(None, None, None, data[i]["tokens", "response"].tolist(), answer=data[i]["answer"])
            assert data[i]["next", "reward"].item() == want
        assert data["next", "done"].all()
        assert engine.statistics().rewards.calls == B


def test_a_hung_reward_is_killed_and_flagged_as_fallback(tiny, tok):
    """A sync reward runs in a worker process; past the timeout the worker is killed and the
    row's reward is the pool's fallback, flagged in ``reward_fallback``."""
    backend = HFBackend(tiny, tok, device="cpu", dtype="float32")
    config = EngineConfig(reward_timeout_seconds=1.0, reward_max_retries=0, reward_max_workers=1)
    with RolloutEngineThread(backend, config) as engine:
        env = chat_env(batch_size=1).append_transform(
            EngineReward(engine, "reward_fixtures:sleep_forever", done_on_reward=True))
        collector = LLMCollector(env=env, policy=EngineWrapper(engine, tokenizer=tok, generate_kwargs=GREEDY),
                                 dialog_turns_per_batch=1, total_dialog_turns=1)
        data = next(iter(collector)).reshape(-1)
        assert data["next", "reward_fallback"].tolist() == [[True]] and data["next", "reward"].tolist() == [[0.0]]
        stats = engine.statistics().rewards
        assert stats.fallbacks == 1 and stats.timeouts >= 1


# -- a trio-native engine -------------------------------------------------------------------------
async def test_collector_in_a_worker_thread_of_a_trio_native_engine(tiny, tok, model):
    backend = HFBackend(tiny, tok, device="cpu", dtype="float32")
    async with open_rollout_engine(backend, EngineConfig(), reward_pool=InProcessRewardPool()) as engine:
        policy = EngineWrapper(engine, tokenizer=tok, generate_kwargs=GREEDY)

        def collect():
            collector = LLMCollector(env=chat_env(), policy=policy, dialog_turns_per_batch=B, total_dialog_turns=2 * B)
            return torch.cat(list(collector))

        data = await trio.to_thread.run_sync(collect)
        with pytest.raises(RuntimeError, match="called on a trio thread"):
            policy(chat_env().reset())
    assert data.numel() == 2 * B
    assert max_logprob_gap(data, model, tok) < 1e-4


def test_bad_setups_raise_one_clear_error(engine, tok):
    with pytest.raises(ValueError, match="score with torchrl's own"):
        EngineWrapper(engine, tokenizer=tok, generate=False)
    with pytest.raises(ValueError, match="pass tokenizer="):
        EngineWrapper(engine, tokenizer=None)
    with pytest.raises(ValueError, match=r"num_samples=\.\.\.\): not supported"):
        EngineWrapper(engine, tokenizer=tok, num_samples=2)
    with pytest.raises(InvalidRequestError, match="num_beams"):
        EngineWrapper(engine, tokenizer=tok, generate_kwargs={"num_beams": 2})
    policy = EngineWrapper(engine, tokenizer=tok, generate_kwargs=GREEDY)
    with pytest.raises(InvalidRequestError, match="per-call generation arguments"):
        policy(chat_env().reset(), max_new_tokens=3)

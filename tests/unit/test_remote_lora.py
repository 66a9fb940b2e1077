"""Unit tier, virtual time: LoRA adapters on the remote backends against fake vLLM and
SGLang servers: versioned names loaded from fresh folders, traffic moved, old names
unloaded only once drained and their folders removed after, the clear errors."""

from __future__ import annotations

import os

import pytest
import torch
import trio
import trio.testing

from engine import BackendError, InvalidRequestError, ModelRequest, open_rollout_engine
from engine.backends.lora import AdapterWeights, write_adapter
from engine.backends.remote import make_remote_backend
from engine.types import GenerationHyperparameters
from fake_servers import FakeSGLang, FakeVLLM, fake_tokens, mock_transport

A, B = "http://fake-a:1", "http://fake-b:1"
G = GenerationHyperparameters(max_new_tokens=4)


def _adapter(tmp_path, name, *, rank=8, base="tiny"):
    tensors = {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.ones(rank, 4),
               "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": torch.zeros(4, rank)}
    config = {"r": rank, "lora_alpha": 16, "peft_type": "LORA", "target_modules": ["q_proj"],
              "base_model_name_or_path": base}
    return write_adapter(AdapterWeights(config, tensors), tmp_path / name)


def _backend(kind, fakes, tmp_path, **kwargs):
    return make_remote_backend(kind, list(fakes), transport=mock_transport(fakes), lora_dir=str(tmp_path / "served"),
                               **kwargs)


def _lora_calls(fake):
    return [(what, body["lora_name"]) for what, body in fake.control if what in ("load_lora", "unload_lora")]


@pytest.mark.parametrize("kind", ["vllm", "sglang"])
async def test_rollouts_sample_the_adapter_and_an_update_moves_traffic_then_unloads(kind, tmp_path, reward_pool):
    fake = FakeVLLM() if kind == "vllm" else FakeSGLang()
    v0, v1 = _adapter(tmp_path, "v0"), _adapter(tmp_path, "v1")
    async with open_rollout_engine(_backend(kind, {A: fake}, tmp_path, lora=v0), reward_pool=reward_pool) as engine:
        first = await engine.agenerate(ModelRequest(input_ids=[1, 2, 3], gconfig=G))
        served_v0 = fake.loras["lora-v0"]
        assert served_v0 != str(v0) and served_v0.startswith(str(tmp_path / "served"))  # a copy of its own
        await engine.update_weights(v1, version=1)
        await engine.backend.adapters.drained()
        second = await engine.agenerate(ModelRequest(input_ids=[1, 2, 3], gconfig=G, lora_name="lora"))
        served_v1 = fake.loras["lora-v1"]
        lora = engine.statistics().backend.lora
        assert list(fake.loras) == ["lora-v1"] and lora.loaded == ("lora-v1",) and lora.unloads == 1
        assert not (tmp_path / "served").joinpath(served_v0).exists()  # removed after its unload
        with pytest.raises(InvalidRequestError, match="'other' is not an adapter"):
            await engine.agenerate(ModelRequest(input_ids=[1], gconfig=G, lora_name="other"))
    assert _lora_calls(fake) == [("load_lora", "lora-v0"), ("load_lora", "lora-v1"), ("unload_lora", "lora-v0"),
                                 ("unload_lora", "lora-v1")]  # the last on close
    lora = engine.backend.statistics().lora  # what a run's summary reads, after the close
    assert lora.loaded == () and lora.last_served == {"lora": "lora-v1"}
    assert fake.adapter_requests[:2] == ["lora-v0", "lora-v1"] and not fake.broken
    assert first.output_versions == [0] * 4 and second.output_versions == [1] * 4
    # each version samples its own weights (not "the tokens differ": two random folders collide 1 in 200)
    assert first.output_tokens == fake_tokens([1, 2, 3], 4, weights=served_v0)[0]
    assert second.output_tokens == fake_tokens([1, 2, 3], 4, weights=served_v1)[0] and served_v1 != served_v0
    assert list((tmp_path / "served").iterdir()) == [] and v0.exists() and v1.exists()  # the user's folders stay


async def test_a_version_with_a_request_in_flight_is_unloaded_only_when_it_returns(tmp_path, reward_pool):
    # Real clock, on purpose: the adapter is read and written in worker threads, and an
    # autojump clock jumps while they run (every trio task is blocked), past the hanging
    # request's attempt timeout: the request was retried and the test saw it drained.
    fake = FakeVLLM()
    fake.script = ["hang"]
    backend = _backend("vllm", {A: fake}, tmp_path, lora=_adapter(tmp_path, "v0"))
    async with open_rollout_engine(backend, reward_pool=reward_pool) as engine:
        result = {}

        async def long_request():
            result["r"] = await engine.agenerate(ModelRequest(input_ids=[7, 8], gconfig=G))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(long_request)
            await trio.testing.wait_all_tasks_blocked()
            # the backend's own update (no engine pause): the hanging request still samples lora-v0
            await backend.update_weights(_adapter(tmp_path, "v1"), version=1)
            await trio.testing.wait_all_tasks_blocked()  # an unload, if scheduled, has run by now
            held = backend.statistics().lora
            assert held.loaded == ("lora-v0", "lora-v1") and held.in_flight == {"lora-v0": 1}
            assert list(fake.loras) == ["lora-v0", "lora-v1"] and ("unload_lora", "lora-v0") not in _lora_calls(fake)
            folder = fake.loras["lora-v0"]
            fake.hold.set()  # the request of lora-v0 returns ...
        await backend.adapters.drained()
        assert list(fake.loras) == ["lora-v1"] and ("unload_lora", "lora-v0") in _lora_calls(fake)  # ... then it goes
        assert not os.path.exists(folder)
    assert result["r"].output_versions == [0] * 4 and not fake.broken


async def test_an_update_mid_generation_resumes_on_the_new_version(tmp_path, reward_pool, autojump_clock):
    fake = FakeVLLM(length=6)
    fake.script, fake.partial_on_abort = ["hang"], 2
    backend = _backend("vllm", {A: fake}, tmp_path, lora=_adapter(tmp_path, "v0"))
    g = GenerationHyperparameters(max_new_tokens=6)
    async with open_rollout_engine(backend, reward_pool=reward_pool) as engine:
        result = {}

        async def one():
            result["r"] = await engine.agenerate(ModelRequest(input_ids=[3, 4], gconfig=g))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(one)
            await trio.testing.wait_all_tasks_blocked()
            await engine.update_weights(_adapter(tmp_path, "v1"), version=1)  # pause(abort): 2 tokens come back
        await backend.adapters.drained()
        assert list(fake.loras) == ["lora-v1"]
    r = result["r"]
    assert r.output_versions == [0, 0, 1, 1, 1, 1] and r.stop_reason == "length"
    assert [c["model"] for c in fake.generate_calls] == ["lora-v0", "lora-v1"]
    v0_tokens, _ = fake_tokens([3, 4], 2, weights=fake.control[0][1]["lora_path"])
    assert r.output_tokens[:2] == v0_tokens and not fake.broken


@pytest.mark.parametrize(("setup", "adapter", "message"), [
    ({"lora": False}, {}, r"runs without LoRA: restart it with --enable-lora --max-lora-rank 8 --max-loras 2 and "
                          r"the environment variable VLLM_ALLOW_RUNTIME_LORA_UPDATING=True"),
    ({}, {"rank": 16}, r"rank 16 is above the --max-lora-rank 8 of the vllm server http://fake-a:1: restart the "
                       r"server with --max-lora-rank 16"),
    ({}, {"base": "org/other-model"}, r"trained on base model 'org/other-model', but the vllm server .* serves 'tiny'"),
    ({"runtime_lora": False}, {}, r"VLLM_ALLOW_RUNTIME_LORA_UPDATING=True"),
])
async def test_a_server_that_cannot_take_the_adapter_fails_start_up_with_one_clear_error(setup, adapter, message,
                                                                                      tmp_path, reward_pool):
    fake = FakeVLLM()
    for key, value in setup.items():
        setattr(fake, key, value)
    backend = _backend("vllm", {A: fake}, tmp_path, lora=_adapter(tmp_path, "v0", **adapter))
    with pytest.raises(BackendError, match=message):
        async with open_rollout_engine(backend, reward_pool=reward_pool):
            pass
    assert fake.loras == {} and list((tmp_path / "served").glob("*/*")) == []


async def test_a_name_taken_on_the_server_is_named(tmp_path, reward_pool):
    fake = FakeVLLM()
    fake.loras["lora-v0"] = str(_adapter(tmp_path, "someone-else"))
    backend = _backend("vllm", {A: fake}, tmp_path, lora=_adapter(tmp_path, "v0"))
    with pytest.raises(BackendError, match="name 'lora' is in use on http://fake-a:1 by another client .*unload it") as err:
        async with open_rollout_engine(backend, reward_pool=reward_pool):
            pass
    # the fix in both spellings: the Python argument and the CLI flag (a new-user trial ran the CLI)
    assert "lora_name='tenant-a'" in str(err.value) and "--lora-name tenant-a on the CLI" in str(err.value)


async def test_full_weights_are_refused_while_an_adapter_is_served_and_a_plain_backend_takes_one(tmp_path,
                                                                                                reward_pool):
    fake = FakeVLLM()
    async with open_rollout_engine(_backend("vllm", {A: fake}, tmp_path), reward_pool=reward_pool) as engine:
        assert engine.statistics().backend.lora is None
        await engine.update_weights(_adapter(tmp_path, "v3"), version=3)  # the first adapter turns LoRA on
        with pytest.raises(BackendError, match="takes an adapter"):
            await engine.update_weights("/ckpt/full", version=4)
        with pytest.raises(BackendError, match="in_place"):
            await engine.update_weights(_adapter(tmp_path, "v4"), version=4, mode="in_place")
        r = await engine.agenerate(ModelRequest(input_ids=[1], gconfig=G))
    assert r.output_versions == [3] * 4 and fake.adapter_requests == ["lora-v3"]


async def test_a_server_that_missed_a_version_gets_it_before_readmission(tmp_path, reward_pool, autojump_clock):
    fakes = {A: FakeVLLM(), B: FakeVLLM()}
    backend = _backend("vllm", fakes, tmp_path, lora=_adapter(tmp_path, "v0"), health_interval_s=1.0)
    async with open_rollout_engine(backend, reward_pool=reward_pool) as engine:
        fakes[B].refuse = True
        await backend.check_health(eject_now=True)
        await engine.update_weights(_adapter(tmp_path, "v1"), version=1)
        await backend.adapters.drained()
        assert "lora-v1" not in fakes[B].loras and "lora-v0" in fakes[B].loras  # down: its v0 folder is kept
        assert engine.statistics().backend.lora.unload_failures == 0
        fakes[B].refuse = False
        await trio.sleep(5)  # a probe re-admits it, after loading the current version
        assert "lora-v1" in fakes[B].loras
        for _ in range(4):
            await engine.agenerate(ModelRequest(input_ids=[1, 2], gconfig=G, metadata={"routing_key": str(_)}))
    assert not any(f.broken for f in fakes.values())


async def test_an_update_cancelled_after_the_servers_loaded_it_leaves_nothing_behind(tmp_path, reward_pool):
    # A new-user trial: update_weights under trio.move_on_after left the new name loaded on the
    # server, unknown to the backend, and the next update failed ("in use by another client").
    fake = FakeVLLM()
    backend = _backend("vllm", {A: fake}, tmp_path, lora=_adapter(tmp_path, "v0"))
    async with open_rollout_engine(backend, reward_pool=reward_pool) as engine:
        adapters, scope = backend.adapters, trio.CancelScope()
        real = adapters._broadcast

        async def broadcast_then_cancelled(urls, method, path, body):
            answers = await real(urls, method, path, body)
            if body.get("lora_path"):  # the load answered: the caller is cancelled right then
                scope.cancel()
                await trio.lowlevel.checkpoint()
            return answers

        adapters._broadcast = broadcast_then_cancelled
        with scope:
            await engine.update_weights(_adapter(tmp_path, "v1"), version=1)
        assert scope.cancelled_caught
        assert list(fake.loras) == ["lora-v0"] and engine.statistics().backend.lora.loaded == ("lora-v0",)
        assert [p.name.startswith("lora-v0-") for p in (tmp_path / "served").iterdir()] == [True]  # v1's folder gone
        await engine.update_weights(_adapter(tmp_path, "v2"), version=1)  # the same version again: it loads
        await backend.adapters.drained()
        r = await engine.agenerate(ModelRequest(input_ids=[1, 2], gconfig=G))
    assert r.output_versions == [1] * 4 and not fake.broken

"""Unit tier: several LoRA tenants on one server (issue 29, "multi-tenant"): one engine per
tenant, each backend with its own ``lora_name``, against one fake vLLM / SGLang server
(in-process, ``httpx.MockTransport``).  A tenant's adapter update touches only its own
requests (no server-wide pause), each tenant's tokens carry its own versions, and two
tenants that would share an adapter name are one clear error."""

from __future__ import annotations

import pytest
import torch
import trio
import trio.testing

from engine import BackendError, ModelRequest, open_rollout_engine
from engine.backends.lora import AdapterWeights, write_adapter
from engine.backends.remote import make_remote_backend
from engine.types import GenerationHyperparameters
from fake_servers import FakeSGLang, FakeVLLM, fake_tokens, mock_transport

A = "http://fake-a:1"
G = GenerationHyperparameters(max_new_tokens=6)


def _adapter(tmp_path, name, *, rank=8):
    tensors = {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.ones(rank, 4),
               "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": torch.zeros(4, rank)}
    config = {"r": rank, "lora_alpha": 16, "peft_type": "LORA", "target_modules": ["q_proj"],
              "base_model_name_or_path": "tiny"}
    return write_adapter(AdapterWeights(config, tensors), tmp_path / name)


def _tenant(kind, fake, tmp_path, name, **kwargs):
    return make_remote_backend(kind, [A], transport=mock_transport({A: fake}), lora_dir=str(tmp_path / "served"),
                               lora=_adapter(tmp_path, f"{name}-start"), lora_name=name, **kwargs)


def _server_wide(fake):
    """The server-wide control calls a fake got (pause/continue of every request on it)."""
    return [what for what, _ in fake.control if what in ("pause", "resume", "continue")]


@pytest.mark.parametrize("kind", ["vllm", "sglang"])
async def test_a_tenants_adapter_update_leaves_the_other_tenants_requests_alone(kind, tmp_path, reward_pool):
    """Regression: tenant A's ``engine.update_weights`` paused the whole server (vLLM
    ``/pause?mode=abort``, SGLang ``/pause_generation``), which aborted tenant B's request in
    flight too: B re-sent it (a second generate call), and a request B sent meanwhile would
    hang on a real paused vLLM until A resumed it.  Now A aborts only its own request by id.

    Real clock, on purpose: the adapters are read and written in worker threads, during
    which an autojump clock would jump to the hanging requests' attempt timeout."""
    fake = FakeVLLM(length=6) if kind == "vllm" else FakeSGLang(length=6)
    fake.partial_on_abort = 2
    a, b = _tenant(kind, fake, tmp_path, "tenant-a"), _tenant(kind, fake, tmp_path, "tenant-b")
    results = {}
    with trio.fail_after(30):
        async with open_rollout_engine(a, reward_pool=reward_pool) as engine_a, \
                open_rollout_engine(b, reward_pool=reward_pool) as engine_b:
            async def one(engine, key):
                results[key] = await engine.agenerate(ModelRequest(input_ids=[3, 4], gconfig=G))

            fake.script = ["hang", "hang"]  # A's request, then B's: both run until aborted or held
            async with trio.open_nursery() as nursery:
                nursery.start_soon(one, engine_a, "a")
                await trio.testing.wait_all_tasks_blocked()
                nursery.start_soon(one, engine_b, "b")
                await trio.testing.wait_all_tasks_blocked()
                await engine_a.update_weights(_adapter(tmp_path, "a1"), version=1)
                await trio.testing.wait_all_tasks_blocked()
                assert "a" in results and "b" not in results  # A's came back and resumed; B's still runs
                fake.hold.set()
            await a.adapters.drained()
            names = sorted(fake.loras)
    assert _server_wide(fake) == [] and not fake.paused
    sent = [c.get("model") or c.get("lora_path") for c in fake.generate_calls]
    assert sent == ["tenant-a-v0", "tenant-b-v0", "tenant-a-v1"]  # B's request was sent once
    assert results["a"].output_versions == [0, 0, 1, 1, 1, 1]
    assert results["b"].output_versions == [0] * 6 and results["b"].stop_reason == "length"
    assert names == ["tenant-a-v1", "tenant-b-v0"] and fake.loras == {} and not fake.broken


async def test_each_tenant_samples_its_own_adapter_and_versions(tmp_path, reward_pool, autojump_clock):
    fake = FakeVLLM(length=4)
    a, b = _tenant("vllm", fake, tmp_path, "tenant-a"), _tenant("vllm", fake, tmp_path, "tenant-b")
    async with open_rollout_engine(a, reward_pool=reward_pool) as engine_a, \
            open_rollout_engine(b, reward_pool=reward_pool) as engine_b:
        for version in (1, 2, 3):
            await engine_a.update_weights(_adapter(tmp_path, f"a{version}"), version=version)
        await engine_b.update_weights(_adapter(tmp_path, "b7"), version=7)
        ra = await engine_a.agenerate(ModelRequest(input_ids=[1, 2], gconfig=G))
        rb = await engine_b.agenerate(ModelRequest(input_ids=[1, 2], gconfig=G))
        await a.adapters.drained()
        await b.adapters.drained()
        assert sorted(fake.loras) == ["tenant-a-v3", "tenant-b-v7"]
        folders = dict(fake.loras)
        stats_a, stats_b = engine_a.statistics().backend.lora, engine_b.statistics().backend.lora
    assert ra.output_versions == [3] * 4 and rb.output_versions == [7] * 4
    assert ra.output_tokens == fake_tokens([1, 2], 4, weights=folders["tenant-a-v3"])[0]
    assert rb.output_tokens == fake_tokens([1, 2], 4, weights=folders["tenant-b-v7"])[0]
    assert stats_a.current == {"tenant-a": "tenant-a-v3"} and stats_a.unloads == 3
    assert stats_b.current == {"tenant-b": "tenant-b-v7"} and stats_b.unloads == 1


@pytest.mark.parametrize("first_at", [0, 3], ids=["same-version", "other-version"])
async def test_two_tenants_with_one_adapter_name_are_one_clear_error(first_at, tmp_path, reward_pool):
    """Both tenants left at the default ``lora_name="lora"``, the second starting at version
    0: it is refused at its first load, whether or not ``lora-v0`` happens to be free on the
    server (before: with the first tenant at version 3 it loaded, shared the name with it,
    and failed later, at the first version both reached)."""
    fake = FakeVLLM()
    first = make_remote_backend("vllm", [A], transport=mock_transport({A: fake}), lora_dir=str(tmp_path / "s1"),
                                lora=_adapter(tmp_path, "one"))
    second = make_remote_backend("vllm", [A], transport=mock_transport({A: fake}), lora_dir=str(tmp_path / "s2"),
                                 lora=_adapter(tmp_path, "two"))
    async with open_rollout_engine(first, reward_pool=reward_pool) as engine:
        for version in range(1, first_at + 1):
            await engine.update_weights(_adapter(tmp_path, f"one{version}"), version=version)
        await first.adapters.drained()
        loaded = sorted(fake.loras)
        with pytest.raises(BackendError) as err:
            async with open_rollout_engine(second, reward_pool=reward_pool):
                pass
        assert sorted(fake.loras) == loaded == [f"lora-v{first_at}"]  # the first tenant's, untouched
    message = str(err.value)
    assert f"the LoRA adapter name 'lora' is in use on {A} by another client (it serves 'lora-v{first_at}'" in message
    assert "give each tenant its own lora_name" in message
    assert list((tmp_path / "s2").glob("*/*")) == []


async def test_an_adapter_update_while_the_servers_are_paused_leaves_them_to_the_resume(tmp_path, reward_pool,
                                                                                          autojump_clock):
    """A server-wide pause taken before (``pause_generation``) stays server-wide through an
    adapter update's client-only pause: the update's resume resumes the servers too."""
    fake = FakeVLLM()
    backend = _tenant("vllm", fake, tmp_path, "tenant-a")
    async with open_rollout_engine(backend, reward_pool=reward_pool) as engine:
        await backend.pause_generation("abort")
        await backend.pause("abort")  # the update's own pause: nothing more to do
        assert _server_wide(fake) == ["pause"] and backend.paused
        await backend.update_weights(_adapter(tmp_path, "a1"), version=1)
        await backend.resume()
        assert _server_wide(fake) == ["pause", "resume"] and not fake.paused and not backend.paused
        engine.set_version(1)
        r = await engine.agenerate(ModelRequest(input_ids=[1], gconfig=G))
    assert r.output_versions == [1] * 4

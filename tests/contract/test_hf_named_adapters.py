"""Contract tier: the ``hf`` backend's named LoRA adapters (``HFBackend.add_adapter``, what
``rollout serve``'s ``/load_lora_adapter`` uses) in-process with the engine: two tenants'
adapters and the base model sampled side by side (one engine, adapter per request), an
unloaded adapter finishing its requests in flight, and what the backend refuses."""

from __future__ import annotations

import pytest
import trio

pytest.importorskip("peft")

from engine import BackendError, HFBackend, InvalidRequestError, ModelRequest, open_rollout_engine  # noqa: E402
from engine.testing import build_tiny_lora, build_tiny_model  # noqa: E402
from engine.types import GenerationHyperparameters as G  # noqa: E402
from test_serve_lora_routes import TOLERANCE, max_diff  # noqa: E402

pytestmark = pytest.mark.slow
PROMPT = [3, 40, 41, 42, 4, 3]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    model = build_tiny_model(root / "tiny", seed=0)
    return model, build_tiny_lora(model, root / "a", seed=1), build_tiny_lora(model, root / "b", seed=2)


async def test_two_tenants_and_the_base_model_each_sample_their_own_in_one_engine(tiny, reward_pool):
    model, a, b = tiny
    backend = HFBackend(model, device="cpu", dtype="float32", batch_window_s=0.05)
    g = G(max_new_tokens=12, temperature=1.0, ignore_eos=True)
    results = {}
    async with open_rollout_engine(backend, reward_pool=reward_pool) as engine:
        await backend.add_adapter("tenant-a", a)
        await backend.add_adapter("tenant-b", b)

        async def one(key, lora, i):
            results[key] = await engine.agenerate(ModelRequest(input_ids=PROMPT + [i], gconfig=g, lora_name=lora))

        async with trio.open_nursery() as nursery:  # one burst: a batch per adapter
            for i, lora in enumerate(["tenant-a", "tenant-b", None, "tenant-a", "tenant-b", None]):
                nursery.start_soon(one, f"{lora}-{i}", lora, i)
        stats = engine.statistics().backend
    assert stats.lora.current == {"tenant-a": "tenant-a-v1", "tenant-b": "tenant-b-v2"}
    assert stats.batches >= 3  # one adapter per batch
    for key, r in results.items():
        lora, i = key.rsplit("-", 1)
        adapter = {"tenant-a": a, "tenant-b": b, "None": None}[lora]
        assert r.output_len == 12 and max_diff(model, adapter, PROMPT + [int(i)], r.output_tokens,
                                                r.output_logprobs) < TOLERANCE, key


async def test_an_unloaded_adapter_finishes_its_requests_in_flight_and_refuses_new_ones(tiny, reward_pool):
    model, a, b = tiny
    backend = HFBackend(model, device="cpu", dtype="float32", batch_window_s=0.0)
    results = {}
    async with open_rollout_engine(backend, reward_pool=reward_pool) as engine:
        await backend.add_adapter("x", a)

        async def long_request():
            results["r"] = await engine.agenerate(ModelRequest(input_ids=PROMPT, gconfig=G(
                max_new_tokens=300, ignore_eos=True), lora_name="x"))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(long_request)
            with trio.fail_after(60):
                while backend.statistics().decode_steps < 5:  # decoding on x
                    await trio.sleep(0.01)
            backend.remove_adapter("x")
            with pytest.raises(InvalidRequestError, match="'x' is not an adapter this backend serves"):
                await engine.agenerate(ModelRequest(input_ids=PROMPT, gconfig=G(max_new_tokens=2), lora_name="x"))
            await backend.add_adapter("x", b)  # the name again, other weights: a slot of its own
            during = backend.statistics().lora
        after = backend.statistics().lora
        again = await engine.agenerate(ModelRequest(input_ids=PROMPT, gconfig=G(max_new_tokens=8, ignore_eos=True),
                                                    lora_name="x"))
    assert during.loaded == ("x-v1", "x-v2") and during.in_flight == {"x-v1": 1}
    assert after.loaded == ("x-v2",) and after.unloads == 1  # deleted once its request ended
    r = results["r"]
    assert r.output_len == 300 and max_diff(model, a, PROMPT, r.output_tokens, r.output_logprobs) < TOLERANCE
    assert max_diff(model, b, PROMPT, again.output_tokens, again.output_logprobs) < TOLERANCE


async def test_what_named_adapters_refuse(tiny, tmp_path, reward_pool):
    model, a, b = tiny
    continuous = HFBackend(model, device="cpu", dtype="float32", mode="continuous", cache_tokens=1024)
    async with open_rollout_engine(continuous, reward_pool=reward_pool):
        with pytest.raises(BackendError, match="named LoRA adapters need mode='static'"):
            await continuous.add_adapter("x", a)
    own = HFBackend(model, device="cpu", dtype="float32", lora=a)  # its own adapter, "lora"
    with pytest.raises(BackendError, match="needs the backend open"):
        await own.add_adapter("x", b)
    async with open_rollout_engine(own, reward_pool=reward_pool) as engine:
        with pytest.raises(BackendError, match="'lora' is loaded already"):
            await own.add_adapter("lora", b)
        await own.add_adapter("x", b)
        with pytest.raises(BackendError, match="'x' is loaded already"):
            await own.add_adapter("x", a)
        with pytest.raises(InvalidRequestError, match="'nothing' is not loaded"):
            own.remove_adapter("nothing")
        await engine.update_weights(b, version=1)  # the own adapter's next version; x stays
        assert own.statistics().lora.current == {"lora": "lora-v1", "x": "x-v1"}
    named = HFBackend(model, device="cpu", dtype="float32")
    async with open_rollout_engine(named, reward_pool=reward_pool) as engine:
        await named.add_adapter("lora", a)  # no own adapter: "lora" is a name like any other
        r = await engine.agenerate(ModelRequest(input_ids=PROMPT, gconfig=G(max_new_tokens=4, ignore_eos=True)))
        assert max_diff(model, None, PROMPT, r.output_tokens, r.output_logprobs) < TOLERANCE  # no lora_name: the base
        with pytest.raises(BackendError, match="'lora' is a named adapter"):
            await engine.update_weights(b, version=1)
        with pytest.raises(BackendError, match=r"serves the LoRA adapters 'lora' \(add_adapter\)"):
            await engine.update_weights(named.model.state_dict(), version=1)

"""Contract tier: ``rollout serve``'s LoRA routes (SGLang's ``/load_lora_adapter`` and
``/unload_lora_adapter``) in-process (``httpx.ASGITransport``) over the tiny model and rank-8
adapters: our ``sglang`` client loads its versions there and samples them (peft's logprobs),
requests of several adapters (and of the base model) at once each sample their own, an
unloaded name finishes what is in flight on it while new requests for it get 404, and every
bad load is one line, HTTP 400, with the server alive."""

from __future__ import annotations

import functools
import warnings

import httpx
import pytest
import torch
import trio

pytest.importorskip("peft")

from engine import ModelRequest, open_rollout_engine  # noqa: E402
from engine.backends import sglang_wire as wire  # noqa: E402
from engine.backends.hf import HFBackend  # noqa: E402
from engine.backends.remote import make_remote_backend  # noqa: E402
from engine.serve import SGLangServer  # noqa: E402
from engine.testing import build_tiny_lora, build_tiny_model  # noqa: E402
from engine.types import GenerationHyperparameters as G  # noqa: E402

pytestmark = pytest.mark.slow
PROMPT = [3, 120, 121, 4, 3]
TOLERANCE = 1e-4  # float32 on both sides, the same model code


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    model = build_tiny_model(root / "tiny", seed=0)
    return model, build_tiny_lora(model, root / "a", seed=1), build_tiny_lora(model, root / "b", seed=2)


@functools.lru_cache(maxsize=8)
def _reference(model_dir, adapter=None):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    if adapter is None:
        return model
    from peft import PeftModel

    with warnings.catch_warnings():  # transformers' is_gradient_checkpointing deprecation, inside peft
        warnings.simplefilter("ignore", FutureWarning)
        return PeftModel.from_pretrained(model, adapter).eval()


def max_diff(model_dir, adapter, prompt, tokens, logprobs):
    """max |logprob - teacher-forced transformers (+ peft ``adapter``)| over ``tokens``."""
    with torch.no_grad():
        logits = _reference(str(model_dir), None if adapter is None else str(adapter))(
            input_ids=torch.tensor([list(prompt) + list(tokens)])).logits[0]
    logp = torch.log_softmax(logits.float(), dim=-1)
    ref = logp[torch.arange(len(prompt) - 1, len(prompt) + len(tokens) - 1), torch.tensor(tokens)]
    return (torch.tensor(logprobs) - ref).abs().max().item()


def _client(server, tmp_path, **opts):
    return make_remote_backend("sglang", ["http://serve"], transport=httpx.ASGITransport(app=server.app),
                               lora_dir=str(tmp_path / "served"), health_interval_s=60.0, **opts)


async def test_the_sglang_client_loads_and_samples_its_adapter_on_rollout_serve(tiny, tmp_path, reward_pool):
    """Regression: ``rollout serve`` had no ``/load_lora_adapter`` (our client's load answered
    404) and refused ``lora_path`` on ``/generate``."""
    model, a, b = tiny
    backend = HFBackend(model, device="cpu", dtype="float32", batch_window_s=0.0, lora=a)  # rollout serve --lora a
    server = SGLangServer(backend, model_path=str(model), served_model_name="tiny")
    client = _client(server, tmp_path, lora=b, lora_name="tenant")
    g = G(max_new_tokens=6, ignore_eos=True)
    with trio.fail_after(120):
        async with trio.open_nursery() as nursery:
            await nursery.start(server.run)
            async with open_rollout_engine(client, reward_pool=reward_pool) as engine:
                r = await engine.agenerate(ModelRequest(input_ids=PROMPT, gconfig=g))
            nursery.cancel_scope.cancel()
    assert r.output_len == 6 and r.output_versions == [0] * 6
    assert max_diff(model, b, PROMPT, r.output_tokens, r.output_logprobs) < TOLERANCE


class Held:
    """The model's forward, held once at call ``at`` (in the generate thread) until
    :attr:`proceed` is set; :attr:`midway` is set when it got there."""

    def __init__(self, model, at):
        import threading

        self.calls, self.at = 0, at
        self.midway, self.proceed = threading.Event(), threading.Event()
        forward = model.forward

        def held_forward(*args, **kwargs):
            self.calls += 1
            if self.calls == self.at:
                self.midway.set()
                assert self.proceed.wait(15), f"held at {self.at}"
            return forward(*args, **kwargs)

        model.forward = held_forward


def _loaded(model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval(), AutoTokenizer.from_pretrained(
        model_dir)


def _body(rid, n, lora=None, **sp):
    body = {"input_ids": PROMPT, "rid": rid, "return_logprob": True,
            "sampling_params": {"max_new_tokens": n, "ignore_eos": True, **sp}}
    return body if lora is None else {**body, "lora_path": lora}


async def _serving(server, fn):
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=server.app), base_url="http://serve",
                                 timeout=60) as client:
        with trio.fail_after(120):
            async with trio.open_nursery() as nursery:
                await nursery.start(server.run)
                try:
                    await fn(client)
                finally:
                    nursery.cancel_scope.cancel()


async def test_requests_of_several_adapters_and_of_the_base_model_each_sample_their_own(tiny):
    model, a, b = tiny
    backend = HFBackend(model, device="cpu", dtype="float32", batch_window_s=0.05)
    server = SGLangServer(backend, model_path=str(model), served_model_name="tiny", enable_lora=True)
    answers, listing = {}, {}

    async def fn(client):
        for name, folder in (("tenant-a-v0", a), ("tenant-b-v0", b)):
            loaded = await client.post("/load_lora_adapter", json={"lora_name": name, "lora_path": str(folder)})
            assert loaded.status_code == 200 and loaded.json()["success"], loaded.text
        listing["models"] = (await client.get("/v1/models")).json()["data"]
        listing["info"] = (await client.get("/get_server_info")).json()

        async def one(rid, lora):
            answer = await client.post("/generate", json=_body(rid, 8, lora, temperature=1.0, sampling_seed=3))
            answers[rid] = wire.parse_generate_answer(answer.json())

        async with trio.open_nursery() as nursery:  # one burst: batched per adapter
            for rid, lora in (("a", "tenant-a-v0"), ("b", "tenant-b-v0"), ("base", None), ("a2", "tenant-a-v0")):
                nursery.start_soon(one, rid, lora)

    await _serving(server, fn)
    assert [(m["id"], m.get("parent")) for m in listing["models"]] == [
        ("tiny", None), ("tenant-a-v0", "tiny"), ("tenant-b-v0", "tiny")]
    info = listing["info"]
    assert info["enable_lora"] is True and info["max_lora_rank"] is None
    assert info["loaded_lora_adapters"] == {"tenant-a-v0": str(a), "tenant-b-v0": str(b)}
    for rid, adapter in (("a", a), ("a2", a), ("b", b), ("base", None)):
        r = answers[rid]
        assert len(r.tokens) == 8 and max_diff(model, adapter, PROMPT, r.tokens, r.logprobs) < TOLERANCE, rid
    assert answers["a"].tokens == answers["a2"].tokens  # same seed, same adapter
    assert max_diff(model, b, PROMPT, answers["a"].tokens, answers["a"].logprobs) > 1e-2  # a is not b


async def test_a_load_while_a_batch_decodes_leaves_that_batch_on_what_it_computes_with(tiny, tmp_path):
    """The first adapter is injected (peft wraps the model's layers) while a base-model
    batch is parked between two steps; an unload of an adapter with a request in flight,
    its folder deleted, and a reload of the name: each request samples its own weights."""
    import shutil

    model_dir, a, b = tiny
    model, tok = _loaded(model_dir)
    held = Held(model, at=6)
    backend = HFBackend(model, tok, device="cpu", dtype="float32", batch_window_s=0.0)
    server = SGLangServer(backend, model_path=str(model_dir), served_model_name="tiny", enable_lora=True)
    copy = shutil.copytree(a, tmp_path / "a-copy")
    answers = {}

    async def generate(client, rid, n, lora=None):
        answer = await client.post("/generate", json=_body(rid, n, lora))
        answers[rid] = (answer.status_code, answer.json())

    async def fn(client):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(generate, client, "base", 20)
            await trio.to_thread.run_sync(held.midway.wait)  # decoding, its 6th forward held
            nursery.start_soon(functools.partial(client.post, "/load_lora_adapter",
                                                 json={"lora_name": "x", "lora_path": str(copy)}))
            await trio.testing.wait_all_tasks_blocked()  # the load waits for the batch to park
            held.proceed.set()
        assert answers["base"][0] == 200
        held.calls, held.at = 0, 4
        held.midway.clear(), held.proceed.clear()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(generate, client, "x-old", 20, "x")
            await trio.to_thread.run_sync(held.midway.wait)
            unload = await client.post("/unload_lora_adapter", json={"lora_name": "x"})
            assert unload.status_code == 200 and unload.json()["loaded_adapters"] == {}, unload.text
            refused = await client.post("/generate", json=_body("x-new", 4, "x"))
            assert refused.status_code == 404 and "'x' is not loaded" in refused.json()["message"]
            shutil.rmtree(copy)  # never read again after its load
            nursery.start_soon(functools.partial(client.post, "/load_lora_adapter",
                                                 json={"lora_name": "x", "lora_path": str(b)}))
            await trio.testing.wait_all_tasks_blocked()
            held.proceed.set()
        await generate(client, "x-again", 8, "x")
        assert backend.statistics().lora.loaded == ("x-v2",)  # the old x went once its request ended

    await _serving(server, fn)
    for rid, adapter in (("base", None), ("x-old", a), ("x-again", b)):
        status, body = answers[rid]
        r = wire.parse_generate_answer(body)
        assert status == 200 and max_diff(model_dir, adapter, PROMPT, r.tokens, r.logprobs) < TOLERANCE, rid


def _bad_adapters(model, a, root):
    """``{name: (folder, what its load answers)}``: every way a load can fail."""
    import shutil

    from engine.backends.lora import AdapterWeights, read_adapter, write_adapter

    corrupt_weights = shutil.copytree(a, root / "corrupt-weights")
    (corrupt_weights / "adapter_model.safetensors").write_bytes(b"these are not safetensors")
    corrupt_config = shutil.copytree(a, root / "corrupt-config")
    (corrupt_config / "adapter_config.json").write_text("{not json")
    weights = read_adapter(a)
    key = next(k for k in weights.tensors if k.endswith("lora_A.weight"))
    misfit = write_adapter(AdapterWeights(weights.config, {**weights.tensors, key: torch.zeros(8, 3)}), root / "misfit")
    return {
        "missing": (root / "nowhere", "has no adapter_config.json"),
        "corrupt-weights": (corrupt_weights, "Failed to load LoRA adapter 'corrupt-weights' from"),
        "corrupt-config": (corrupt_config, "Failed to load LoRA adapter 'corrupt-config' from"),
        "rank16": (build_tiny_lora(model, root / "r16", seed=3, rank=16),
                   "rank 16 is above the --max-lora-rank 8 of this rollout serve server"),
        "other-base": (build_tiny_lora(model, root / "other", seed=4, base_model_name_or_path="org/OtherModel"),
                       "trained on base model 'org/OtherModel'"),
        "misfit": (misfit, "does not fit the model"),
    }


async def test_every_bad_load_is_one_line_http_400_and_the_server_lives_on(tiny, tmp_path):
    model, a, b = tiny
    bad = _bad_adapters(model, a, tmp_path)
    backend = HFBackend(model, device="cpu", dtype="float32", batch_window_s=0.0)
    server = SGLangServer(backend, model_path=str(model), served_model_name="tiny", enable_lora=True,
                          max_lora_rank=8)
    plain = SGLangServer(HFBackend(model, device="cpu", dtype="float32"), model_path=str(model))
    answers, after = {}, {}

    async def load(client, name, folder):
        answer = await client.post("/load_lora_adapter", json={"lora_name": name, "lora_path": str(folder)})
        return answer.status_code, answer.json()

    async def fn(client):
        for name, (folder, _) in bad.items():
            answers[name] = await load(client, name, folder)
        assert (await load(client, "good", a))[0] == 200
        answers["taken"] = await load(client, "good", b)
        answers["bad body"] = await load(client, "has space", a)
        unload = await client.post("/unload_lora_adapter", json={"lora_name": "nothing"})
        answers["unload unknown"] = unload.status_code, unload.json()
        refused = await client.post("/generate", json=_body("q", 4, "nothing"))
        after["404"] = refused.status_code, refused.json()["message"]
        after["health"] = (await client.get("/health")).status_code
        after["models"] = [m["id"] for m in (await client.get("/v1/models")).json()["data"]]
        for rid, lora in (("good", "good"), ("base", None)):
            after[rid] = wire.parse_generate_answer((await client.post("/generate", json=_body(rid, 6, lora))).json())

    async def without_lora(client):
        answers["not enabled"] = await load(client, "good", a)
        unload = await client.post("/unload_lora_adapter", json={"lora_name": "good"})
        answers["unload not enabled"] = unload.status_code, unload.json()

    await _serving(server, fn)
    await _serving(plain, without_lora)
    expected = {name: what for name, (_, what) in bad.items()}
    expected.update({"taken": "LoRA adapter 'good' is already loaded", "bad body": "lora_name must be",
                     "unload unknown": "LoRA adapter 'nothing' is not loaded",
                     "not enabled": "LoRA is not enabled. Please set `--enable-lora` to enable LoRA.",
                     "unload not enabled": "LoRA is not enabled"})
    for case, what in expected.items():
        status, body = answers[case]
        assert status == 400 and body["success"] is False, (case, body)
        assert what in body["error_message"] and "\n" not in body["error_message"], (case, body)
    assert after["404"][0] == 404 and "'nothing' is not loaded on this server (loaded: 'good')" in after["404"][1]
    assert after["health"] == 200 and after["models"] == ["tiny", "good"]
    for rid, adapter in (("good", a), ("base", None)):  # the failed loads left the model as it was
        r = after[rid]
        assert max_diff(model, adapter, PROMPT, r.tokens, r.logprobs) < TOLERANCE, rid


async def test_the_lora_adapter_of_rollout_serve_lora_keeps_its_names_and_its_base(tiny, tmp_path):
    model, a, b = tiny
    backend = HFBackend(model, device="cpu", dtype="float32", batch_window_s=0.0, lora=a)  # rollout serve --lora a
    server = SGLangServer(backend, model_path=str(model), served_model_name="tiny")
    seen = {}

    async def fn(client):
        seen["info"] = (await client.get("/get_server_info")).json()
        for name in ("lora", "lora-v0"):
            taken = await client.post("/load_lora_adapter", json={"lora_name": name, "lora_path": str(b)})
            seen[f"load {name}"] = taken.status_code, taken.json()["error_message"]
        unload = await client.post("/unload_lora_adapter", json={"lora_name": "lora-v0"})
        seen["unload"] = unload.status_code, unload.json()["error_message"]
        for lora in ("lora", "lora-v0", None):
            seen[lora] = wire.parse_generate_answer((await client.post("/generate", json=_body("q", 5, lora))).json())
        update = await client.post("/update_weights_from_disk", json={"model_path": str(b)})
        assert update.status_code == 200, update.text
        seen["model_path"] = (await client.get("/get_model_info")).json()["model_path"]
        seen["models"] = [(m["id"], m["root"]) for m in (await client.get("/v1/models")).json()["data"]]
        seen["v1"] = wire.parse_generate_answer((await client.post("/generate", json=_body("r", 5, "lora-v1"))).json())
        seen["old"] = (await client.post("/generate", json=_body("s", 5, "lora-v0"))).status_code

    await _serving(server, fn)
    assert seen["info"]["enable_lora"] is True and seen["info"]["loaded_lora_adapters"] == {"lora-v0": None}
    assert seen["load lora"][0] == seen["load lora-v0"][0] == 400 and "already loaded" in seen["load lora-v0"][1]
    assert seen["unload"][0] == 400 and "--lora adapter" in seen["unload"][1]
    for lora in ("lora", "lora-v0", None):
        assert max_diff(model, a, PROMPT, seen[lora].tokens, seen[lora].logprobs) < TOLERANCE, lora
    assert seen["model_path"] == str(model)  # an adapter update leaves the base model reported (clients check it)
    assert seen["models"] == [("tiny", str(model)), ("lora-v1", str(b))]
    assert max_diff(model, b, PROMPT, seen["v1"].tokens, seen["v1"].logprobs) < TOLERANCE and seen["old"] == 404


def test_the_lora_options_of_rollout_serve_are_checked_in_one_line(capsys):
    from conftest import run_cli
    from engine import InvalidRequestError
    from engine.serve import ServeConfig

    with pytest.raises(InvalidRequestError, match="give --enable-lora too"):
        ServeConfig(max_lora_rank=8)
    with pytest.raises(InvalidRequestError, match="--max-lora-rank must be an integer >= 1, got 0"):
        ServeConfig(enable_lora=True, max_lora_rank=0)
    assert ServeConfig(enable_lora=True, max_lora_rank=8).max_lora_rank == 8
    code, _, err = run_cli(["serve", "--max-lora-rank", "8"], capsys)
    assert code == 2 and err.strip().splitlines() == [
        "rollout serve: error: --max-lora-rank limits the adapters /load_lora_adapter loads: give --enable-lora too"]

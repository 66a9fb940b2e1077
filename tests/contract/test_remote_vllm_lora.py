"""Contract tier: LoRA adapters on a real vLLM 0.32 CPU server on 127.0.0.1 (issue 29).

Marked ``vllm`` (and ``slow``): ``pytest --vllm``; fails (never skips) without the vLLM CPU
venv (``$TRIO_ROLLOUT_VLLM_VENV``, as ``test_remote_vllm.py``).  The module starts its own
server with the tools' tiny model and ``--enable-lora --max-lora-rank 8 --max-loras 2``
(``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``: the load/unload routes), besides the options of
``test_remote_vllm.py``.  Adapters are rank-8 peft folders built here
(:func:`engine.testing.build_tiny_lora`); the backend writes each version to its own
folder under a temporary ``lora_dir`` the server reads.

Shown: rollouts under adapter v0, whose logprobs are transformers + peft's (teacher-forced);
an update to v1 mid-generation: the request's tokens carry 0 then 1 at the boundary, those
before it peft(v0)'s and those after it peft(v1)'s; v0's name unloaded once drained and its
folder removed after; every name this client loaded unloaded at the end, the server alive.
The tolerance is measured here (TOOLING_NOTES.md: 5e-5 to 6e-5 on this box).
"""

from __future__ import annotations

import functools
import warnings

import httpx
import pytest
import torch
import trio

pytest.importorskip("peft")

from engine import BackendError, ModelRequest, open_rollout_engine  # noqa: E402
from engine.backends.remote import make_remote_backend  # noqa: E402
from engine.testing import build_tiny_lora  # noqa: E402
from engine.types import GenerationHyperparameters as G  # noqa: E402
from test_remote_vllm import server_state, wait_for  # noqa: E402
from vllm_server import MAX_MODEL_LEN, PROMPT, TIER_OPTIONS, make_tiny_model, require_vllm, vllm_server  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

#: |vLLM logprob - transformers + peft|, float32 on both sides (measured: below 1e-4)
TOLERANCE = 1e-3


@pytest.fixture(scope="module")
def vllm_lora(tmp_path_factory):
    require_vllm()
    root = tmp_path_factory.mktemp("vllm-lora")
    model_dir = make_tiny_model(root / "tiny-llama")
    with vllm_server(root, model_dir, *TIER_OPTIONS, "--max-model-len", str(MAX_MODEL_LEN),
                     "--no-enable-chunked-prefill", "--enable-lora", "--max-lora-rank", "8", "--max-loras", "2",
                     env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}) as server:
        yield server.url, str(model_dir), root


@functools.lru_cache(maxsize=4)
def _peft(model_dir, adapter):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with warnings.catch_warnings():  # transformers' is_gradient_checkpointing deprecation, inside peft
        warnings.simplefilter("ignore", FutureWarning)
        return PeftModel.from_pretrained(base, adapter).eval()


def _teacher_forced(model, prompt, output):
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + output])).logits[0].float()  # [T, V]
    logp = torch.log_softmax(logits, dim=-1)
    return logp[torch.arange(len(prompt) - 1, len(prompt) + len(output) - 1), torch.tensor(output)]  # [n]


async def _served(url):
    async with httpx.AsyncClient(timeout=30) as client:
        return sorted(m["id"] for m in (await client.get(url + "/v1/models")).json()["data"])


async def test_adapter_versions_on_a_real_server(vllm_lora, tmp_path, reward_pool):
    url, model_dir, _ = vllm_lora
    a = build_tiny_lora(model_dir, tmp_path / "a", seed=1)
    b = build_tiny_lora(model_dir, tmp_path / "b", seed=2)
    served_dir = tmp_path / "served"
    backend = make_remote_backend("vllm", [url], health_interval_s=1.0, request_timeout_s=300.0, lora=a,
                                  lora_dir=str(served_dir))
    with trio.fail_after(600):
        async with open_rollout_engine(backend, reward_pool=reward_pool) as engine:
            assert await _served(url) == ["lora-v0", "tiny"]
            short = G(max_new_tokens=24, temperature=1.0, seed=5, ignore_eos=True)
            first = await engine.agenerate(ModelRequest(input_ids=PROMPT, gconfig=short))
            result = {}

            async def long_request():
                result["r"] = await engine.agenerate(ModelRequest(input_ids=PROMPT, gconfig=G(
                    max_new_tokens=400, temperature=1.0, seed=7, ignore_eos=True)))

            async with trio.open_nursery() as nursery:
                start = (await server_state(url))["generated"]
                nursery.start_soon(long_request)
                # some tokens under v0 first, so that the boundary falls inside the request
                await wait_for(url, lambda s: s["generated"] >= start + 40, "tokens of the long request")
                await engine.update_weights(b, version=1)  # pause(abort), load lora-v1, resume
            await backend.adapters.drained()
            assert await _served(url) == ["lora-v1", "tiny"]  # v0 unloaded once drained ...
            assert [p.name.startswith("lora-v1-") for p in served_dir.iterdir()] == [True]  # ... its folder gone
            after = await engine.agenerate(ModelRequest(input_ids=PROMPT, gconfig=short))
            with pytest.raises(BackendError, match="rank 16 is above the --max-lora-rank 8"):
                await engine.update_weights(build_tiny_lora(model_dir, tmp_path / "r16", seed=3, rank=16), version=2)
            lora = engine.statistics().backend.lora
    assert lora.loaded == ("lora-v1",) and lora.unloads == 1 and lora.unload_failures == 0
    assert await _served(url) == ["tiny"] and list(served_dir.iterdir()) == []  # every name unloaded, every folder gone
    async with httpx.AsyncClient(timeout=30) as client:
        assert (await client.get(url + "/health")).status_code == 200  # the server alive at the end

    r = result["r"]
    k = r.output_versions.index(1)
    assert 0 < k < r.output_len == 400 and r.output_versions == [0] * k + [1] * (400 - k)
    diffs = {
        "v0": (torch.tensor(first.output_logprobs) - _teacher_forced(_peft(model_dir, a), PROMPT,
                                                                     first.output_tokens)).abs().max().item(),
        "before the boundary": (torch.tensor(r.output_logprobs[:k]) - _teacher_forced(
            _peft(model_dir, a), PROMPT, r.output_tokens)[:k]).abs().max().item(),
        "after the boundary": (torch.tensor(r.output_logprobs[k:]) - _teacher_forced(
            _peft(model_dir, b), PROMPT, r.output_tokens)[k:]).abs().max().item(),
        "v1": (torch.tensor(after.output_logprobs) - _teacher_forced(_peft(model_dir, b), PROMPT,
                                                                     after.output_tokens)).abs().max().item(),
    }
    print(f"max |vLLM - peft| logprob: {diffs} (boundary at token {k})")
    assert max(diffs.values()) < TOLERANCE, diffs
    assert first.output_versions == [0] * 24 and after.output_versions == [1] * 24
    other = (torch.tensor(after.output_logprobs) - _teacher_forced(_peft(model_dir, a), PROMPT,
                                                                   after.output_tokens)).abs().max().item()
    assert other > 1e-2  # v1 is not v0: the check above can tell them apart


async def test_an_update_storm_fails_no_request_and_leaves_one_name(vllm_lora, tmp_path, reward_pool):
    """An adapter update every ~0.3 s for 20 updates while 4 request loops run: no request
    fails, every response's versions only go up, and at the end one name is loaded."""
    url, model_dir, _ = vllm_lora
    sources = [build_tiny_lora(model_dir, tmp_path / f"s{i}", seed=10 + i) for i in range(2)]
    served_dir = tmp_path / "served"
    backend = make_remote_backend("vllm", [url], health_interval_s=1.0, request_timeout_s=300.0, lora=sources[0],
                                  lora_dir=str(served_dir))
    updates, responses, stop = 20, [], trio.Event()
    with trio.fail_after(600):
        async with open_rollout_engine(backend, reward_pool=reward_pool) as engine:
            async def requests(i):
                while not stop.is_set():
                    responses.append(await engine.agenerate(ModelRequest(input_ids=PROMPT + [i], gconfig=G(
                        max_new_tokens=48, temperature=1.0, ignore_eos=True))))

            async with trio.open_nursery() as nursery:
                for i in range(4):
                    nursery.start_soon(requests, i)
                for version in range(1, updates + 1):
                    await trio.sleep(0.3)  # the storm's pace
                    await engine.update_weights(sources[version % 2], version=version)
                stop.set()
            await backend.adapters.drained()
            stats = engine.statistics()
            assert await _served(url) == [f"lora-v{updates}", "tiny"]
    assert stats.failed == 0 and stats.backend.requests_failed == 0 and len(responses) >= 4
    assert all(r.output_versions == sorted(r.output_versions) for r in responses)
    assert stats.backend.lora.loaded == (f"lora-v{updates}",) and stats.backend.lora.unloads == updates
    assert await _served(url) == ["tiny"] and list(served_dir.iterdir()) == []
    async with httpx.AsyncClient(timeout=30) as client:
        assert (await client.get(url + "/health")).status_code == 200

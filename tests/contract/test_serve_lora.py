"""Contract tier: ``rollout serve --lora``'s app in-process (``httpx.ASGITransport``) over the
tiny model and rank-8 adapters: ``/generate`` samples the adapter (peft's logprobs), and
``/update_weights_from_disk`` with an adapter folder loads the next version."""

from __future__ import annotations

import warnings

import httpx
import pytest
import torch
import trio

pytest.importorskip("peft")

from engine import InvalidRequestError  # noqa: E402
from engine.backends import sglang_wire as wire  # noqa: E402
from engine.backends.hf import HFBackend  # noqa: E402
from engine.serve import ServeConfig, SGLangServer  # noqa: E402
from engine.testing import build_tiny_lora, build_tiny_model  # noqa: E402

pytestmark = pytest.mark.slow
PROMPT = [3, 120, 121, 4, 3]


def _peft_logprobs(model_dir, adapter, output):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        model = PeftModel.from_pretrained(base, adapter).eval()
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=torch.tensor([PROMPT + output])).logits[0], dim=-1)
    return logp[torch.arange(len(PROMPT) - 1, len(PROMPT) + len(output) - 1), torch.tensor(output)]


async def test_serve_samples_the_adapter_and_loads_the_next_version_from_disk(tmp_path):
    model = build_tiny_model(tmp_path / "tiny", seed=0)
    a, b = build_tiny_lora(model, tmp_path / "a", seed=1), build_tiny_lora(model, tmp_path / "b", seed=2)
    backend = HFBackend(model, device="cpu", dtype="float32", lora=a)
    server = SGLangServer(backend, model_path=str(model), served_model_name="tiny")
    body = {"input_ids": PROMPT, "rid": "q", "return_logprob": True,
            "sampling_params": {"max_new_tokens": 6, "ignore_eos": True}}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=server.app), base_url="http://serve") as client:
        with trio.fail_after(120):
            async with trio.open_nursery() as nursery:
                await nursery.start(server.run)
                first = wire.parse_generate_answer((await client.post("/generate", json=body)).json())
                update = await client.post("/update_weights_from_disk", json={"model_path": str(b)})
                assert update.status_code == 200 and update.json()["success"], update.text
                second = wire.parse_generate_answer((await client.post("/generate", json={**body, "rid": "r"})).json())
                nursery.cancel_scope.cancel()
    assert (first.weight_version, second.weight_version) == ("0", "1")
    assert backend.statistics().lora.loaded == ("lora-v1",)
    for adapter, answer in ((a, first), (b, second)):
        diff = (torch.tensor(answer.logprobs) - _peft_logprobs(model, adapter, answer.tokens)).abs().max()
        assert diff < 1e-4


def test_serve_lora_options_are_checked(tmp_path):
    with pytest.raises(InvalidRequestError, match="not a LoRA adapter folder"):
        ServeConfig(lora=str(tmp_path))
    with pytest.raises(InvalidRequestError, match="give --lora too"):
        ServeConfig(lora_name="x")

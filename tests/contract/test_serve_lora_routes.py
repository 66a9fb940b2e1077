"""Contract tier: ``rollout serve``'s LoRA routes (SGLang's ``/load_lora_adapter`` and
``/unload_lora_adapter``) in-process (``httpx.ASGITransport``) over the tiny model and rank-8
adapters: our ``sglang`` client loads its versions there and samples them (peft's logprobs),
requests of several adapters (and of the base model) at once each sample their own, an
unloaded name finishes what is in flight on it while new requests for it get 404, and every
bad load is one line, HTTP 400, with the server alive."""

from __future__ import annotations

import functools
import json
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

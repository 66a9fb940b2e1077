"""Contract tier: the ``hf`` backend on a tiny random Llama built inside the test
(real transformers generation in a worker thread, real tokenizer)."""

from __future__ import annotations

import pytest
import torch
import trio
import trio.testing

from engine import HFBackend, InvalidRequestError, ModelRequest, open_rollout_engine
from engine.testing import build_tiny_model
from engine.types import GenerationHyperparameters

pytestmark = pytest.mark.slow


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama"), seed=0)


@pytest.fixture(scope="session")
def tiny(tiny_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(tiny_model_dir)


def _teacher_forced_logprobs(model, prompt, output):
    ids = torch.tensor([prompt + output])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].float()  # [T, V]
    logp = torch.log_softmax(logits, dim=-1)
    positions = torch.arange(len(prompt) - 1, len(prompt) + len(output) - 1)
    return logp[positions, torch.tensor(output)]  # [n_out]


def _prompt(tok, text):
    return tok.apply_chat_template([{"role": "user", "content": text}], tokenize=True,
                                   add_generation_prompt=True, return_dict=False)


async def test_concurrent_requests_logprobs_match_teacher_forcing(tiny, reward_pool):
    model, tok = tiny
    backend = HFBackend(model, tok, batch_window_s=0.05)
    prompts = [_prompt(tok, t) for t in ("hi", "what is 2+3?", "a much longer prompt, to force left padding")]
    g = GenerationHyperparameters(max_new_tokens=12, ignore_eos=True)
    results = {}
    async with open_rollout_engine(backend, reward_pool=reward_pool) as engine:
        async def one(i):
            results[i] = await engine.agenerate(ModelRequest(input_ids=prompts[i], gconfig=g))

        async with trio.open_nursery() as nursery:
            for i in range(len(prompts)):
                nursery.start_soon(one, i)
    assert backend.statistics()["batches"] == 1  # served as one batch
    worst = 0.0
    for i, p in enumerate(prompts):
        r = results[i]
        assert r.output_len == 12 and r.stop_reason == "length" and r.output_versions == [0] * 12
        ref = _teacher_forced_logprobs(model, p, r.output_tokens)
        worst = max(worst, (ref - torch.tensor(r.output_logprobs)).abs().max().item())
    assert worst < 1e-4


async def test_seed_determinism_and_greedy(tiny, reward_pool):
    model, tok = tiny
    p = _prompt(tok, "seeded")
    async with open_rollout_engine(HFBackend(model, tok, batch_window_s=0), reward_pool=reward_pool) as engine:
        seeded = GenerationHyperparameters(max_new_tokens=16, ignore_eos=True, seed=1234)
        a = await engine.agenerate(ModelRequest(input_ids=p, gconfig=seeded))
        b = await engine.agenerate(ModelRequest(input_ids=p, gconfig=seeded))
        c = await engine.agenerate(ModelRequest(input_ids=p, gconfig=seeded.new(seed=99)))
        greedy = GenerationHyperparameters(max_new_tokens=16, ignore_eos=True, greedy=True)
        g1 = await engine.agenerate(ModelRequest(input_ids=p, gconfig=greedy))
    assert a.output_tokens == b.output_tokens
    assert a.output_tokens != c.output_tokens
    ref = _teacher_forced_logprobs(model, p, g1.output_tokens)
    logits_argmax = []
    with torch.no_grad():
        ids = torch.tensor([p + g1.output_tokens])
        logits = model(input_ids=ids).logits[0]
    logits_argmax = logits[len(p) - 1 : -1].argmax(-1).tolist()
    assert g1.output_tokens == logits_argmax
    assert (ref - torch.tensor(g1.output_logprobs)).abs().max().item() < 1e-4


async def test_stop_token_and_stop_string(tiny, reward_pool):
    model, tok = tiny
    p = _prompt(tok, "stop here")
    greedy = GenerationHyperparameters(max_new_tokens=24, ignore_eos=True, greedy=True)
    async with open_rollout_engine(HFBackend(model, tok, batch_window_s=0), reward_pool=reward_pool) as engine:
        full = await engine.agenerate(ModelRequest(input_ids=p, gconfig=greedy))
        stop_id = full.output_tokens[5]
        first = full.output_tokens.index(stop_id)
        by_token = await engine.agenerate(ModelRequest(input_ids=p, gconfig=greedy.new(stop_token_ids=[stop_id])))
        text = tok.decode(full.output_tokens[:8], skip_special_tokens=False)
        needle = text[-3:]
        by_string = await engine.agenerate(ModelRequest(input_ids=p, gconfig=greedy.new(stop=[needle])))
    assert by_token.output_tokens == full.output_tokens[: first + 1]
    assert by_token.stop_reason == "stop"
    assert needle in tok.decode(by_string.output_tokens, skip_special_tokens=False)
    assert by_string.output_len <= 8 and by_string.stop_reason == "stop"
    assert by_string.output_tokens == full.output_tokens[: by_string.output_len]


async def test_cancelled_request_leaves_the_batch_and_others_complete(tiny, reward_pool):
    model, tok = tiny
    backend = HFBackend(model, tok, batch_window_s=0.05)
    g = GenerationHyperparameters(max_new_tokens=400, max_tokens=1000, ignore_eos=True)
    short = GenerationHyperparameters(max_new_tokens=4, ignore_eos=True)
    done = {}
    async with open_rollout_engine(backend, reward_pool=reward_pool) as engine:
        async def long_one():
            with trio.move_on_after(0.3):
                done["long"] = await engine.agenerate(ModelRequest(input_ids=_prompt(tok, "long"), gconfig=g))

        async def short_one():
            done["short"] = await engine.agenerate(ModelRequest(input_ids=_prompt(tok, "short"), gconfig=short))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(long_one)
            nursery.start_soon(short_one)
        # the withdrawn row stopped the batch early: the actor is free again
        after = await engine.agenerate(ModelRequest(input_ids=_prompt(tok, "next"), gconfig=short))
    assert "long" not in done
    assert done["short"].output_len == 4 and after.output_len == 4
    assert backend.statistics()["requests_served"] == 2


async def test_unsupported_parameter_is_a_clear_error(tiny, reward_pool):
    model, tok = tiny
    async with open_rollout_engine(HFBackend(model, tok, batch_window_s=0), reward_pool=reward_pool) as engine:
        with pytest.raises(InvalidRequestError, match="frequency_penalty"):
            await engine.agenerate(ModelRequest(input_ids=_prompt(tok, "x"),
                                                gconfig=GenerationHyperparameters(frequency_penalty=0.5)))

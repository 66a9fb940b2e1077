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

from conftest import HF_TEST_DEVICE as DEVICE

pytestmark = pytest.mark.slow


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama"), seed=0)


@pytest.fixture(scope="session")
def tiny(tiny_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval().to(DEVICE)
    return model, AutoTokenizer.from_pretrained(tiny_model_dir)


def _teacher_forced_logprobs(model, prompt, output):
    ids = torch.tensor([prompt + output], device=model.device)
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].float().cpu()  # [T, V]
    logp = torch.log_softmax(logits, dim=-1)
    positions = torch.arange(len(prompt) - 1, len(prompt) + len(output) - 1)
    return logp[positions, torch.tensor(output)]  # [n_out]


def _prompt(tok, text):
    return tok.apply_chat_template([{"role": "user", "content": text}], tokenize=True,
                                   add_generation_prompt=True, return_dict=False)


@pytest.mark.parametrize("serving", ["static", "continuous"])
async def test_concurrent_requests_logprobs_match_teacher_forcing(tiny, reward_pool, serving):
    model, tok = tiny
    backend = HFBackend(model, tok, device=DEVICE, dtype="float32", batch_window_s=0.05, mode=serving)
    prompts = [_prompt(tok, t) for t in ("hi", "what is 2+3?", "a much longer prompt, to force left padding")]
    g = GenerationHyperparameters(max_new_tokens=12, ignore_eos=True)
    results = {}
    async with open_rollout_engine(backend, reward_pool=reward_pool) as engine:
        async def one(i):
            results[i] = await engine.agenerate(ModelRequest(input_ids=prompts[i], gconfig=g))

        async with trio.open_nursery() as nursery:
            for i in range(len(prompts)):
                nursery.start_soon(one, i)
    if serving == "static":
        assert backend.statistics().batches == 1  # served as one batch
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
    async with open_rollout_engine(HFBackend(model, tok, device=DEVICE, dtype="float32", batch_window_s=0), reward_pool=reward_pool) as engine:
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
        ids = torch.tensor([p + g1.output_tokens], device=model.device)
        logits = model(input_ids=ids).logits[0].cpu()
    logits_argmax = logits[len(p) - 1 : -1].argmax(-1).tolist()
    assert g1.output_tokens == logits_argmax
    assert (ref - torch.tensor(g1.output_logprobs)).abs().max().item() < 1e-4


async def test_stop_token_and_stop_string(tiny, reward_pool):
    model, tok = tiny
    p = _prompt(tok, "stop here")
    greedy = GenerationHyperparameters(max_new_tokens=24, ignore_eos=True, greedy=True)
    async with open_rollout_engine(HFBackend(model, tok, device=DEVICE, dtype="float32", batch_window_s=0), reward_pool=reward_pool) as engine:
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


@pytest.mark.parametrize("serving", ["static", "continuous"])
async def test_cancelled_request_leaves_the_batch_and_others_complete(tiny, reward_pool, serving):
    model, tok = tiny
    backend = HFBackend(model, tok, device=DEVICE, dtype="float32", batch_window_s=0.05, mode=serving)
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
    assert backend.statistics().requests_served == 2


async def test_unsupported_parameter_is_a_clear_error(tiny, reward_pool):
    model, tok = tiny
    async with open_rollout_engine(HFBackend(model, tok, device=DEVICE, dtype="float32", batch_window_s=0), reward_pool=reward_pool) as engine:
        with pytest.raises(InvalidRequestError, match="frequency_penalty"):
            await engine.agenerate(ModelRequest(input_ids=_prompt(tok, "x"),
                                                gconfig=GenerationHyperparameters(frequency_penalty=0.5)))


@pytest.fixture(scope="session")
def other_weights(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    path = build_tiny_model(tmp_path_factory.mktemp("tiny-llama-b"), seed=1)
    return path, AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval().to(DEVICE)


@pytest.mark.parametrize("serving", ["static", "continuous"])
@pytest.mark.parametrize("mode", ["abort", "in_place"])
async def test_weight_update_mid_generation_of_8_requests(tiny_model_dir, other_weights, mode, serving, reward_pool):
    import threading

    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval().to(DEVICE)
    reference_a = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval().to(DEVICE)
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    b_path, reference_b = other_weights
    forwards, midway, all_added = [0], threading.Event(), threading.Event()
    original_forward = model.forward

    def counting_forward(*args, **kwargs):  # lets the test know decoding is under way
        forwards[0] += 1
        if forwards[0] == 1 and serving == "continuous":
            # transformers' continuous manager starts decoding the first request while the
            # others are still being added (a request added after the 6th step would be all
            # version 1: the flake this removes); hold its first step until all 8 are in
            assert all_added.wait(60)
        if forwards[0] == 6:
            midway.set()  # ... and holds this step until the update has been requested
            assert backend.update_requested.wait(60)
        return original_forward(*args, **kwargs)

    model.forward = counting_forward
    backend = HFBackend(model, tok, device=DEVICE, dtype="float32", batch_window_s=0.05, mode=serving)
    g = GenerationHyperparameters(max_new_tokens=24, ignore_eos=True)
    prompts = [_prompt(tok, f"question number {i}") for i in range(8)]
    results = {}
    async with open_rollout_engine(backend, reward_pool=reward_pool) as engine:
        if serving == "continuous":
            manager = backend._batcher.manager  # type: ignore[attr-defined]
            original_add, added = manager.add_request, [0]

            def counting_add(*args, **kwargs):
                result = original_add(*args, **kwargs)
                added[0] += 1
                if added[0] == 8:
                    all_added.set()
                return result

            manager.add_request = counting_add

        async def one(i):
            results[i] = await engine.agenerate(ModelRequest(input_ids=prompts[i], gconfig=g))

        async with trio.open_nursery() as nursery:
            for i in range(8):
                nursery.start_soon(one, i)
            await trio.to_thread.run_sync(midway.wait)
            source = b_path if mode == "abort" else reference_b.state_dict()
            await engine.update_weights(source, version=1, mode=mode)
        stats = engine.statistics()
    assert engine.version == 1 and stats.backend.weight_updates == 1
    for i in range(8):
        r = results[i]
        assert r.output_len == 24 and r.stop_reason == "length"
        k = r.output_versions.index(1)
        assert 0 < k < 24 and r.output_versions == [0] * k + [1] * (24 - k)
        lp = torch.tensor(r.output_logprobs)
        ref_a = _teacher_forced_logprobs(reference_a, prompts[i], r.output_tokens)
        assert (lp[:k] - ref_a[:k]).abs().max() < 1e-4  # before the boundary: old weights
        if mode == "abort":  # resumed with prompt + partial output, re-prefilled by the new weights
            ref_b = _teacher_forced_logprobs(reference_b, prompts[i], r.output_tokens)
            assert (lp[k:] - ref_b[k:]).abs().max() < 1e-4
        else:  # continued in place: new weights over the old KV cache
            assert (lp[k:] - ref_a[k:]).abs().max() > 1e-2
    if mode == "abort":
        assert stats.segments_resumed == 8 and stats.backend.aborts == 8
    else:
        assert stats.segments_resumed == 0


async def test_abort_exactly_at_the_budget_keeps_all_tokens_as_length(tiny, reward_pool):
    model, tok = tiny
    backend = HFBackend(model, tok, device=DEVICE, dtype="float32", batch_window_s=0)
    p = _prompt(tok, "budget")
    async with open_rollout_engine(backend, reward_pool=reward_pool) as engine:
        # the abort flag is raised before the batch starts: the row is stopped at its
        # first step, which is also its whole budget
        backend._batcher.gate.abort = True
        resp = await engine.agenerate(ModelRequest(input_ids=p, gconfig=GenerationHyperparameters(
            max_new_tokens=1, ignore_eos=True)))
        backend._batcher.gate.abort = False
    assert resp.stop_reason == "length" and resp.output_len == 1


async def test_update_weights_with_mismatched_weights_keeps_the_old_ones(tiny_model_dir, reward_pool):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from engine import BackendError

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval().to(DEVICE)
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    async with open_rollout_engine(HFBackend(model, tok, device=DEVICE, dtype="float32"), reward_pool=reward_pool) as engine:
        with pytest.raises(BackendError, match="do not fit"):
            await engine.update_weights({"nope": torch.zeros(1)}, version=5)
        assert engine.version == 0 and not engine.paused


async def test_update_weights_accepts_named_parameters_of_a_tied_model(tiny_model_dir, reward_pool):
    """Trainers that stream ``named_parameters()`` (OpenRLHF's ``broadcast_to_vllm``, verl) leave out
    a tied alias (``lm_head.weight`` of the tiny model, tied to the embeddings): the alias shares the
    given tensor's storage, so the weights are complete; an untied key left out is still refused."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from engine import BackendError

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval().to(DEVICE)
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    trained = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    with torch.no_grad():
        for param in trained.parameters():
            param.add_(0.5)
    named = {name: param.detach().clone() for name, param in trained.named_parameters()}
    assert "lm_head.weight" not in named and "lm_head.weight" in trained.state_dict()  # the tied alias
    async with open_rollout_engine(HFBackend(model, tok, device=DEVICE, dtype="float32"), reward_pool=reward_pool) as engine:
        await engine.update_weights(named, version=1)
        assert engine.version == 1
        assert torch.equal(model.lm_head.weight.cpu(), named["model.embed_tokens.weight"])
        partial = {k: v for k, v in named.items() if k != "model.norm.weight"}
        with pytest.raises(BackendError, match="model.norm.weight"):
            await engine.update_weights(partial, version=2)
        assert engine.version == 1


async def test_ignore_eos_is_honoured_even_when_the_model_emits_eos(tiny, reward_pool):
    model, tok = tiny
    eos = tok.eos_token_id
    p = _prompt(tok, "eos")
    greedy = GenerationHyperparameters(max_new_tokens=16, greedy=True, ignore_eos=True)
    with torch.no_grad():  # make the model strongly prefer EOS at every step
        bias = torch.zeros(model.config.vocab_size, device=model.device)
        bias[eos] = 50.0
        original = model.lm_head.bias if hasattr(model.lm_head, "bias") else None
        hook = model.lm_head.register_forward_hook(lambda mod, inp, out: out + bias)
    try:
        async with open_rollout_engine(HFBackend(model, tok, device=DEVICE, dtype="float32", batch_window_s=0), reward_pool=reward_pool) as engine:
            ignoring = await engine.agenerate(ModelRequest(input_ids=p, gconfig=greedy))
            stopping = await engine.agenerate(ModelRequest(input_ids=p, gconfig=greedy.new(ignore_eos=False)))
    finally:
        hook.remove()
    assert original is None or original is model.lm_head.bias
    assert ignoring.output_len == 16 and ignoring.output_tokens == [eos] * 16 and ignoring.stop_reason == "length"
    assert stopping.output_tokens == [eos] and stopping.stop_reason == "stop"


@pytest.mark.parametrize("serving", ["static", "continuous"])
async def test_logprobs_are_of_the_processed_distribution(tiny, reward_pool, serving):
    model, tok = tiny
    p = _prompt(tok, "temperature")
    g = GenerationHyperparameters(max_new_tokens=10, ignore_eos=True, temperature=0.7, top_k=20, top_p=0.9)
    backend = HFBackend(model, tok, device=DEVICE, dtype="float32", batch_window_s=0, mode=serving)
    async with open_rollout_engine(backend, reward_pool=reward_pool) as engine:
        r = await engine.agenerate(ModelRequest(input_ids=p, gconfig=g))
    from transformers import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    ids = torch.tensor([p + r.output_tokens])
    with torch.no_grad():
        logits = model(input_ids=ids.to(model.device)).logits[0, len(p) - 1 : -1].float().cpu()  # [n, V]
    for warper in (TemperatureLogitsWarper(0.7), TopKLogitsWarper(20), TopPLogitsWarper(0.9)):
        logits = warper(ids, logits)
    ref = torch.log_softmax(logits, -1).gather(1, torch.tensor(r.output_tokens)[:, None]).squeeze(1)
    assert (ref - torch.tensor(r.output_logprobs)).abs().max() < 1e-4


async def test_continuous_mode_rejects_what_it_cannot_honour(tiny, reward_pool):
    model, tok = tiny
    backend = HFBackend(model, tok, device=DEVICE, dtype="float32", mode="continuous")
    async with open_rollout_engine(backend, reward_pool=reward_pool) as engine:
        for bad in ({"greedy": True}, {"seed": 1}, {"min_new_tokens": 2}):
            with pytest.raises(InvalidRequestError, match=f"does not support gconfig.{next(iter(bad))}"):
                await engine.agenerate(ModelRequest(input_ids=_prompt(tok, "x"),
                                                    gconfig=GenerationHyperparameters(**bad)))


async def test_continuous_mode_stop_string(tiny, reward_pool):
    model, tok = tiny
    p = _prompt(tok, "stop string")
    g = GenerationHyperparameters(max_new_tokens=30, ignore_eos=True)
    async with open_rollout_engine(HFBackend(model, tok, device=DEVICE, dtype="float32", mode="continuous"), reward_pool=reward_pool) as engine:
        full = await engine.agenerate(ModelRequest(input_ids=p, gconfig=g))
        text = tok.decode(full.output_tokens, skip_special_tokens=False)
        # any 2-character needle: the next sample may or may not contain it
        needle = text[4:6]
        cut = await engine.agenerate(ModelRequest(input_ids=p, gconfig=g.new(stop=[needle])))
    decoded = tok.decode(cut.output_tokens, skip_special_tokens=False)
    if needle in decoded:
        # cut at the first token that completes the match (a special token may decode to many chars)
        assert cut.stop_reason == "stop"
        assert needle not in tok.decode(cut.output_tokens[:-1], skip_special_tokens=False)
    else:
        assert cut.stop_reason == "length" and cut.output_len == 30


@pytest.mark.parametrize("greedy", [True, False])
async def test_static_generate_draws_no_generation_config_warning(tiny_model_dir, greedy):
    """Regression: every hf run logged transformers' "The following generation flags are
    not valid and may be ignored: ['top_k']" (our greedy config set ``top_k=0``).  The
    model here brings Qwen-like sampling defaults in its generation config, which
    ``generate`` merges into ours wherever we leave a flag unset."""
    import logging

    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval().to(DEVICE)
    model.generation_config = GenerationConfig(do_sample=True, temperature=0.7, top_k=20, top_p=0.8,
                                               repetition_penalty=1.05)
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record)

    handler = Keep(logging.WARNING)
    library_logger = logging.getLogger("transformers")
    library_logger.addHandler(handler)
    logging.Logger.warning_once.cache_clear()  # transformers warns once per process: make it count here
    try:
        async with HFBackend(model, tok, device=DEVICE, dtype="float32", batch_window_s=0).open() as backend:
            g = GenerationHyperparameters(max_new_tokens=4, greedy=greedy, temperature=0.9, top_k=5)
            resp = await backend.generate(ModelRequest(input_ids=_prompt(tok, "hi"), gconfig=g), 4)
    finally:
        library_logger.removeHandler(handler)
    assert resp.output_len > 0
    assert [r.getMessage() for r in records] == []

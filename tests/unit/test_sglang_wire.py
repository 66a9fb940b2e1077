"""Unit tier: SGLang's ``/generate`` wire format (``engine.backends.sglang_wire``), the one
module the ``sglang`` client and ``rollout serve`` share.  Round trips: what the client
writes, the server reads back as the same request; what the server answers, the client
reads back as the same tokens, logprobs, stop reason and weight version."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.backends import sglang_wire as wire
from engine.types import GenerationHyperparameters as G
from engine.types import ModelRequest

VOCAB, CONTEXT = 1000, 4096


def server_reads(body, *, tokenize=lambda text: [ord(c) % VOCAB for c in text], context=CONTEXT):
    return wire.parse_generate_request(body, vocab_size=VOCAB, context_length=context, tokenize=tokenize)


gconfigs = st.builds(
    G,
    greedy=st.booleans(),
    temperature=st.floats(0.01, 3.0),
    top_p=st.floats(0.05, 1.0),
    top_k=st.one_of(st.just(wire.NO_TOP_K), st.integers(1, 500)),
    min_new_tokens=st.integers(0, 300),
    stop_token_ids=st.lists(st.integers(0, VOCAB - 1), max_size=3),
    ignore_eos=st.booleans(),
    skip_special_tokens=st.booleans(),
    stop=st.one_of(st.none(), st.lists(st.text(min_size=1, max_size=4), min_size=1, max_size=2)),
    frequency_penalty=st.floats(-2.0, 2.0),
    seed=st.one_of(st.none(), st.integers(0, 2**31 - 1)),
)


@settings(max_examples=200, deadline=None)
@given(g=gconfigs, budget=st.integers(1, 256), prompt=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=20),
       images=st.one_of(st.none(), st.lists(st.text("abc=", min_size=1, max_size=8), min_size=1, max_size=2)))
def test_a_request_round_trips_from_client_to_server(g, budget, prompt, images):
    request = ModelRequest(rid="ep", input_ids=prompt, gconfig=g, image_data=images)
    payload = wire.generate_payload(request, budget, "ep@00000007")
    call = server_reads(payload)
    got = call.request
    assert (got.rid, got.input_ids, got.image_data, call.budget, call.return_logprob) == (
        "ep@00000007", prompt, images, budget, True)
    assert wire.sampling_params(got.gconfig, call.budget) == payload["sampling_params"]  # a fixed point
    assert got.gconfig.greedy == g.greedy
    if not g.greedy:
        assert (got.gconfig.temperature, got.gconfig.top_p, got.gconfig.top_k) == (g.temperature, g.top_p, g.top_k)
    assert got.gconfig.min_new_tokens == min(g.min_new_tokens, budget)
    assert (got.gconfig.stop_token_ids, got.gconfig.stop, got.gconfig.seed) == (g.stop_token_ids, g.stop, g.seed)
    assert (got.gconfig.ignore_eos, got.gconfig.skip_special_tokens, got.gconfig.frequency_penalty) == (
        g.ignore_eos, g.skip_special_tokens, g.frequency_penalty)


def test_greedy_and_disabled_top_k_on_the_wire():
    sp = wire.sampling_params(G(greedy=True, temperature=0.3, top_p=0.5, top_k=7), 5)
    assert (sp["temperature"], sp["top_p"], sp["top_k"]) == (0.0, 1.0, -1)
    assert wire.sampling_params(G(), 5)["top_k"] == -1 and wire.sampling_top_k(20) == 20
    assert "stop" not in sp and "sampling_seed" not in sp
    assert "image_data" not in wire.generate_payload(ModelRequest(input_ids=[1]), 3, "r")


@pytest.mark.parametrize("finish, stop_reason", [
    (wire.finish_stop(7), "stop"), (wire.finish_stop("\n\n"), "stop"), (wire.finish_length(3), "length"),
    (wire.finish_abort("aborted by pause_generation"), "abort"),
])
def test_an_answer_round_trips_from_server_to_client(finish, stop_reason):
    tokens, logprobs = [5, 9, 7], [-0.5, -1.25, -3.0]
    body = wire.generate_answer(rid="ep@1", prompt_len=4, tokens=tokens, logprobs=logprobs, finish=finish,
                                weight_version="3", text="xyz", return_logprob=True, latency_s=0.1)
    answer = wire.parse_generate_answer(body)
    assert answer == wire.GenerateAnswer(tokens, logprobs, stop_reason, "3")
    assert wire.parse_generate_answer([body]) == answer  # a batch answer of one
    assert body["meta_info"]["completion_tokens"] == 3 and body["meta_info"]["prompt_tokens"] == 4


def test_an_aborted_answer_without_tokens_and_null_logprobs():
    body = wire.generate_answer(rid="r", prompt_len=2, tokens=[], logprobs=[], finish=wire.finish_abort("x"),
                                weight_version="0", text="", return_logprob=False, latency_s=0.0)
    assert "output_token_logprobs" not in body["meta_info"]
    assert wire.parse_generate_answer(body) == wire.GenerateAnswer([], [], "abort", "0")
    body = {"meta_info": {"finish_reason": {"type": "length"}, "output_token_logprobs": [[None, 4, None]]}}
    assert math.isnan(wire.parse_generate_answer(body).logprobs[0])


def test_answers_the_client_refuses():
    reject = {"meta_info": {"finish_reason": {"type": "abort", "message": "bad", "status_code": 400}}}
    with pytest.raises(wire.AnswerRejected, match=r"server rejected the request \(HTTP 400\): bad") as info:
        wire.parse_generate_answer(reject)
    assert info.value.server_fault is False
    disagree = {"output_ids": [1, 2], "meta_info": {"finish_reason": {"type": "stop"},
                                                     "output_token_logprobs": [[-1.0, 1, None], [-1.0, 3, None]]}}
    with pytest.raises(wire.AnswerRejected, match="output_ids disagree") as info:
        wire.parse_generate_answer(disagree)
    assert info.value.server_fault is True
    fewer = {"output_ids": [1, 2, 3], "meta_info": {"finish_reason": {"type": "stop"},
                                                     "output_token_logprobs": [[-1.0, 1, None]]}}
    assert wire.parse_generate_answer(fewer).tokens == [1, 2, 3]  # the evidence check reports the count
    with pytest.raises(ValueError, match="unknown finish_reason type 'eos'"):
        wire.parse_generate_answer({"meta_info": {"finish_reason": {"type": "eos"}}})
    with pytest.raises(ValueError, match="output_token_logprobs is missing"):
        wire.parse_generate_answer({"meta_info": {"finish_reason": {"type": "stop"}, "completion_tokens": 2}})
    with pytest.raises(ValueError, match="expected one result"):
        wire.parse_generate_answer([])
    with pytest.raises(KeyError):
        wire.parse_generate_answer({"text": "no meta_info"})


def test_the_server_reads_text_prompts_router_defaults_and_clamps_to_the_context():
    call = server_reads({"text": "hi", "sampling_params": {"max_new_tokens": None}, "model": "m", "priority": 3,
                         "logprob_start_len": 0, "stream": False, "lora_path": None}, context=10)
    assert call.request.input_ids == [ord("h"), ord("i")] and call.budget == 8 and call.return_logprob is False
    assert len(call.request.rid) == 32  # a fresh id
    assert server_reads({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 50}}, context=10).budget == 8
    assert server_reads({"input_ids": [1], "sampling_params": {"max_new_tokens": 0}}).budget == 0
    call = server_reads({"input_ids": [1], "image_data": "aGk=", "sampling_params": {"stop": "x", "top_k": None}})
    assert call.request.image_data == ["aGk="] and call.request.gconfig.stop == ["x"]
    assert call.request.gconfig.top_k == wire.NO_TOP_K and call.budget == 128
    assert server_reads({"input_ids": [1], "lora_path": "tenant-v3"}).request.lora_name == "tenant-v3"  # a loaded name


@pytest.mark.parametrize("body, message", [
    ([1, 2], "the body must be a JSON object"),
    ({"input_ids": [1], "custom_logit_processor": "x"}, r"unsupported field\(s\) \['custom_logit_processor'\]"),
    ({"input_ids": [1], "lora_path": ["x", "y"]}, "lora_path must be the name of a loaded LoRA adapter"),
    ({"input_ids": [1], "stream": True}, "does not stream"),
    ({"input_ids": [1], "top_logprobs_num": 2}, "top logprobs"),
    ({"sampling_params": {}}, "give one prompt as input_ids"),
    ({"input_ids": [[1], [2]]}, "no batches"),
    ({"input_ids": []}, "non-empty"),
    ({"input_ids": [1, VOCAB]}, rf"ints in \[0, {VOCAB}\)"),
    ({"input_ids": [True]}, "ints in"),
    ({"input_ids": [1], "sampling_params": [1]}, "sampling_params must be an object"),
    ({"input_ids": [1], "sampling_params": {"json_schema": "{}"}}, r"unsupported sampling_params \['json_schema'\]"),
    ({"input_ids": [1], "sampling_params": {"presence_penalty": 0.5}}, "presence_penalty=0.5 is not supported"),
    ({"input_ids": [1] * CONTEXT}, f"the prompt has {CONTEXT} tokens; the context is {CONTEXT}"),
    ({"input_ids": [1], "sampling_params": {"max_new_tokens": -1}}, "max_new_tokens must be an int >= 0"),
    ({"input_ids": [1], "sampling_params": {"top_p": 0}}, "bad sampling_params: top_p must be in"),
    ({"input_ids": [1], "sampling_params": {"temperature": "hot"}}, "bad sampling_params"),
    ({"input_ids": [1], "rid": ["a", "b"]}, "rid must be a string"),
    ({"input_ids": [1], "image_data": [1]}, "image_data must be a base64 string"),
])
def test_the_server_names_what_it_cannot_serve(body, message):
    with pytest.raises(wire.WireError, match=message):
        server_reads(body)

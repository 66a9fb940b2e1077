"""Unit tier: the OpenRLHF adapter's pure parts (no OpenRLHF installed): vLLM sampling params ->
the engine's config, a ModelResponse -> vLLM's RequestOutput text rules, rollout versions, the
one-line error when OpenRLHF is missing, the config's validation."""

from __future__ import annotations

import pytest

from engine import InvalidRequestError
from engine.integrations._openrlhf_params import SamplingParams, request_output, to_gconfig
from engine.integrations.openrlhf import OpenRLHFConfig, _versions, openrlhf_missing
from engine.testing import build_tiny_tokenizer
from engine.types import GenerationHyperparameters, ModelResponse

EOS = 4  # the tiny tokenizer's <|im_end|>


def ids(text):
    return [b + 5 for b in text.encode()]


def test_openrlhf_sampling_params_map_onto_the_engine_config():
    g = to_gconfig(SamplingParams(temperature=0.7, top_p=0.9, top_k=-1, max_tokens=None, min_tokens=1,
                                  skip_special_tokens=False, logprobs=1, stop=["\n\n"], stop_token_ids=[7], seed=3),
                   prompt_len=10, max_model_len=64)
    assert (g.max_new_tokens, g.max_tokens, g.min_new_tokens) == (54, 64, 1)  # max_tokens=None: up to max_model_len
    assert (g.temperature, g.top_p, g.top_k, g.greedy) == (0.7, 0.9, GenerationHyperparameters.top_k, False)
    assert g.stop == ["\n\n"] and g.stop_token_ids == [7] and g.seed == 3 and g.skip_special_tokens is False
    greedy = to_gconfig(SamplingParams(temperature=0.0, top_k=5, max_tokens=8), prompt_len=3, max_model_len=64)
    assert greedy.greedy and greedy.top_k == 5 and greedy.max_new_tokens == 8


@pytest.mark.parametrize("field, value", [("n", 2), ("logprobs", 5), ("presence_penalty", 0.5),
                                          ("repetition_penalty", 1.1), ("min_p", 0.1), ("prompt_logprobs", 1)])
def test_unsupported_sampling_settings_are_one_error_naming_the_field(field, value):
    with pytest.raises(InvalidRequestError, match=f"sampling_params.{field}"):
        to_gconfig(SamplingParams(**{field: value}), prompt_len=1, max_model_len=16)


def resp(tokens, stop_reason="stop"):
    return ModelResponse(input_tokens=[1, 2], output_tokens=tokens, output_logprobs=[-0.5] * len(tokens),
                         output_versions=[3] * len(tokens), stop_reason=stop_reason)


def test_request_output_follows_vllm_text_rules():
    tok = build_tiny_tokenizer()
    params = SamplingParams(skip_special_tokens=False, logprobs=1)
    out = request_output(resp(ids("hi") + [EOS]), params, tok, eos_token_ids=frozenset([EOS])).outputs[0]
    assert out.token_ids == ids("hi") + [EOS] and out.text == "hi"  # EOS kept in the ids, not in the text
    assert out.finish_reason == "stop" and out.stop_reason is None and out.token_versions == [3, 3, 3]
    assert [d[t].logprob for d, t in zip(out.logprobs, out.token_ids)] == [-0.5] * 3
    keep = SamplingParams(skip_special_tokens=False, include_stop_str_in_output=True)
    assert request_output(resp(ids("hi") + [EOS]), keep, tok, eos_token_ids=frozenset([EOS])).outputs[0].text \
        == "hi<|im_end|>"
    cut = request_output(resp(ids("ab\n\ncd")), SamplingParams(stop=["\n\n"]), tok, eos_token_ids=frozenset([EOS]))
    assert cut.outputs[0].text == "ab" and cut.outputs[0].stop_reason == "\n\n" and cut.outputs[0].logprobs is None
    token_stop = request_output(resp(ids("ab")), SamplingParams(stop_token_ids=[ids("b")[0]]), tok,
                                eos_token_ids=frozenset([EOS])).outputs[0]
    assert token_stop.text == "a" and token_stop.stop_reason == ids("b")[0]
    length = request_output(resp(ids("abc"), "length"), params, tok, eos_token_ids=frozenset([EOS])).outputs[0]
    assert length.finish_reason == "length" and length.text == "abc"


def test_rollout_versions_fill_the_action_ranges_only():
    row = {"observation_tokens": list(range(8)), "action_ranges": [(2, 4), (6, 8)]}
    assert _versions(row, [[0, 0], [1, 1]]) == [-1, -1, 0, 0, -1, -1, 1, 1]
    assert _versions(row, [[0, 0]]) is None  # a custom executor whose ranges are not its generate calls


def test_the_adapter_imports_without_openrlhf_and_says_how_to_get_it():
    why = openrlhf_missing()
    if why is not None:  # the default venv
        assert "tests/integrations/openrlhf/venv.sh" in why and "\n" not in why


@pytest.mark.parametrize("field, value", [("max_attempts", 0), ("max_model_len", -1), ("execute_timeout_s", 0),
                                          ("execute_timeout_s", float("nan"))])
def test_config_rejects_bad_values_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        OpenRLHFConfig(**{field: value})

"""Unit tier: the AReaL request/response contracts (engine.types)."""

from __future__ import annotations

import dataclasses

import pytest

from engine.errors import InvalidRequestError
from engine.types import GenerationHyperparameters, ModelRequest, ModelResponse


def test_generation_hyperparameters_defaults_match_areal():
    g = GenerationHyperparameters()
    expected = dict(n_samples=1, max_new_tokens=16384, min_new_tokens=0, max_tokens=32768, greedy=False,
                    top_p=1.0, top_k=100_000_000, temperature=1.0, stop_token_ids=[], ignore_eos=False,
                    skip_special_tokens=True, stop=None, frequency_penalty=0.0, seed=None)
    assert dataclasses.asdict(g) == expected


def test_new_copies_and_overrides_without_sharing_lists():
    g = GenerationHyperparameters(stop_token_ids=[7])
    h = g.new(temperature=0.5)
    assert h.temperature == 0.5 and g.temperature == 1.0
    h.stop_token_ids.append(9)
    assert g.stop_token_ids == [7]
    with pytest.raises(TypeError, match="no_such_field"):
        g.new(no_such_field=1)


class _Tok:
    def __init__(self, pad, eos):
        self.pad_token_id, self.eos_token_id = pad, eos


def test_new_with_stop_and_pad_token_ids_appends_pad_then_eos_once():
    g = GenerationHyperparameters(stop_token_ids=[5])
    assert g.new_with_stop_and_pad_token_ids(_Tok(0, 2)).stop_token_ids == [5, 0, 2]
    assert g.new(stop_token_ids=[2, 5]).new_with_stop_and_pad_token_ids(_Tok(0, 2)).stop_token_ids == [2, 5, 0]
    assert g.new_with_stop_and_pad_token_ids(_Tok(None, 2)).stop_token_ids == [5, 2]
    assert g.stop_token_ids == [5]


@pytest.mark.parametrize(
    ("prompt_len", "max_tokens", "max_new", "budget"),
    [(10, 100, 50, 50), (80, 100, 50, 20), (99, 100, 50, 1)],
)
def test_token_budget_rule(prompt_len, max_tokens, max_new, budget):
    g = GenerationHyperparameters(max_tokens=max_tokens, max_new_tokens=max_new)
    assert g.token_budget(prompt_len) == budget


def test_budget_of_zero_or_less_is_an_error_before_sending():
    req = ModelRequest(input_ids=list(range(100)), gconfig=GenerationHyperparameters(max_tokens=100))
    with pytest.raises(InvalidRequestError, match="budget"):
        req.validate()


@pytest.mark.parametrize(
    ("req", "match"),
    [
        (ModelRequest(input_ids=[]), "input_ids is empty"),
        (ModelRequest(input_ids=[1, -2]), "non-negative ints"),
        (ModelRequest(input_ids=[1], gconfig=GenerationHyperparameters(n_samples=2)), "n_samples == 1"),
        (ModelRequest(input_ids=[1], gconfig=GenerationHyperparameters(top_p=0)), "top_p"),
        (ModelRequest(input_ids=[1], gconfig=GenerationHyperparameters(temperature=float("nan"))), "temperature"),
    ],
)
def test_request_validation_names_the_field(req, match):
    with pytest.raises(InvalidRequestError, match=match):
        req.validate()


def test_request_ids_are_unique_and_response_lengths():
    assert ModelRequest().rid != ModelRequest().rid
    r = ModelResponse(input_tokens=[1, 2, 3], output_tokens=[4, 5])
    assert (r.input_len, r.output_len) == (3, 2)

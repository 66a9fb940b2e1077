"""Unit tier: the evidence rules of ``engine.backends.base.validate_response``, every one,
element by element, and its C-level fast path (``_plain_evidence``) against the precise
per-element rules: the fast path may only accept what the rules accept."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from engine.backends.base import VLLM_LOGPROB_SENTINEL, _plain_evidence, validate_response
from engine.errors import BackendError, InvalidRequestError
from engine.types import STOP_REASONS, ModelRequest, ModelResponse


def _resp(tokens, logprobs, stop_reason="stop", versions=None):
    return ModelResponse(input_tokens=[1], output_tokens=tokens, output_logprobs=logprobs,
                         output_versions=[0] * len(tokens) if versions is None else versions,
                         stop_reason=stop_reason)


def _precise_ok(tokens, logprobs, stop_reason) -> bool:
    """The rules, one element at a time (the specification the fast path must agree with)."""
    for lp in logprobs:
        if isinstance(lp, bool) or not isinstance(lp, (int, float)):
            return False
        if isinstance(lp, int) and abs(lp) >= 2**1024:  # past the float range (math.isfinite would raise)
            return False
        if not math.isfinite(lp) or lp == VLLM_LOGPROB_SENTINEL or lp > 1e-4:
            return False
    if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in tokens):
        return False
    return stop_reason in STOP_REASONS


@pytest.mark.parametrize(
    ("logprobs", "match"),
    [
        ([-0.1, math.nan, -0.2], r"output_logprobs\[1\] = nan is not a valid log-probability"),
        ([-0.1, -0.2, math.inf], r"output_logprobs\[2\] = inf is not a valid log-probability"),
        ([-math.inf, -0.1, -0.2], r"output_logprobs\[0\] = -inf is not a valid log-probability"),
        ([math.inf, -math.inf, -0.2], r"output_logprobs\[0\] = inf"),  # their sum is NaN
        ([-0.1, VLLM_LOGPROB_SENTINEL, -0.2], r"output_logprobs\[1\] = -9999.0 is not a valid"),
        ([-0.1, -0.2, 0.5], r"output_logprobs\[2\] = 0.5 is not a valid log-probability"),
        ([-0.1, 2e-4, -0.2], r"output_logprobs\[1\] = 0.0002"),
        ([-0.1, True, -0.2], r"output_logprobs\[1\] is bool, not a float"),
        (["-0.1", -0.1, -0.2], r"output_logprobs\[0\] is str, not a float"),
        ([-0.1, -0.2, np.float32(-0.3)], r"output_logprobs\[2\] is float32, not a float"),
        ([-0.1, None, -0.2], r"output_logprobs\[1\] is NoneType, not a float"),
        ([-0.1, 1, -0.2], r"output_logprobs\[1\] = 1 is not a valid"),  # an int: checked like a float
        ([-0.1, -(10**400), -0.2], r"output_logprobs\[1\] = -1000.* is not a valid"),  # past the float range
    ],
)
def test_each_bad_logprob_is_named(logprobs, match):
    req = ModelRequest(input_ids=[1])
    with pytest.raises(BackendError, match=match) as info:
        validate_response(_resp([3, 4, 5], logprobs), req)
    assert req.rid in str(info.value)


@pytest.mark.parametrize(
    ("tokens", "match"),
    [
        ([3, -1, 5], r"output_tokens\[1\] = -1 is not a token id"),
        ([3, 4, True], r"output_tokens\[2\] = True is not a token id"),
        ([3.0, 4, 5], r"output_tokens\[0\] = 3.0 is not a token id"),
        ([3, np.int64(4), 5], r"output_tokens\[1\] = .*4.* is not a token id"),
        ([3, "4", 5], r"output_tokens\[1\] = '4' is not a token id"),
    ],
)
def test_each_bad_token_is_named(tokens, match):
    with pytest.raises(BackendError, match=match):
        validate_response(_resp(tokens, [-0.1, -0.2, -0.3]), ModelRequest(input_ids=[1]))


def test_a_bad_logprob_is_reported_before_a_bad_token():
    with pytest.raises(BackendError, match=r"output_logprobs\[2\]"):
        validate_response(_resp([-1, 4, 5], [-0.1, -0.2, math.nan]), ModelRequest(input_ids=[1]))


@pytest.mark.parametrize("tokens", [[], [3, 4]])
def test_unknown_stop_reason(tokens):
    resp = _resp(tokens, [-0.5] * len(tokens), stop_reason="eos")
    with pytest.raises(BackendError, match="unknown stop_reason 'eos'"):
        validate_response(resp, ModelRequest(input_ids=[1]))


@pytest.mark.parametrize(
    ("tokens", "logprobs"),
    [
        ([], []),
        ([0, 7, 2**70], [0.0, 1e-4, -1e300]),  # a token id past int64 and the edges of the logprob range
        ([3, 4], [0, -2]),  # ints as logprobs (the precise path)
        ([3, 4], [np.float64(-0.5), -0.25]),  # a float subclass
        ([3, 4, 5], [-1e308, -1e308, -1e308]),  # finite, though their sum overflows to -inf
        ([3, 4], [-9998.999, -10000.0]),  # near the vLLM sentinel, not it
    ],
)
def test_valid_evidence_passes(tokens, logprobs):
    validate_response(_resp(tokens, logprobs), ModelRequest(input_ids=[1]))


def test_counts_must_match():
    with pytest.raises(BackendError, match="2 output_tokens but 1 output_logprobs"):
        validate_response(_resp([3, 4], [-0.1]), ModelRequest(input_ids=[1]))
    with pytest.raises(BackendError, match="2 output_tokens but 3 output_versions"):
        validate_response(_resp([3, 4], [-0.1, -0.2], versions=[0, 0, 0]), ModelRequest(input_ids=[1]))


_ODD_TOKENS = [-1, True, False, 3.0, np.int64(3), "3", None, 2**64]
_ODD_LOGPROBS = [math.nan, math.inf, -math.inf, VLLM_LOGPROB_SENTINEL, 1e-4, 2e-4, 0.0, 0, -3, True, False,
                 np.float32(-1.0), np.float64(-1.0), "x", None, -1e308, 1e308, 10**400]


def test_fast_path_accepts_only_what_the_rules_accept():
    rng = random.Random(1)
    for _ in range(3000):
        n = rng.randrange(0, 6)
        tokens: list = [rng.randrange(0, 50_000) for _ in range(n)]
        logprobs: list = [-rng.random() * 5 for _ in range(n)]
        for _ in range(rng.randrange(0, 3)):
            if n and rng.random() < 0.5:
                tokens[rng.randrange(n)] = rng.choice(_ODD_TOKENS)
            elif n:
                logprobs[rng.randrange(n)] = rng.choice(_ODD_LOGPROBS)
        expected = _precise_ok(tokens, logprobs, "stop")
        if _plain_evidence(tokens, logprobs):
            assert expected, (tokens, logprobs)
        try:
            validate_response(_resp(tokens, logprobs), ModelRequest(input_ids=[1]))
        except BackendError:
            assert not expected, (tokens, logprobs)
        else:
            assert expected, (tokens, logprobs)


def test_request_input_ids_rules():
    for ids in ([1, -2], [1, True], [1, 2.0], [1, np.int64(2)], (1, 2, -3)):
        with pytest.raises(InvalidRequestError, match="input_ids must be non-negative ints"):
            ModelRequest(input_ids=ids).validate()
    assert ModelRequest(input_ids=(1, 2), gconfig=ModelRequest().gconfig.new(max_tokens=10)).validate() == 8
    assert ModelRequest(input_ids=[0, 2**70], gconfig=ModelRequest().gconfig.new(max_tokens=10)).validate() == 8

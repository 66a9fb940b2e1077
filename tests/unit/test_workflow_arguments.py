"""Unit tier: the multi-turn workflows check the arguments they share the same way
(``turn_discount`` a number in [0, 1], ``max_turns`` an int >= 1), at construction."""

from __future__ import annotations

import math

import pytest

from engine.testing import build_tiny_tokenizer
from engine.types import GenerationHyperparameters
from rewards.gsm8k import gsm8k_reward
from workflows.math_agent import MathAgentWorkflow
from workflows.multi_turn import MultiTurnWorkflow

WORKFLOWS = [MathAgentWorkflow, MultiTurnWorkflow]


def _build(cls, **kwargs):
    return cls(gsm8k_reward, GenerationHyperparameters(max_new_tokens=8), build_tiny_tokenizer(), **kwargs)


@pytest.mark.parametrize("cls", WORKFLOWS)
@pytest.mark.parametrize("value", [True, -0.1, 1.5, math.nan, "0.5", None])
def test_a_turn_discount_outside_0_1_is_refused_naming_it(cls, value):
    with pytest.raises(ValueError, match=r"turn_discount must be a number in \[0, 1\], got "):
        _build(cls, turn_discount=value)


@pytest.mark.parametrize("cls", WORKFLOWS)
@pytest.mark.parametrize("value", [0, 0.0, 0.5, 1])
def test_turn_discounts_in_0_1_are_kept_as_floats(cls, value):
    wf = _build(cls, turn_discount=value)
    assert wf.turn_discount == float(value) and type(wf.turn_discount) is float


@pytest.mark.parametrize("cls", WORKFLOWS)
@pytest.mark.parametrize("value", [0, True, 1.0, "2"])
def test_max_turns_must_be_an_int_of_at_least_1(cls, value):
    with pytest.raises(ValueError, match=r"max_turns must be an int >= 1, got "):
        _build(cls, max_turns=value)

"""The device check's trajectory checker (benchmarks/gpu_check_episodes.py): ``is_truncated``
follows the engine's contract (CONTRACTS.md: ``is_truncated == (stop_reason == "length")``)."""

from __future__ import annotations

from benchmarks.gpu_check_episodes import Checker, check_rows
from engine.trajectory import trajectory_from_response
from engine.types import ModelResponse

STOP = 2  # the stop (eos) token of these rows


def _traj(output: list[int], *, reason: str) -> object:
    resp = ModelResponse(input_tokens=[5, 6, 7], output_tokens=output, output_logprobs=[-0.5] * len(output),
                         output_versions=[0] * len(output), stop_reason=reason)
    return trajectory_from_response(resp, 1.0)


def _failures(traj: object, budget: int) -> list[str]:
    chk = Checker()
    check_rows(traj, where="t", stop_ids={STOP}, budget=budget, versions={0}, chk=chk)
    return chk.failures


def test_a_stop_token_as_the_last_allowed_token_is_not_truncated():
    # the GPU run's false alarm: 128 tokens of a budget of 128, the 128th is the stop token
    assert _failures(_traj([9, 9, STOP], reason="stop"), budget=3) == []


def test_a_row_at_the_budget_on_another_token_is_truncated():
    assert _failures(_traj([9, 9, 9], reason="length"), budget=3) == []
    assert any("is_truncated False" in f for f in _failures(_traj([9, 9, 9], reason="stop"), budget=3))


def test_a_stop_before_the_budget_is_not_truncated():
    assert _failures(_traj([9, STOP], reason="stop"), budget=3) == []
    assert any("is_truncated True" in f for f in _failures(_traj([9, STOP], reason="length"), budget=3))


def test_a_row_over_the_budget_fails():
    assert any("over the budget" in f for f in _failures(_traj([9, 9, 9, 9], reason="length"), budget=3))


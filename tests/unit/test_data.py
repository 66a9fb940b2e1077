"""Unit tier: trajectory construction and AReaL's padding/concatenation rules."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tensordict import TensorDict

from engine.data import TRAJECTORY_SCHEMA, concat_padded_tensors
from engine.trajectory import trajectory_from_response
from engine.types import ModelResponse


def _resp(n_in, n_out, version=3, stop="stop"):
    return ModelResponse(input_tokens=list(range(10, 10 + n_in)), output_tokens=list(range(50, 50 + n_out)),
                         output_logprobs=[-0.5] * n_out, output_versions=[version] * n_out, stop_reason=stop)


def test_trajectory_fields_dtypes_and_values():
    td = trajectory_from_response(_resp(3, 2, stop="length"), 1.0)
    assert td.batch_size == torch.Size([1])
    assert set(td.keys()) == set(TRAJECTORY_SCHEMA)
    for key, (dims, dtype) in TRAJECTORY_SCHEMA.items():
        assert td[key].dtype == dtype, key
        assert td[key].shape == ((1, 5) if dims == "BT" else (1,)), key
    assert td["input_ids"].tolist() == [[10, 11, 12, 50, 51]]
    assert td["loss_mask"].tolist() == [[0, 0, 0, 1, 1]]
    assert td["logprobs"].tolist() == [[0, 0, 0, -0.5, -0.5]]
    assert td["versions"].tolist() == [[-1, -1, -1, 3, 3]]
    assert td["turn_ids"].tolist() == [[-1, -1, -1, 0, 0]]
    assert td["is_truncated"].tolist() == [True]
    assert td["rewards"].tolist() == [1.0]


def test_trajectory_rejects_mismatched_evidence():
    bad = _resp(2, 2)
    bad.output_logprobs = [-1.0]
    with pytest.raises(ValueError, match="output_logprobs"):
        trajectory_from_response(bad, 0.0)


def test_concat_pads_attention_mask_with_zero_versions_turn_ids_with_minus_one_others_with_pad_value():
    a = trajectory_from_response(_resp(2, 1), 1.0)  # T=3
    b = trajectory_from_response(_resp(3, 2), 0.0)  # T=5
    out = concat_padded_tensors([a, b], pad_value=7)
    assert out.batch_size == torch.Size([2])
    assert out["input_ids"].tolist()[0] == [10, 11, 50, 7, 7]
    assert out["attention_mask"].tolist()[0] == [True, True, True, False, False]
    assert out["versions"].tolist()[0] == [-1, -1, 3, -1, -1]  # -1: not a real version (0 is one)
    assert out["turn_ids"].tolist()[0] == [-1, -1, 0, -1, -1]
    assert out["rewards"].tolist() == [1.0, 0.0]  # 1-D: concatenated unpadded
    for key, (_, dtype) in TRAJECTORY_SCHEMA.items():
        assert out[key].dtype == dtype


def test_concat_different_key_sets_is_value_error_naming_index():
    a = trajectory_from_response(_resp(2, 1), 1.0)
    b = trajectory_from_response(_resp(2, 1), 1.0)
    del b["turn_ids"]
    with pytest.raises(ValueError, match=r"trajectory 1 .*missing \['turn_ids'\]"):
        concat_padded_tensors([a, b])


def test_concat_dtype_mismatch_is_an_error():
    a = trajectory_from_response(_resp(2, 1), 1.0)
    b = trajectory_from_response(_resp(2, 1), 1.0)
    b["logprobs"] = b["logprobs"].double()
    with pytest.raises(ValueError, match="logprobs.*float64"):
        concat_padded_tensors([a, b])


def test_concat_pads_every_non_batch_dim():
    a = TensorDict({"x": torch.ones(1, 2, 3)}, batch_size=[1])
    b = TensorDict({"x": torch.ones(2, 4, 1)}, batch_size=[2])
    out = concat_padded_tensors([a, b])
    assert out["x"].shape == (3, 4, 3)
    assert out["x"].sum().item() == 6 + 8


def test_concat_empty():
    assert concat_padded_tensors([]).batch_size == torch.Size([0])


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 6), st.integers(0, 6)), min_size=1, max_size=6))
def test_concat_preserves_every_real_token(shapes):
    tds = [trajectory_from_response(_resp(i, o), float(k)) for k, (i, o) in enumerate(shapes)]
    out = concat_padded_tensors(tds)
    t_max = max(i + o for i, o in shapes)
    assert out["input_ids"].shape == (len(shapes), t_max)
    for row, (td, (i, o)) in enumerate(zip(tds, shapes)):
        mask = out["attention_mask"][row]
        assert int(mask.sum()) == i + o
        assert torch.equal(out["input_ids"][row][mask], td["input_ids"][0])
        assert int(out["loss_mask"][row].sum()) == o


def test_trajectory_keeps_per_token_versions_and_fallback_flag():
    # a generation resumed across a weight update carries two versions; the
    # one-version fast path must not flatten them
    resp = ModelResponse(input_tokens=[7, 8], output_tokens=[20, 21, 22, 23], output_logprobs=[-0.1, -0.2, -0.3, -0.4],
                         output_versions=[4, 4, 5, 5], stop_reason="length")
    td = trajectory_from_response(resp, 0.5, turn_id=2, reward_is_fallback=True)
    assert td["versions"].tolist() == [[-1, -1, 4, 4, 5, 5]]
    assert td["turn_ids"].tolist() == [[-1, -1, 2, 2, 2, 2]]
    assert td["logprobs"][0, 2:].tolist() == pytest.approx([-0.1, -0.2, -0.3, -0.4])
    assert td["rewards"].tolist() == [0.5] and td["is_truncated"].tolist() == [True]
    assert td["reward_is_fallback"].dtype == torch.bool and td["reward_is_fallback"].tolist() == [True]
    assert "reward_is_fallback" not in trajectory_from_response(resp, 0.5).keys()


def test_trajectory_of_an_empty_completion():
    resp = ModelResponse(input_tokens=[7, 8], output_tokens=[], output_logprobs=[], output_versions=[],
                         stop_reason="abort")
    td = trajectory_from_response(resp, 0.0)
    assert td["input_ids"].tolist() == [[7, 8]] and td["loss_mask"].tolist() == [[0, 0]]
    assert td["versions"].tolist() == [[-1, -1]]

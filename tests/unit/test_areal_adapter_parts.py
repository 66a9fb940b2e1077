"""The parts of the AReaL adapter that need no AReaL (engine.integrations.areal, _areal_convert).

The public module imports without AReaL and says, in one line, how to get it; its options are
validated; an AReaL trajectory dict round-trips through the engine's TensorDict and its group
concatenation back to AReaL's per-group dicts with AReaL's padding (``versions`` pads with 0,
not the engine's -1), each group cut to its own width.  The tier itself (AReaL's own code on
the adapter) is tests/integrations/areal."""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace

import pytest
import torch

from engine import EngineConfig
from engine.data import concat_padded_tensors
from engine.errors import InvalidRequestError, WorkflowError
from engine.integrations import areal as areal_module
from engine.integrations._areal_convert import to_areal_groups, to_engine_gconfig, to_engine_trajectory
from engine.integrations.areal import AReaLEngineOptions


def _areal_row(ids, gen, reward, version=0):
    """One RLVR row as AReaL's RLVRWorkflow builds it: [1, T] tensors and rewards [1]."""
    n = len(ids)
    return {"input_ids": torch.tensor([ids], dtype=torch.int32),
            "loss_mask": torch.tensor([[0] * (n - gen) + [1] * gen], dtype=torch.int32),
            "logprobs": torch.tensor([[0.0] * (n - gen) + [-0.5] * gen], dtype=torch.float32),
            "versions": torch.tensor([[-1] * (n - gen) + [version] * gen], dtype=torch.int32),
            "attention_mask": torch.ones(1, n, dtype=torch.bool),
            "rewards": torch.tensor([reward], dtype=torch.float32)}


def _group(td, task_id):
    rows = td.batch_size[0]
    td["group_id"] = torch.full((rows,), task_id, dtype=torch.int64)
    td["group_size"] = torch.full((rows,), rows, dtype=torch.int32)
    return td


@pytest.mark.skipif(importlib.util.find_spec("areal") is not None, reason="AReaL is installed here")
def test_without_areal_the_module_imports_and_names_the_venv():
    assert "AReaLInferenceEngine" in areal_module.__all__
    with pytest.raises(ImportError, match=r"needs AReaL 1\.0\.4 .*tests/integrations/areal/venv\.sh"):
        areal_module.AReaLInferenceEngine  # noqa: B018


def test_options_are_validated_naming_the_field():
    with pytest.raises(ValueError, match="weight_update_timeout_s"):
        AReaLEngineOptions(weight_update_timeout_s=0)
    with pytest.raises(ValueError, match="cancel_grace_s"):
        AReaLEngineOptions(cancel_grace_s=float("nan"))
    with pytest.raises(ValueError, match="reward_normalization must be False"):
        AReaLEngineOptions(engine_config=EngineConfig(reward_normalization=True))
    with pytest.raises(ValueError, match="engine.EngineConfig"):
        AReaLEngineOptions(engine_config={"max_concurrent_rollouts": 4})


def test_groups_come_back_with_areals_padding_each_cut_to_its_own_width():
    # two groups of two members of different lengths, as the engine concatenates them
    g1 = [to_engine_trajectory(_areal_row([1, 2, 3, 4], 2, 1.0)), to_engine_trajectory(_areal_row([1, 2, 5], 1, 0.0))]
    g2 = [to_engine_trajectory(_areal_row([7, 8, 9, 9, 9, 9], 3, 0.5, 2)),
          to_engine_trajectory(_areal_row([7, 8], 1, 0.25, 2))]
    batch = concat_padded_tensors([_group(concat_padded_tensors(g1), 10), _group(concat_padded_tensors(g2), 11)])
    assert batch["versions"][1, 3] == -1  # the engine's pad: AReaL's is 0
    first, second = to_areal_groups(batch)
    assert set(first) == {"input_ids", "loss_mask", "logprobs", "versions", "attention_mask", "rewards"}
    assert first["input_ids"].shape == (2, 4) and second["input_ids"].shape == (2, 6)  # each its own width
    assert first["versions"].tolist() == [[-1, -1, 0, 0], [-1, -1, 0, 0]]  # padding 0, as AReaL's concat
    assert second["versions"][1].tolist() == [-1, 2, 0, 0, 0, 0]
    assert first["attention_mask"].tolist() == [[True] * 4, [True, True, True, False]]
    assert {k: v.dtype for k, v in first.items()} == {k: v.dtype for k, v in _areal_row([1], 1, 0.0).items()}
    assert second["rewards"].tolist() == [0.5, 0.25]
    kept = to_areal_groups(batch, keep_engine_keys=True)[0]
    assert kept["group_id"].tolist() == [10, 10]


def test_bad_trajectories_fail_the_episode_naming_the_key():
    assert to_engine_trajectory(None) is None and to_engine_trajectory({}) is None
    with pytest.raises(WorkflowError, match="attention_mask"):
        to_engine_trajectory({"input_ids": torch.zeros(1, 3, dtype=torch.int32)})
    row = _areal_row([1, 2], 1, 1.0)
    with pytest.raises(WorkflowError, match="'multi_modal_input' as list"):
        to_engine_trajectory({**row, "multi_modal_input": [{"pixel_values": None}]})
    with pytest.raises(WorkflowError, match="'rewards' is a 0-d tensor"):
        to_engine_trajectory({**row, "rewards": torch.tensor(1.0)})
    with pytest.raises(WorkflowError, match="2 rows"):
        to_engine_trajectory({**row, "rewards": torch.zeros(2)})


def test_areals_sampling_parameters_map_by_name():
    areal_gconfig = SimpleNamespace(n_samples=1, max_new_tokens=7, min_new_tokens=0, max_tokens=100, greedy=False,
                                    top_p=0.9, top_k=5, temperature=0.7, stop_token_ids=[4, None], ignore_eos=False,
                                    skip_special_tokens=True, stop=("</s>",), frequency_penalty=0.1,
                                    lora_name="default_lora", use_beam_search=False)
    ours = to_engine_gconfig(areal_gconfig)
    assert (ours.max_new_tokens, ours.top_p, ours.top_k, ours.temperature, ours.stop_token_ids, ours.stop) == \
        (7, 0.9, 5, 0.7, [4], ["</s>"])
    with pytest.raises(InvalidRequestError, match="use_beam_search"):
        to_engine_gconfig(SimpleNamespace(**{**vars(areal_gconfig), "use_beam_search": True}))

"""Unit tier: LoRA adapter versions and their leases (engine.backends.lora), the request
field ``lora_name``, and the adapter files (read, write, checks) without a model."""

from __future__ import annotations

import pytest
import torch

from engine import InvalidRequestError, ModelRequest
from engine.backends.lora import (AdapterVersions, AdapterWeights, check_adapter, is_adapter_source, read_adapter,
                                  same_base_model, write_adapter)
from engine.errors import BackendError
from engine.types import versioned_lora_name


def test_versioned_names_are_areal_s():
    assert versioned_lora_name("lora", 3) == "lora-v3"


@pytest.mark.parametrize("bad", ["", "a b", "a/b", 3])
def test_a_bad_lora_name_is_refused_naming_the_field(bad):
    with pytest.raises(InvalidRequestError, match="lora_name"):
        ModelRequest(input_ids=[1], lora_name=bad).validate()


def test_a_version_is_unloaded_only_after_its_last_lease_comes_back():
    retired = []
    versions = AdapterVersions(retired.append)
    versions.add("lora", 0)
    a = versions.acquire()
    b = versions.acquire()
    assert a.served_name == b.served_name == "lora-v0" and versions.in_flight("lora-v0") == 2
    versions.add("lora", 1)  # traffic moves to v1; v0 still has two segments in flight
    assert retired == [] and versions.loaded() == ("lora-v0", "lora-v1")
    assert versions.acquire().served_name == "lora-v1"
    versions.release(a)
    assert retired == []
    versions.release(b)
    assert [lease.served_name for lease in retired] == ["lora-v0"]
    versions.unloaded(retired[0])
    assert versions.loaded() == ("lora-v1",) and versions.statistics().unloads == 1


def test_a_version_nobody_holds_is_handed_over_when_it_is_replaced():
    retired = []
    versions = AdapterVersions(retired.append)
    versions.add("lora", 0)
    versions.add("lora", 1)
    assert [lease.served_name for lease in retired] == ["lora-v0"]
    versions.release(versions.acquire())  # v1 is current: releasing it retires nothing
    assert len(retired) == 1


def test_a_version_is_loaded_once():
    versions = AdapterVersions(lambda lease: None)
    versions.add("lora", 2)
    with pytest.raises(BackendError, match="loaded already"):
        versions.add("lora", 2)


def test_a_moved_lease_frees_the_old_version():
    retired = []
    versions = AdapterVersions(retired.append)
    versions.add("lora", 0)
    lease = versions.acquire()
    new = versions.add("lora", 1)
    moved = versions.move(lease, new)
    assert moved == new and [x.served_name for x in retired] == ["lora-v0"] and versions.in_flight("lora-v1") == 1


def test_an_unknown_adapter_name_lists_the_served_ones():
    versions = AdapterVersions(lambda lease: None, default="policy")
    versions.add("policy", 0)
    with pytest.raises(InvalidRequestError, match=r"'other' is not an adapter.*'policy'"):
        versions.acquire("other")


def test_releasing_more_than_acquired_is_a_bug_not_a_silent_count():
    versions = AdapterVersions(lambda lease: None)
    lease = versions.add("lora", 0)
    with pytest.raises(RuntimeError, match="released more often"):
        versions.release(lease)


def test_retire_all_returns_the_free_versions_and_hands_over_the_rest_later():
    retired = []
    versions = AdapterVersions(retired.append)
    versions.add("lora", 0)
    held = versions.acquire()
    versions.add("lora", 1)
    assert retired == []
    assert [x.served_name for x in versions.retire_all()] == ["lora-v1"]
    versions.release(held)
    assert [x.served_name for x in retired] == ["lora-v0"]


def test_the_last_served_version_outlives_its_unload():
    # a new-user trial: a run's summary is written after the backend closed, and read
    # loaded: [], with nothing saying which adapter version had served the run
    retired = []
    versions = AdapterVersions(retired.append)
    versions.add("lora", 0)
    versions.add("other", 0)
    versions.release(versions.acquire())
    assert versions.statistics().last_served == {"lora": "lora-v0"}  # "other" served nothing yet
    lease = versions.acquire()
    moved = versions.move(lease, versions.add("lora", 1))  # an in-place update: the segment goes on on v1
    versions.release(moved)
    for lease in versions.retire_all() + retired:
        versions.unloaded(lease)
    stats = versions.statistics()
    assert stats.loaded == () and stats.current == {} and stats.last_served == {"lora": "lora-v1"}


def _adapter(rank=8, base="models/tiny-llama"):
    tensors = {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.ones(rank, 4),
               "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": torch.zeros(4, rank)}
    return AdapterWeights({"r": rank, "lora_alpha": 16, "peft_type": "LORA", "target_modules": ["q_proj"],
                           "base_model_name_or_path": base}, tensors)


def test_an_adapter_round_trips_through_a_fresh_folder(tmp_path):
    adapter = _adapter()
    folder = write_adapter(adapter, tmp_path / "v1")
    assert is_adapter_source(folder)
    back = read_adapter(folder)
    assert back.config == adapter.config and set(back.tensors) == set(adapter.tensors)
    assert back.nbytes == adapter.nbytes == 2 * 8 * 4 * 4
    with pytest.raises(BackendError, match="fresh folder"):
        write_adapter(adapter, folder)


def test_a_state_dict_needs_a_config_and_named_keys_are_normalized():
    state = {"m.q_proj.lora_A.lora-v0.weight": torch.ones(2, 2), "m.q_proj.lora_B.lora-v0.weight": torch.ones(2, 2)}
    assert is_adapter_source(state) and not is_adapter_source({"m.q_proj.weight": torch.ones(1)})
    with pytest.raises(BackendError, match="carries no config"):
        read_adapter(state)
    adapter = read_adapter(state, config={"r": 2})
    assert set(adapter.tensors) == {"m.q_proj.lora_A.weight", "m.q_proj.lora_B.weight"}


def test_the_rank_check_names_the_server_and_the_fix():
    with pytest.raises(BackendError, match=r"rank 16 is above the --max-lora-rank 8 of vllm server u"):
        check_adapter(_adapter(rank=16), where="vllm server u", max_rank=8)
    check_adapter(_adapter(rank=8), where="vllm server u", max_rank=8)


def test_the_base_model_check_compares_names_not_spellings():
    assert same_base_model("HuggingFaceTB/SmolLM2-135M-Instruct", "/cache/smollm2-135m-instruct/")
    assert same_base_model(None, "x")
    with pytest.raises(BackendError, match="trained on base model 'models/other'.*serves 'tiny-llama'"):
        check_adapter(_adapter(base="models/other"), where="the hf backend", base_model="tiny-llama")
    check_adapter(_adapter(base="models/other"), where="x", base_model="tiny-llama", check_base=False)

"""Rows stay aligned when an episode fails, under AReaL's own RLVRWorkflow on the adapter.

A reward that raises for one item, a backend request that fails once: the failed episode is
``None`` where AReaL's API says so (``wait`` / ``wait_for_task``), absent from
``rollout_batch`` / ``prepare_batch``, and every group that comes back holds exactly its own
item's rows (never a partial group: a group with a failed member is dropped whole, as AReaL's
``GroupedRolloutWorkflow`` does when a member raises).  The engine says why
(``statistics().failed_by_reason`` / ``rejected_by_reason``).  And the weight-update handshake
waits for AReaL's name-resolve key: without it, nothing loads.
"""

from __future__ import annotations

import pytest

pytest.importorskip("areal", reason="needs the areal venv: make test-integrations")

import concurrent.futures  # noqa: E402

import torch  # noqa: E402
from areal.api import WeightUpdateMeta  # noqa: E402
from areal.api.cli_args import GenerationHyperparameters, InferenceEngineConfig, NameResolveConfig  # noqa: E402
from areal.utils import name_resolve  # noqa: E402
from areal.workflow import RLVRWorkflow  # noqa: E402
from areal_doubles import AREAL_WARNINGS, prompts  # noqa: E402
from areal_rewards import failing_reward  # noqa: E402
from torchdata.stateful_dataloader import StatefulDataLoader  # noqa: E402

from engine import HFBackend  # noqa: E402
from engine.errors import BackendError, EpisodeFailuresError  # noqa: E402
from engine.integrations.areal import AReaLEngineOptions, AReaLInferenceEngine  # noqa: E402
from engine.testing import build_tiny_model, build_tiny_tokenizer  # noqa: E402

torch.set_num_threads(1)

pytestmark = AREAL_WARNINGS


class FlakyHF(HFBackend):
    """The hf backend, whose next ``fail`` generate calls raise :class:`BackendError`."""

    fail = 0

    async def generate(self, request, budget):
        if self.fail:
            self.fail -= 1
            raise BackendError("injected: the server dropped the request")
        return await super().generate(request, budget)


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer()


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("areal-failures") / "tiny")


@pytest.fixture
def backend(model_path, tok):
    return FlakyHF(model_path, tok)


@pytest.fixture
def adapter(backend):
    config = InferenceEngineConfig(experiment_name="failures", trial_name="t0", consumer_batch_size=2,
                                   max_concurrent_rollouts=4, max_head_offpolicyness=int(1e10))
    engine = AReaLInferenceEngine(config, backend=backend,
                                  options=AReaLEngineOptions(weight_update_timeout_s=1.0))
    engine.initialize()
    yield engine
    engine.destroy()


@pytest.fixture
def workflow(tok):
    return RLVRWorkflow(reward_fn=failing_reward, gconfig=GenerationHyperparameters(max_new_tokens=6), tokenizer=tok)


def _prompt_ids(tok, item):
    from areal.utils.hf_utils import apply_chat_template

    return list(apply_chat_template(tok, item["messages"], tokenize=True, add_generation_prompt=True))


def _group_prompt(group):
    """The prompt ids of a group's rows (all equal: asserted)."""
    rows = []
    for r in range(group["input_ids"].shape[0]):
        real = group["attention_mask"][r] & (group["loss_mask"][r] == 0)
        rows.append(group["input_ids"][r][real].tolist())
    assert all(row == rows[0] for row in rows), "a group mixes prompts"
    return rows[0]


def test_a_failing_reward_drops_its_item_and_nothing_else(adapter, workflow, tok):
    items = prompts(4, tag="r")
    items[1]["fail"] = "item 1"
    groups = adapter.rollout_batch(items, workflow=workflow, group_size=2)
    assert [_group_prompt(g) for g in groups] == [_prompt_ids(tok, items[i]) for i in (0, 2, 3)]
    assert all(g["input_ids"].shape[0] == 2 for g in groups)
    stats = adapter.statistics()
    assert stats.failed_by_reason == {"reward_error": 1} and stats.accepted == 3

    ids = [adapter.submit(item, workflow=workflow) for item in items]
    results = [adapter.wait_for_task(task_id, timeout=60) for task_id in reversed(ids)][::-1]
    assert results[1] is None
    assert [_group_prompt(results[i]) for i in (0, 2, 3)] == [_prompt_ids(tok, items[i]) for i in (0, 2, 3)]


def test_a_rollout_batch_whose_items_all_fail_raises_one_error_naming_them(adapter, workflow):
    """Regression (new-user trial): it returned ``[]``, and AReaL's trainer died later on a
    KeyError (``concat_padded_tensors([])`` is ``{}``)."""
    items = prompts(2, tag="f")
    for i, item in enumerate(items):
        item["fail"] = f"item {i}"
    with pytest.raises(EpisodeFailuresError) as info:
        adapter.rollout_batch(items, workflow=workflow, group_size=2)
    message = str(info.value)
    assert message.startswith("rollout_batch: none of 2 episodes was accepted: 2 failed (reward_error: 2)")
    assert "reward raised for 'item 0'" in message and "\n" not in message
    assert adapter.statistics().failed_by_reason == {"reward_error": 2}
    assert len(adapter.rollout_batch(prompts(1, tag="g"), workflow=workflow, group_size=2)) == 1  # then on as before


def test_a_backend_request_that_fails_once_drops_one_whole_group(adapter, workflow, backend, tok):
    items = prompts(6, tag="b")
    loader = StatefulDataLoader(items, batch_size=2, shuffle=False, collate_fn=lambda rows: rows)
    backend.fail = 1
    batch = adapter.prepare_batch(loader, workflow=workflow, group_size=2)
    assert backend.fail == 0
    assert len(batch) == 2 and all(g["input_ids"].shape[0] == 2 for g in batch)  # no partial group
    got = [_group_prompt(g) for g in batch]
    expected = [_prompt_ids(tok, item) for item in items]
    assert len({tuple(p) for p in got}) == 2 and all(p in expected for p in got)
    stats = adapter.statistics()
    assert stats.rejected_by_reason.get("incomplete_group") == 1  # the group whose member failed


def test_wait_counts_a_failed_episode_as_none(adapter, workflow):
    items = prompts(3, tag="w")
    items[2]["fail"] = "item 2"
    for item in items:
        adapter.submit(item, workflow=workflow)
    results = adapter.wait(count=3, timeout=60)
    assert sum(r is None for r in results) == 1 and len(results) == 3


def test_a_weight_update_waits_for_the_trainers_key(adapter, tmp_path):
    name_resolve.reconfigure(NameResolveConfig(type="nfs", nfs_record_root=str(tmp_path / "names")))
    meta = WeightUpdateMeta(type="disk", path=str(tmp_path / "never-written")).with_version(7)
    future = adapter.update_weights_from_disk(meta)  # before the weights exist, as FSDPEngine calls it
    done, _ = concurrent.futures.wait([future], timeout=30)
    assert done, "the future must end (weight_update_timeout_s=1)"
    with pytest.raises(TimeoutError):
        future.result()
    assert adapter.get_version() == 0  # nothing was loaded without the key

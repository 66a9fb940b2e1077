"""Unit tier: issue 24, class 6.  A torch ``DataLoader`` with its default collate turns a
batch of rows into one dict of columns (``{"messages": [{"role": ["user", "user"], ...}],
"answer": [...]}``); handed on as an item it reached the chat template as a role that
is a list, and RLVR trained on ``<|im_start|>['user', 'user']``.  Every entry point
refuses it with one ``DatasetError`` naming the field and the fix: ``submit``,
``rollout_batch`` (items from ``list(loader)``), ``prepare_batch`` (an iterator over
the loader), the sharded engine's ``submit``, the blocking facade, and the chat
renderers.  Sim backend, in-process rewards, virtual time; a real torch ``DataLoader``."""

from __future__ import annotations


import pytest
import torch
from torch.utils.data import DataLoader

import reward_fixtures
from engine import EngineConfig, SimBackend, SimConfig, open_rollout_engine
from engine.chat import TokenConversation, render_messages
from engine.chat import render_chat
from engine.datasets import builtin_arith, to_item
from engine.errors import DatasetError
from engine.sync import RolloutEngineThread
from engine.testing import InProcessRewardPool, build_tiny_tokenizer
from engine.types import GenerationHyperparameters
from workflows.rlvr import RLVRWorkflow

ROWS = [to_item(row) for row in builtin_arith(8)]
ROLE = r"messages\[0\]\['role'\] is a list of 2"  # what the error names
FIX = "collate_fn=lambda rows: rows"


def _sim(tok):
    return SimBackend(SimConfig(vocab_size=len(tok), eos_token_id=tok.eos_token_id, first_token_id=0,
                                out_len_median=4, seed=2))


def _rlvr(tok):
    return RLVRWorkflow(reward_fixtures.length_reward, GenerationHyperparameters(max_new_tokens=4), tok)


def _collated(batch_size=2):
    return list(DataLoader(ROWS, batch_size=batch_size))  # torch's default collate


def test_the_loader_really_collates_roles_into_lists():
    batch = _collated()[0]
    assert batch["messages"][0]["role"] == ["user", "user"] and len(batch["answer"]) == 2


async def test_rollout_batch_of_a_collated_loader_is_refused_before_anything_is_submitted(autojump_clock):
    tok = build_tiny_tokenizer()
    async with open_rollout_engine(_sim(tok), reward_pool=InProcessRewardPool()) as engine:
        with pytest.raises(DatasetError, match=rf"rollout_batch: items\[0\].*{ROLE}.*{FIX}"):
            await engine.rollout_batch(_collated(), _rlvr(tok))
        assert engine.statistics().submitted == 0
        rows = await engine.rollout_batch(ROWS[:2], _rlvr(tok))  # rows still work
    prompt = tok.decode(rows["input_ids"][0][rows["attention_mask"][0]].tolist())
    assert "<|im_start|>user\n" in prompt and "['user'" not in prompt


async def test_a_batch_given_as_one_item_is_refused_in_the_middle_of_rows_too(autojump_clock):
    tok = build_tiny_tokenizer()
    async with open_rollout_engine(_sim(tok), reward_pool=InProcessRewardPool()) as engine:
        with pytest.raises(DatasetError, match=rf"items\[2\].*{ROLE}"):
            await engine.rollout_batch([ROWS[0], ROWS[1], _collated()[0]], _rlvr(tok))
        # list(loader) with collate_fn=lambda rows: rows: a list of rows where a row is expected
        with pytest.raises(DatasetError, match=r"items\[0\] is a list of 2 rows.*rollout_batch\(batch\)"):
            await engine.rollout_batch(list(DataLoader(ROWS, batch_size=2, collate_fn=lambda rows: rows)),
                                       _rlvr(tok))
        assert engine.statistics().submitted == 0


async def test_submit_of_a_collated_batch_is_refused(autojump_clock):
    tok = build_tiny_tokenizer()
    async with open_rollout_engine(_sim(tok), reward_pool=InProcessRewardPool()) as engine:
        with pytest.raises(DatasetError, match=rf"submit: data.*{ROLE}.*{FIX}"):
            engine.submit(_collated()[0], _rlvr(tok))
        with pytest.raises(DatasetError, match=rf"submit: data.*{ROLE.replace('2', '1')}"):
            engine.submit(_collated(batch_size=1)[0], _rlvr(tok))  # batch_size=1 collates too
        assert engine.statistics().submitted == 0


async def test_a_collated_batch_without_messages_is_refused_naming_a_column(autojump_clock):
    rows = [{"prompt": f"q{i}", "answer": "4", "n": i, "weight": 0.5} for i in range(4)]
    batch = next(iter(DataLoader(rows, batch_size=4)))
    assert isinstance(batch["n"], torch.Tensor)
    tok = build_tiny_tokenizer()
    async with open_rollout_engine(_sim(tok), reward_pool=InProcessRewardPool()) as engine:
        with pytest.raises(DatasetError, match=r"submit: data: .*'prompt' is a list of 4 strings.*" + FIX):
            engine.submit(batch, _rlvr(tok))


async def test_prepare_batch_over_an_iterator_of_a_collated_loader_is_refused(autojump_clock):
    tok = build_tiny_tokenizer()
    async with open_rollout_engine(_sim(tok), EngineConfig(consumer_batch_size=2),
                                   reward_pool=InProcessRewardPool()) as engine:
        with pytest.raises(DatasetError, match=rf"prepare_batch: item 0 of epoch 0.*{ROLE}.*{FIX}"):
            await engine.prepare_batch(iter(DataLoader(ROWS, batch_size=2)), _rlvr(tok))
        assert engine.statistics().submitted == 0
        engine.reset_data_stream()
        with pytest.raises(DatasetError, match=rf"prepare_batch: item 0 of epoch 0.*{ROLE}"):
            await engine.prepare_batch(_collated(), _rlvr(tok))  # list(loader): a list of collated dicts
        assert engine.statistics().submitted == 0


async def test_the_sharded_engine_refuses_it_in_submit_and_rollout_batch(autojump_clock):
    from engine.shards import open_sharded_engine
    from shard_fixtures import Echo

    tok = build_tiny_tokenizer()
    async with open_sharded_engine(_sim(tok), EngineConfig(), shards=1, shard_backend="inline") as engine:
        with pytest.raises(DatasetError, match=rf"submit: data.*{ROLE}"):
            engine.submit(_collated()[0], Echo())
        with pytest.raises(DatasetError, match=rf"rollout_batch: items\[0\].*{ROLE}"):
            await engine.rollout_batch(_collated(), Echo())
        assert engine.statistics().submitted == 0


def test_the_blocking_facade_raises_it_in_the_callers_thread():
    tok = build_tiny_tokenizer()
    with RolloutEngineThread(_sim(tok), EngineConfig(consumer_batch_size=2),
                             reward_pool=InProcessRewardPool()) as engine:
        with pytest.raises(DatasetError, match=rf"rollout_batch: items\[0\].*{ROLE}"):
            engine.rollout_batch(DataLoader(ROWS, batch_size=2), _rlvr(tok))  # the loader itself, iterated
        with pytest.raises(DatasetError, match=rf"submit: data.*{ROLE}"):
            engine.submit(_collated()[0], _rlvr(tok))
        with pytest.raises(DatasetError, match=rf"prepare_batch: item 0.*{ROLE}"):
            engine.prepare_batch(iter(DataLoader(ROWS, batch_size=2)), _rlvr(tok))
        assert engine.statistics().submitted == 0


# -- the chat renderers -------------------------------------------------------------------------
COLLATED_MESSAGES = _collated()[0]["messages"]


@pytest.mark.parametrize("render", [
    lambda tok, m: render_chat(tok, m),
    lambda tok, m: render_messages(tok, m, add_generation_prompt=True),
    lambda tok, m: TokenConversation(tok, m),
], ids=["render_chat", "render_messages", "TokenConversation"])
def test_the_chat_renderers_refuse_a_role_or_content_that_is_not_a_string(render):
    tok = build_tiny_tokenizer()
    with pytest.raises(DatasetError, match=rf"{ROLE} \(\['user', 'user'\]\), not a str.*{FIX}"):
        render(tok, COLLATED_MESSAGES)
    bad_content = [{"role": "user", "content": ["q0", "q1"]}]
    with pytest.raises(DatasetError, match=r"messages\[0\]\['content'\] is a list of 2 .*not a str"):
        render(tok, bad_content)
    with pytest.raises(DatasetError, match=r"messages\[1\]\['role'\] must be a str, got int"):
        render(tok, [{"role": "user", "content": "q"}, {"role": 3, "content": "a"}])


def test_rows_that_merely_hold_lists_and_tensors_are_not_refused():
    from engine._collated import check_item

    fine = [
        {"messages": [{"role": "user", "content": "q"}], "tests": ["a", "b"], "outputs": ["1", "2"]},
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "q"}]},
                      {"role": "assistant", "content": None, "tool_calls": []}]},
        {"messages": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "q"}]}],
         "images": ["a.png"]},  # a vision row with no scalar field
        {"messages": [{"role": "user", "content": "q"}], "tags": ["x"]},
        {"input_ids": torch.arange(5), "attention_mask": torch.ones(5)},  # a pre-tokenized row
        {"question": "q", "answer": torch.tensor(3)},  # a with_format("torch") row
        {"i": 1}, {}, [1, 2], "text", None,
    ]
    for item in fine:
        check_item(item, "submit: data", "fix")

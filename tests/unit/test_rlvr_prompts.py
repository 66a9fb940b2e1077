"""RLVR's CPU savings keep results the same: each item's prompt is rendered and
encoded once (groups and epochs reuse it), and text is decoded where the reward
runs (``rewards.TokenText``), giving the reward exactly ``tokenizer.decode``."""

from __future__ import annotations

import zlib
from unittest import mock

import pytest
import torch

import reward_fixtures
from engine import EngineConfig, SimBackend, SimConfig, open_rollout_engine
from engine.chat import render_chat
from engine.datasets import builtin_arith, to_item
from engine.testing import build_tiny_tokenizer
from engine.types import GenerationHyperparameters
from rewards import TokenText, tokenizer_file
from workflows.rlvr import RLVRWorkflow, default_get_input_ids

torch.set_num_threads(1)


def _sim(tok):
    return SimBackend(SimConfig(vocab_size=len(tok), eos_token_id=tok.eos_token_id, first_token_id=0,
                                out_len_median=6, seed=3))


def _digest(tok, traj, i, skip=True):
    mask = traj["loss_mask"][i].bool() & traj["attention_mask"][i]
    prompt_ids = traj["input_ids"][i][~traj["loss_mask"][i].bool() & traj["attention_mask"][i]].tolist()
    text = f"{tok.decode(prompt_ids, skip_special_tokens=False)}\x00" \
           f"{tok.decode(traj['input_ids'][i][mask].tolist(), skip_special_tokens=skip)}"
    return float(zlib.crc32(text.encode()) % (1 << 24))


@pytest.mark.parametrize("reward", [reward_fixtures.text_digest, reward_fixtures.async_text_digest])
async def test_the_reward_gets_exactly_what_decode_gives(reward):
    tok = build_tiny_tokenizer()
    items = [to_item(row) for row in builtin_arith(4)]
    workflow = RLVRWorkflow(reward, GenerationHyperparameters(n_samples=2, max_new_tokens=12), tok)
    assert workflow._tokenizer_file is not None  # the tiny tokenizer is a plain fast one: decoded in the worker
    async with open_rollout_engine(_sim(tok), EngineConfig(reward_max_workers=1)) as engine:
        batch = await engine.rollout_batch(items, workflow)
    assert batch["rewards"].tolist() == [_digest(tok, batch, i) for i in range(batch.batch_size[0])]


async def test_a_group_and_a_second_epoch_encode_each_prompt_once():
    tok = build_tiny_tokenizer()
    items = [to_item(row) for row in builtin_arith(3)]
    workflow = RLVRWorkflow(reward_fixtures.length_reward, GenerationHyperparameters(max_new_tokens=8), tok)
    with mock.patch("workflows.rlvr.render_chat", wraps=render_chat) as render:
        async with open_rollout_engine(_sim(tok), EngineConfig(reward_max_workers=1)) as engine:
            for _ in range(2):  # two epochs
                for item in items:
                    engine.submit(dict(item), workflow, group_size=4)  # a copy: the key is the messages
                results = await engine.wait_results(len(items))
                assert [r.status for r in results] == ["accepted"] * 3
    assert render.call_count == 3  # once per item, not 3 x 4 x 2
    for item in items:  # the cached ids are what a fresh encoding gives
        assert workflow._prompt(item).ids == default_get_input_ids(tok, item, None)


def test_the_cache_is_bounded_and_skips_what_it_cannot_key():
    tok = build_tiny_tokenizer()
    items = [to_item(row) for row in builtin_arith(3)]
    workflow = RLVRWorkflow(reward_fixtures.length_reward, GenerationHyperparameters(), tok, prompt_cache_size=2)
    for item in items:
        workflow._prompt(item)
    assert len(workflow._prompts) == 2  # the oldest was evicted
    odd = {"messages": [{"role": "user", "content": "hi", "extra": object()}]}
    with mock.patch.object(tok, "apply_chat_template", return_value="hi") as render:
        workflow._prompt(odd)
        workflow._prompt(odd)
    assert render.call_count == 2 and len(workflow._prompts) == 2  # not cached
    custom = RLVRWorkflow(reward_fixtures.length_reward, GenerationHyperparameters(), tok,
                          get_input_ids_fn=lambda t, d, e: [1, 2, 3])
    assert custom.prompt_cache_size == 0  # a custom function may read more than the messages
    with pytest.raises(ValueError, match="prompt_cache_size"):
        RLVRWorkflow(reward_fixtures.length_reward, GenerationHyperparameters(), tok, prompt_cache_size=-1)


def test_default_input_ids_match_the_chat_template_and_token_text_decodes_like_the_tokenizer(tmp_path):
    tok = build_tiny_tokenizer()
    for item in (to_item(row) for row in builtin_arith(5)):
        want = tok.apply_chat_template(item["messages"], tokenize=True, add_generation_prompt=True, return_dict=False)
        assert default_get_input_ids(tok, item, None) == list(want)
    path = tokenizer_file(tok, tmp_path)
    assert path is not None and tokenizer_file(tok, tmp_path) == path  # written once
    assert tokenizer_file(build_tiny_tokenizer(), tmp_path) == path  # content-addressed: equal tokenizers share it
    ids = tok.encode("<|im_start|>user\nhello 42<|im_end|>", add_special_tokens=False)
    for skip in (False, True):
        assert TokenText(path, ids, skip).decode() == tok.decode(ids, skip_special_tokens=skip)
    cleaning = build_tiny_tokenizer()
    cleaning.clean_up_tokenization_spaces = True  # its decode is more than the Rust tokenizer's: in-process
    assert tokenizer_file(cleaning, tmp_path / "other") is None and not (tmp_path / "other").exists()
    assert RLVRWorkflow(reward_fixtures.length_reward, GenerationHyperparameters(), cleaning)._tokenizer_file is None


async def test_a_duck_typed_reward_pool_gets_text(reward_pool):
    tok = build_tiny_tokenizer()
    items = [to_item(row) for row in builtin_arith(2)]
    workflow = RLVRWorkflow(reward_fixtures.text_digest, GenerationHyperparameters(max_new_tokens=8), tok)
    async with open_rollout_engine(_sim(tok), EngineConfig(), reward_pool=reward_pool) as engine:
        batch = await engine.rollout_batch(items, workflow)  # text_digest asserts it got str, not TokenText
    assert reward_pool.calls == 2
    assert batch["rewards"].tolist() == [_digest(tok, batch, i) for i in range(2)]


def test_the_cache_tells_apart_values_that_python_calls_equal():
    tok = build_tiny_tokenizer()
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}={{ m['x'] }}\n{% endfor %}"
    workflow = RLVRWorkflow(reward_fixtures.length_reward, GenerationHyperparameters(), tok)
    values = [1, True, 1.0, 0.0, -0.0, "1", None]  # 1 == True == 1.0, 0.0 == -0.0: rendered differently
    for _ in range(2):
        for value in values:
            item = {"messages": [{"role": "user", "content": "v", "x": value}]}
            assert workflow._prompt(item).ids == default_get_input_ids(tok, item, None)
    assert len(workflow._prompts) == len(values)


def test_arun_episode_makes_no_closure_cells():
    """Regression: the n > 1 branch's closure made every episode (n == 1 too) create
    five cells (self, engine, data, prompt, trajectories) kept alive while it ran."""
    assert RLVRWorkflow.arun_episode.__code__.co_cellvars == ()

"""Unit tier: the in-process OpenAI client (engine.openai.EngineOpenAI), its
interaction cache (parents, rewards, discount, export) and the executor's
conversion of interaction dicts into trajectory rows, on a scripted backend
with the tiny byte-level tokenizer (its ids are bytes + 5, so texts are exact)."""

from __future__ import annotations

import json

import pytest
import torch
from openai.types import Completion
from openai.types.chat import ChatCompletion

from engine import EngineConfig, InvalidRequestError, ModelResponse, open_rollout_engine
from engine.chat import collect_drift_events, decode_text
from engine.executor import sample_index
from engine.openai import EngineOpenAI, Interaction, InteractionCache, JsonInTagsToolCallParser
from engine.testing import InProcessRewardPool, build_tiny_tokenizer
from openai_fixtures import CALCULATOR, ScriptedBackend, tool_call_text

QUESTION = [{"role": "user", "content": "What is 2+3?"}]
CALL = tool_call_text("calculator", {"expression": "2+3"})


@pytest.fixture
def tok():
    return build_tiny_tokenizer()


async def two_turns(client):
    """user -> tool call -> tool result -> answer; returns the two completions."""
    msgs = list(QUESTION)
    first = await client.chat.completions.create(messages=msgs, tools=[CALCULATOR], temperature=1.0, max_tokens=200)
    call = first.choices[0].message.tool_calls[0]
    msgs += [first.choices[0].message, {"role": "tool", "tool_call_id": call.id, "content": "5"}]
    second = await client.chat.completions.create(messages=msgs, tools=[CALCULATOR], max_completion_tokens=200)
    return first, second


async def test_a_tool_call_turn_then_a_token_exact_second_turn(tok):
    backend = ScriptedBackend(tok, [CALL, "#### 5"])
    async with open_rollout_engine(backend, reward_pool=InProcessRewardPool()) as engine:
        client = EngineOpenAI(engine, tok)
        with collect_drift_events() as drifts:
            first, second = await two_turns(client)
    assert isinstance(first, ChatCompletion) and isinstance(second, ChatCompletion)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "calculator" and json.loads(call.function.arguments) == {"expression": "2+3"}
    assert second.choices[0].finish_reason == "stop" and second.choices[0].message.content == "#### 5"
    (in1, out1), (in2, out2) = backend.log
    assert first.usage.prompt_tokens == len(in1) and first.usage.completion_tokens == out1.output_len
    # the second request is the first request + its sampled ids + only the new messages' ids
    assert in2[:len(in1) + out1.output_len] == in1 + out1.output_tokens
    assert decode_text(tok, in2[len(in1) + out1.output_len:]) == "\n<|im_start|>tool\n5<|im_end|>\n<|im_start|>assistant\n"
    assert drifts == []
    a, b = client.cache.values()
    assert (a.id, b.id) == (first.id, second.id) and b.parent is a and a.parent is None
    assert a.input_ids == in1 and a.output_ids == out1.output_tokens and a.stop_reason == "tool_calls"
    assert a.response.output_logprobs == out1.output_logprobs and a.response.output_versions == out1.output_versions
    assert b.stop_reason == "stop" and not a.drift and not b.drift


async def test_the_tools_schema_goes_through_the_chat_template(tok):
    tok.chat_template = ("{% if tools %}<|im_start|>system\nTOOLS {{ tools | map(attribute='function.name') | join(',') }}"
                         "<|im_end|>\n{% endif %}" + tok.chat_template)
    backend = ScriptedBackend(tok, [CALL, "#### 5"])
    async with open_rollout_engine(backend, reward_pool=InProcessRewardPool()) as engine:
        with collect_drift_events() as drifts:
            await two_turns(EngineOpenAI(engine, tok))
    assert decode_text(tok, backend.log[0][0]).startswith("<|im_start|>system\nTOOLS calculator<|im_end|>")
    assert drifts == []


async def test_parameters_reach_the_request_and_bad_ones_are_refused(tok):
    seen = []

    class Seeing(ScriptedBackend):
        async def _answer(self, request, budget):
            seen.append((request.gconfig, budget))
            return await super()._answer(request, budget)

    async with open_rollout_engine(Seeing(tok, ["hello world"]), reward_pool=InProcessRewardPool()) as engine:
        client = EngineOpenAI(engine, tok)
        c = await client.chat.completions.create(messages=QUESTION, temperature=0, top_p=0.5, max_tokens=3,
                                                 stop=["x"], seed=7, model="anything", user="u")
        g, budget = seen[0]
        assert (g.greedy, g.top_p, g.max_new_tokens, g.stop, g.seed, budget) == (True, 0.5, 3, ["x"], 7, 3)
        assert 4 in g.stop_token_ids and 0 in g.stop_token_ids  # the tokenizer's eos and pad
        assert c.choices[0].finish_reason == "length" and c.choices[0].message.content == "hel"
        with pytest.raises(InvalidRequestError, match=r"n must be an int in \[1, 128\], got 0"):
            await client.chat.completions.create(messages=QUESTION, n=0)
        with pytest.raises(InvalidRequestError, match="stream_options is only allowed with stream=True"):
            await client.chat.completions.create(messages=QUESTION, stream_options={"include_usage": True})
        with pytest.raises(InvalidRequestError, match="not both"):
            await client.chat.completions.create(messages=QUESTION, max_tokens=3, max_completion_tokens=3)
        with pytest.raises(InvalidRequestError, match="messages must be a non-empty list"):
            await client.chat.completions.create(messages=[])
        with pytest.raises(InvalidRequestError, match=r"messages\[0\] has no 'role'"):
            await client.chat.completions.create(messages=[{"content": "hi"}])
        with pytest.raises(InvalidRequestError, match=r"unsupported parameter\(s\) \['presence_penalty'\]"):
            await client.chat.completions.create(messages=QUESTION, presence_penalty=1.0)
        assert len(client.cache) == 1  # refused calls record nothing


async def test_a_history_the_client_did_not_produce_is_counted_as_drift(tok):
    backend = ScriptedBackend(tok, ["I think 6", "#### 5"])
    async with open_rollout_engine(backend, reward_pool=InProcessRewardPool()) as engine:
        client = EngineOpenAI(engine, tok)
        with collect_drift_events() as drifts:
            await client.chat.completions.create(messages=QUESTION)
            edited = [*QUESTION, {"role": "assistant", "content": "I think 5"}, {"role": "user", "content": "sure?"}]
            await client.chat.completions.create(messages=edited)
    assert len(drifts) == 1 and "tokenized again" in drifts[0]
    first, second = client.cache.values()
    assert second.parent is None and second.drift and not first.drift
    assert second.to_trajectory()["retokenization_drift"].tolist() == [True]


async def test_a_template_that_rewrites_earlier_turns_is_counted_as_drift(tok):
    # earlier assistant turns are rendered in upper case (as Qwen3 strips earlier reasoning)
    tok.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['role'] == 'assistant' and not "
                         "loop.last %}{{ m['content'] | upper }}{% else %}{{ m['content'] }}{% endif %}<|im_end|>\n"
                         "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    backend = ScriptedBackend(tok, ["maybe 5", "#### 5"])
    async with open_rollout_engine(backend, reward_pool=InProcessRewardPool()) as engine:
        client = EngineOpenAI(engine, tok)
        first = await client.chat.completions.create(messages=QUESTION)
        msgs = [*QUESTION, first.choices[0].message, {"role": "user", "content": "sure?"}]
        with collect_drift_events() as drifts:
            await client.chat.completions.create(messages=msgs)
        stats = engine.statistics()
    assert len(drifts) == 1
    (in1, out1), (in2, _) = backend.log
    assert in2[:len(in1) + out1.output_len] == in1 + out1.output_tokens  # the ids stay exact
    assert client.cache.last.drift and client.cache.last.parent is not None
    assert stats.retokenization_drifts == 0  # outside an episode: nothing counted by the engine


def _node(iid, parent=None, messages=(), reward=None):
    resp = ModelResponse(input_tokens=[1, 2], output_tokens=[3], output_logprobs=[-0.1], output_versions=[0])
    return Interaction(id=iid, response=resp, messages=list(messages), output_message={"role": "assistant",
                       "content": iid}, parent=parent, reward=reward)


def test_discount_flows_back_along_the_conversation_with_exact_values():
    cache = InteractionCache()
    a = _node("a", reward=0.1)
    b = _node("b", a)
    c = _node("c", b, reward=1.0)
    for node in (a, b, c):
        cache.add(node)
    assert cache.apply_reward_discount(0.5) == {"a": 0.1 + 0.5 * (0.0 + 0.5 * 1.0), "b": 0.5, "c": 1.0}
    assert [n.reward for n in (a, b, c)] == [0.35, 0.5, 1.0]
    with pytest.raises(RuntimeError, match="only once"):
        cache.apply_reward_discount(0.5)


def test_discount_on_a_tree_takes_the_newest_child_and_never_crosses_conversations():
    cache = InteractionCache()
    root, old, new, other = _node("root"), None, None, _node("other", reward=10.0)
    old = _node("old", root, reward=0.2)
    new = _node("new", root, reward=1.0)
    for node in (root, old, new, other):
        cache.add(node)
    assert cache.apply_reward_discount(0.9) == {"root": 0.9, "old": 0.2, "new": 1.0, "other": 10.0}
    assert [n.id for n in cache.children("root")] == ["old", "new"]


def test_rewards_are_checked_and_set_on_the_last_or_a_named_interaction():
    cache = InteractionCache()
    with pytest.raises(ValueError, match="no interaction"):
        cache.set_last_reward(1.0)
    cache.add(_node("a"))
    cache.add(_node("b"))
    cache.set_last_reward(2)
    cache.set_reward("a", 0.5)
    assert (cache["a"].reward, cache["b"].reward) == (0.5, 2.0)
    for bad in (True, float("nan"), "1"):
        with pytest.raises(ValueError, match="finite real number"):
            cache.set_reward("a", bad)
    with pytest.raises(KeyError, match="no interaction 'zz'"):
        cache.set_reward("zz", 1.0)
    with pytest.raises(ValueError, match=r"turn_discount must be a number in \[0, 1\]"):
        cache.apply_reward_discount(1.5)
    with pytest.raises(ValueError, match="style must be one of"):
        cache.export_interactions("flat")


def test_parent_is_the_longest_cached_conversation_that_prefixes_the_messages():
    cache = InteractionCache()
    u1, u2 = {"role": "user", "content": "q"}, {"role": "user", "content": "more"}
    a = _node("a", messages=[u1])
    cache.add(a)
    b = _node("b", a, messages=[u1, a.output_message, u2])
    cache.add(b)
    # a client sends back extra None fields: they do not count
    back = {**b.output_message, "refusal": None, "tool_calls": None}
    assert cache.find_parent([u1, a.output_message, u2, back, u2]) is b
    assert cache.find_parent([u1, a.output_message]) is a
    assert cache.find_parent([u1, {"role": "assistant", "content": "edited"}]) is None
    assert cache.find_parent([u2]) is None


def test_retry_orphans_are_dropped_on_request():
    cache = InteractionCache()
    u = {"role": "user", "content": "q"}
    first, retry = _node("first", messages=[u]), _node("retry", messages=[u])
    cache.add(first)
    cache.add(retry)
    assert list(cache.export_interactions()) == ["first", "retry"]
    assert list(cache.export_interactions(drop_retry_orphans=True)) == ["retry"]


async def test_export_styles_rows_are_exactly_what_the_backend_received_and_sampled(tok):
    backend = ScriptedBackend(tok, [CALL, "#### 5"])
    async with open_rollout_engine(backend, reward_pool=InProcessRewardPool()) as engine:
        client = EngineOpenAI(engine, tok)
        await two_turns(client)
    client.set_last_reward(1.0)
    client.apply_reward_discount(0.5)
    (in1, out1), (in2, out2) = backend.log
    rows = [v.to_trajectory() for v in client.export_interactions("individual").values()]
    for row, (inp, out), turn in zip(rows, backend.log, (0, 1)):
        assert row["input_ids"][0].tolist() == inp + out.output_tokens
        assert row["loss_mask"][0].tolist() == [0] * len(inp) + [1] * out.output_len
        assert row["turn_ids"][0].tolist() == [-1] * len(inp) + [turn] * out.output_len
        assert row["versions"][0].tolist() == [-1] * len(inp) + out.output_versions
        assert torch.equal(row["logprobs"][0], torch.tensor([0.0] * len(inp) + out.output_logprobs))
    assert [r["rewards"].item() for r in rows] == [0.5, 1.0]
    (leaf,) = client.export_interactions("concat").values()
    row = leaf.to_trajectory()
    ids = row["input_ids"][0].tolist()
    mask = row["loss_mask"][0].tolist()
    assert ids == in2 + out2.output_tokens
    sent1 = len(in1) + out1.output_len
    assert mask == [0] * len(in1) + [1] * out1.output_len + [0] * (len(in2) - sent1) + [1] * out2.output_len
    # the tool result and the template glue are injected (loss_mask 0), every sampled id has loss_mask 1
    assert decode_text(tok, [t for t, m in zip(ids, mask) if m == 0][len(in1):]) == \
        "\n<|im_start|>tool\n5<|im_end|>\n<|im_start|>assistant\n"
    assert row["turn_ids"][0].tolist() == [-1] * len(in1) + [0] * out1.output_len + [-1] * (len(in2) - sent1) + \
        [1] * out2.output_len
    assert (row["rewards"].item(), row["num_turns"].item(), row["is_truncated"].item()) == (1.0, 2, False)


async def test_text_completions_are_recorded_but_never_parents(tok):
    backend = ScriptedBackend(tok, ["lo"])
    async with open_rollout_engine(backend, reward_pool=InProcessRewardPool()) as engine:
        client = EngineOpenAI(engine, tok)
        c = await client.completions.create(model="m", prompt="hel", max_tokens=8)
        with pytest.raises(InvalidRequestError, match="prompt must be"):
            await client.completions.create(prompt="")
    assert isinstance(c, Completion) and c.choices[0].text == "lo" and c.choices[0].finish_reason == "stop"
    (node,) = client.cache.values()
    assert node.kind == "completion" and node.input_ids == tok.encode("hel", add_special_tokens=False)
    assert client.cache.find_parent([{"role": "user", "content": "hel"}]) is None


def test_json_in_tags_parser_keeps_what_is_not_a_complete_call():
    parser = JsonInTagsToolCallParser()
    content, calls = parser.parse('Let me compute.\n<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>')
    assert content == "Let me compute." and [(c.name, json.loads(c.arguments)) for c in calls] == [("f", {"x": 1})]
    assert parser.parse("<tool_call>{not json}</tool_call>") == ("<tool_call>{not json}</tool_call>", [])
    assert parser.parse('<tool_call>{"name": "f"') == ('<tool_call>{"name": "f"', [])  # cut by the budget
    assert parser.parse('<tool_call>{"name": "f", "arguments": "{}"}</tool_call>')[1][0].arguments == "{}"


class Agent:
    """A workflow returning interactions: a tool call then an answer; the last
    interaction's reward is its sample index (individual rows, no discount)."""

    def __init__(self, tok, style="individual", reward=True):
        self.tok, self.style, self.reward = tok, style, reward

    async def arun_episode(self, engine, data):
        client = EngineOpenAI(engine, self.tok)
        await two_turns(client)
        client.set_reward(next(iter(client.cache)), 0.25)
        if self.reward:
            client.set_last_reward(float(sample_index.get() == 0))
        return client.export_interactions(self.style)


async def test_the_engine_turns_an_interaction_dict_into_rows_accounted_and_dumped(tok, tmp_path):
    backend = ScriptedBackend(tok, default="x")
    backend.script = [CALL, "#### 5"] * 4
    config = EngineConfig(dump_dir=str(tmp_path / "dumps"))
    async with open_rollout_engine(backend, config, reward_pool=InProcessRewardPool()) as engine:
        tid = engine.submit({"q": 1}, Agent(tok), group_size=2)
        result = await engine.wait_for_task(tid)
        stats = engine.statistics()
    assert result.status == "accepted" and stats.accepted == 1 and stats.retokenization_drifts == 0
    traj = result.trajectory
    assert traj.batch_size == torch.Size([4])  # 2 members x 2 interactions
    assert traj["group_id"].tolist() == [tid] * 4 and traj["rewards"].tolist() == [0.25, 1.0, 0.25, 0.0]
    assert traj["loss_mask"].sum().item() == sum(r.output_len for _, r in backend.log)
    assert list((tmp_path / "dumps").rglob("*.jsonl"))


async def test_reward_normalization_takes_each_samples_last_interaction_reward(tok):
    backend = ScriptedBackend(tok)
    backend.script = [CALL, "#### 5"] * 3
    config = EngineConfig(reward_normalization=True)
    async with open_rollout_engine(backend, config, reward_pool=InProcessRewardPool()) as engine:
        tid = engine.submit({}, Agent(tok), group_size=3)
        traj = (await engine.wait_for_task(tid)).trajectory
    # members' episode rewards [1, 0, 0] (their last interactions'): z-scored, repeated over each member's rows
    z = [2 ** 0.5, -(2 ** -0.5), -(2 ** -0.5)]
    assert traj["rewards"].tolist() == pytest.approx([z[0], z[0], z[1], z[1], z[2], z[2]], abs=1e-5)
    assert traj["original_rewards"].tolist() == [0.25, 1.0, 0.25, 0.0, 0.25, 0.0]


async def test_reward_normalization_rejects_a_group_whose_sample_has_no_final_reward(tok):
    backend = ScriptedBackend(tok)
    backend.script = [CALL, "#### 5"] * 2
    async with open_rollout_engine(backend, EngineConfig(reward_normalization=True),
                                   reward_pool=InProcessRewardPool()) as engine:
        tid = engine.submit({}, Agent(tok, reward=False), group_size=2)
        result = await engine.wait_for_task(tid)
    assert (result.status, result.reason) == ("rejected", "missing_reward")


async def test_a_dict_of_something_else_fails_the_episode_with_a_clear_error(tok):
    class Bad:
        async def arun_episode(self, engine, data):
            return {"input_ids": torch.zeros(1, 3)}

    class Empty:
        async def arun_episode(self, engine, data):
            return {}

    async with open_rollout_engine(ScriptedBackend(tok), reward_pool=InProcessRewardPool()) as engine:
        bad = await engine.wait_for_task(engine.submit({}, Bad()))
        empty = await engine.wait_for_task(engine.submit({}, Empty()))
    assert (bad.status, bad.reason, bad.error_type) == ("failed", "workflow_error", "TypeError")
    assert "value at 'input_ids' is a Tensor" in bad.error_message
    assert (empty.status, empty.reason) == ("rejected", "workflow_returned_none")


async def test_in_process_stream_and_n_record_like_plain_calls(tok):
    backend = ScriptedBackend(tok, ["#### 5", "#### 4", "#### 3"])
    async with open_rollout_engine(backend, reward_pool=InProcessRewardPool()) as engine:
        client = EngineOpenAI(engine, tok)
        stream = await client.chat.completions.create(messages=QUESTION, stream=True,
                                                      stream_options={"include_usage": True})
        async with stream:
            chunks = [c async for c in stream]
        many = await client.chat.completions.create(messages=QUESTION, n=2)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "#### 5"
    assert chunks[-1].usage.completion_tokens == backend.log[0][1].output_len
    assert list(client.cache) == [chunks[0].id, f"{many.id}-0", f"{many.id}-1"]
    first, *pair = client.cache.values()
    assert first.output_ids == backend.log[0][1].output_tokens and first.completion.choices[0].message.content == "#### 5"
    assert [i.input_ids for i in pair] == [backend.log[1][0]] * 2 and pair[0].parent is None

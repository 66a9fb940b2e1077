"""Contract tier: the Responses API (``POST /v1/responses``) of the OpenAI-compatible
proxy, a real HTTP server on 127.0.0.1 with the real ``openai`` SDK as its client
(``responses.create``, streamed and not, ``previous_response_id``, ``retrieve``):
each response is an interaction whose row equals what the backend received and
sampled, token-exact across calls.  Real sockets: the real clock, no autojump."""

from __future__ import annotations

import httpx
import openai
import pytest
import torch

from engine import open_rollout_engine
from engine.openai import open_openai_proxy
from engine.testing import InProcessRewardPool, build_tiny_tokenizer
from openai_fixtures import CALCULATOR, ScriptedBackend, tool_call_text

CALL = tool_call_text("calculator", {"expression": "2+3"})
TOOL = {"type": "function", "name": "calculator", "description": "Evaluate an arithmetic expression.",
        "parameters": CALCULATOR["function"]["parameters"]}


@pytest.fixture
async def sdk():
    clients = []

    def make(proxy, key):
        clients.append(openai.AsyncOpenAI(base_url=proxy.base_url, api_key=key, max_retries=0))
        return clients[-1]

    yield make
    for client in clients:
        await client.close()


async def start(http):
    r = await http.post("/rl/start_session", json={"data": {}})
    assert r.status_code == 200, r.text
    return r.json()


def bearer(session):
    return {"Authorization": f"Bearer {session['api_key']}"}


async def test_a_function_call_round_trip_streamed_and_chained_is_token_exact(sdk):
    tok = build_tiny_tokenizer()
    backend = ScriptedBackend(tok, ["Let me see. " + CALL, "#### 5", "Yes, 5."])
    async with open_rollout_engine(backend, reward_pool=InProcessRewardPool()) as engine:
        async with open_openai_proxy(engine, tok) as proxy, httpx.AsyncClient(base_url=proxy.url) as http:
            s = await start(http)
            client = sdk(proxy, s["api_key"])
            first = await client.responses.create(model="default", instructions="Be brief.", input="What is 2+3?",
                                                  tools=[TOOL], include=["message.output_text.logprobs"])
            assert first.status == "completed" and [o.type for o in first.output] == ["message", "function_call"]
            assert first.output_text == "Let me see."
            call = first.output[1]
            assert call.name == "calculator" and call.arguments == '{"expression": "2+3"}'
            lps = [lp.logprob for lp in first.output[0].content[0].logprobs]
            assert lps == backend.log[0][1].output_logprobs  # every sampled token's logprob, in order
            assert first.usage.input_tokens == len(backend.log[0][0])
            # the SDK sends the output items back with the call's output: streamed this time
            items = [{"role": "user", "content": "What is 2+3?"}, *[o.model_dump(exclude_none=True) for o in first.output],
                     {"type": "function_call_output", "call_id": call.call_id, "output": "5"}]
            stream = await client.responses.create(model="default", instructions="Be brief.", input=items,
                                                   tools=[TOOL], stream=True)
            events = [e async for e in stream]
            assert [e.type for e in events] == [
                "response.created", "response.in_progress", "response.output_item.added",
                "response.content_part.added", "response.output_text.delta", "response.output_text.done",
                "response.content_part.done", "response.output_item.done", "response.completed"]
            assert [e.sequence_number for e in events] == list(range(len(events)))
            second = events[-1].response
            assert events[4].delta == "#### 5" and second.output_text == "#### 5"
            # chained by id: the stored conversation + its output come first
            third = await client.responses.create(model="default", instructions="Be brief.", input="Sure?",
                                                  previous_response_id=second.id)
            assert third.previous_response_id == second.id and third.output_text == "Yes, 5."
            assert (await client.responses.retrieve(third.id)).output_text == "Yes, 5."
            r = await http.post("/rl/set_reward", json={"interaction_id": third.id, "reward": 1.0}, headers=bearer(s))
            assert r.status_code == 200
            await http.post("/rl/end_session", json={"style": "concat"}, headers=bearer(s))
            result = await engine.wait_for_task(s["task_id"])
            stats = engine.statistics()
    assert result.status == "accepted" and stats.retokenization_drifts == 0
    (in1, out1), (in2, out2), (in3, out3) = backend.log
    assert in2[:len(in1) + out1.output_len] == in1 + out1.output_tokens
    assert in3[:len(in2) + out2.output_len] == in2 + out2.output_tokens
    traj = result.trajectory  # concat: one row, the whole conversation, loss_mask on the sampled tokens
    assert traj.batch_size == torch.Size([1]) and traj["num_turns"].tolist() == [3]
    assert traj["input_ids"][0].tolist() == in3 + out3.output_tokens
    mask = traj["loss_mask"][0].tolist()
    assert sum(mask) == out1.output_len + out2.output_len + out3.output_len
    for inp, out in backend.log:
        assert mask[len(inp):len(inp) + out.output_len] == [1] * out.output_len
        assert traj["logprobs"][0][len(inp):len(inp) + out.output_len].tolist() == pytest.approx(out.output_logprobs)
    assert traj["rewards"].tolist() == [1.0]


async def test_unsupported_requests_and_unknown_ids_are_refused_clearly(sdk):
    tok = build_tiny_tokenizer()
    backend = ScriptedBackend(tok, ["a", "b"], default="c")
    async with open_rollout_engine(backend, reward_pool=InProcessRewardPool()) as engine:
        async with open_openai_proxy(engine, tok) as proxy, httpx.AsyncClient(base_url=proxy.url) as http:
            s = await start(http)
            client = sdk(proxy, s["api_key"])
            unstored = await client.responses.create(model="default", input="hi", store=False, max_output_tokens=1)
            assert unstored.status == "incomplete" and unstored.incomplete_details.reason == "max_output_tokens"
            with pytest.raises(openai.NotFoundError, match="previous_response_id"):
                await client.responses.create(model="default", input="hi", previous_response_id=unstored.id)
            with pytest.raises(openai.BadRequestError, match="only function tools"):
                await client.responses.create(model="default", input="hi", tools=[{"type": "web_search"}])
            with pytest.raises(openai.BadRequestError, match="not supported"):
                await client.responses.create(model="default", input=[{"type": "computer_call_output"}])
            with pytest.raises(openai.BadRequestError, match="background"):
                await client.responses.create(model="default", input="hi", background=True)
            with pytest.raises(openai.BadRequestError, match="text.format"):
                await client.responses.create(model="default", input="hi",
                                              text={"format": {"type": "json_object"}})
            # developer messages and content parts become the chat messages the template renders
            await client.responses.create(model="default", input=[
                {"role": "developer", "content": "Be brief."},
                {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]}])
            other = await start(http)  # another session's response is not this session's
            with pytest.raises(openai.NotFoundError):
                await sdk(proxy, other["api_key"]).responses.retrieve(unstored.id)
            for sess in (s, other):
                await http.post("/rl/end_session", json={}, headers=bearer(sess))
            result = await engine.wait_for_task(s["task_id"])
    assert result.status == "accepted" and result.trajectory.batch_size == torch.Size([2])
    text = tok.decode(backend.log[1][0])
    assert "<|im_start|>system\nBe brief.<|im_end|>" in text and "<|im_start|>user\nhi<|im_end|>" in text

"""Contract tier: ``stream=True`` and ``n > 1`` on the OpenAI-compatible proxy
(engine.openai.open_openai_proxy), a real HTTP server on 127.0.0.1 with the real
``openai`` SDK as its client (``create(stream=True)``, ``chat.completions.stream(...)``):
what the SDK assembles from the chunks equals what was recorded, and the rows equal
what the backend received and sampled.  Real sockets: the real clock, no autojump."""

from __future__ import annotations

import httpx
import openai
import pytest
import torch
import trio

from engine import EngineConfig, open_rollout_engine
from engine.openai import open_openai_proxy
from engine.testing import InProcessRewardPool, build_tiny_tokenizer
from openai_fixtures import CALCULATOR, ScriptedBackend, tool_call_text

QUESTION = [{"role": "user", "content": "What is 2+3?"}]
CALL = tool_call_text("calculator", {"expression": "2+3"})


@pytest.fixture
async def sdk():
    clients = []

    def make(proxy, key):
        clients.append(openai.AsyncOpenAI(base_url=proxy.base_url, api_key=key, max_retries=0))
        return clients[-1]

    yield make
    for client in clients:
        await client.close()


async def start(http, data=None):
    r = await http.post("/rl/start_session", json={"data": data or {}})
    assert r.status_code == 200, r.text
    return r.json()


def bearer(session):
    return {"Authorization": f"Bearer {session['api_key']}"}


def assert_rows_are_the_backend_log(traj, log):
    for row, (inp, out) in enumerate(log):
        real = traj["attention_mask"][row]
        assert traj["input_ids"][row][real].tolist() == inp + out.output_tokens
        assert traj["loss_mask"][row][real].tolist() == [0] * len(inp) + [1] * out.output_len
        assert traj["versions"][row][real].tolist() == [-1] * len(inp) + out.output_versions
        assert torch.equal(traj["logprobs"][row][real], torch.tensor([0.0] * len(inp) + out.output_logprobs))


async def test_a_streamed_tool_conversation_is_recorded_as_a_non_streamed_one(sdk):
    tok = build_tiny_tokenizer()
    backend = ScriptedBackend(tok, ["Let me compute. " + CALL, "#### 5"])
    async with open_rollout_engine(backend, reward_pool=InProcessRewardPool()) as engine:
        async with open_openai_proxy(engine, tok) as proxy, httpx.AsyncClient(base_url=proxy.url) as http:
            s = await start(http)
            client = sdk(proxy, s["api_key"])
            stream = await client.chat.completions.create(model="default", messages=QUESTION, tools=[CALCULATOR],
                                                          stream=True, stream_options={"include_usage": True},
                                                          logprobs=True)
            chunks = [c async for c in stream]
            cached = proxy.sessions[s["session_id"]].cache.last
            # the chunks: role first, then content with its logprobs, the call, the finish, the usage
            assert {c.id for c in chunks} == {cached.id}
            assert chunks[0].choices[0].delta.role == "assistant"
            content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            assert content == "Let me compute."
            streamed_lps = [lp.logprob for c in chunks if c.choices and c.choices[0].logprobs
                            for lp in c.choices[0].logprobs.content]
            assert streamed_lps == backend.log[0][1].output_logprobs
            calls = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or ()]
            assert calls[0].function.name == "calculator" and calls[0].id == cached.output_message["tool_calls"][0]["id"]
            assert "".join(tc.function.arguments or "" for tc in calls) == '{"expression": "2+3"}'
            assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
            assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == backend.log[0][1].output_len
            assert all(c.usage is None for c in chunks[:-1])
            # the SDK's .stream() helper assembles the second turn; it extends the first token-exactly
            msgs = [*QUESTION, {"role": "assistant", "content": content,
                                "tool_calls": [{"id": calls[0].id, "type": "function",
                                                "function": {"name": "calculator",
                                                             "arguments": '{"expression": "2+3"}'}}]},
                    {"role": "tool", "tool_call_id": calls[0].id, "content": "5"}]
            async with client.chat.completions.stream(model="default", messages=msgs, tools=[CALCULATOR]) as helper:
                events = [e.type async for e in helper]
                final = await helper.get_final_completion()
            assert "content.delta" in events and final.choices[0].message.content == "#### 5"
            assert final.id == proxy.sessions[s["session_id"]].cache.last.id
            await http.post("/rl/set_reward", json={"reward": 1.0}, headers=bearer(s))
            r = await http.post("/rl/end_session", json={}, headers=bearer(s))
            assert r.json()["interactions"] == 2
            result = await engine.wait_for_task(s["task_id"])
            stats, pstats = engine.statistics(), proxy.statistics()
    assert result.status == "accepted"
    (in1, out1), (in2, _) = backend.log
    assert in2[:len(in1) + out1.output_len] == in1 + out1.output_tokens  # token-exact across streamed turns
    assert_rows_are_the_backend_log(result.trajectory, backend.log)
    assert result.trajectory["rewards"].tolist() == [0.0, 1.0]
    assert stats.retokenization_drifts == 0 and (pstats.ended, pstats.abandoned, pstats.requests) == (1, 0, 2)


async def test_a_streaming_client_that_disconnects_during_generation_withdraws_it():
    tok = build_tiny_tokenizer()
    received, cancelled = trio.Event(), trio.Event()

    class Blocking(ScriptedBackend):
        async def _answer(self, request, budget):
            received.set()
            try:
                await trio.sleep_forever()
            except trio.Cancelled:
                cancelled.set()
                raise

    async with open_rollout_engine(Blocking(tok), reward_pool=InProcessRewardPool()) as engine:
        async with open_openai_proxy(engine, tok) as proxy, httpx.AsyncClient(base_url=proxy.url) as http:
            s = await start(http)
            async with trio.open_nursery() as nursery:
                async def call():
                    async with openai.AsyncOpenAI(base_url=proxy.base_url, api_key=s["api_key"], max_retries=0) as c:
                        async for _ in await c.chat.completions.create(model="default", messages=QUESTION,
                                                                       stream=True):
                            pass

                nursery.start_soon(call)
                await received.wait()
                nursery.cancel_scope.cancel()  # the client goes away while the backend generates
            await cancelled.wait()  # the generation was withdrawn
            r = await http.post("/rl/end_session", json={}, headers=bearer(s))
            assert r.json()["interactions"] == 0  # nothing was recorded
            result = await engine.wait_for_task(s["task_id"])
            pstats = proxy.statistics()
    assert (result.status, result.reason) == ("rejected", "workflow_returned_none")
    assert (pstats.ended, pstats.requests) == (1, 1)


async def test_n_choices_are_n_rows_sharing_the_prompt_with_distinct_seeds(sdk):
    tok = build_tiny_tokenizer()
    seeds = []

    class Seeing(ScriptedBackend):
        async def _answer(self, request, budget):
            seeds.append(request.gconfig.seed)
            return await super()._answer(request, budget)

    backend = Seeing(tok, ["#### 1", "#### 2", "#### 3", "#### 4", "#### 5", "#### 6"])
    config = EngineConfig(max_concurrent_rollouts=2)
    async with open_rollout_engine(backend, config, reward_pool=InProcessRewardPool()) as engine:
        async with open_openai_proxy(engine, tok) as proxy, httpx.AsyncClient(base_url=proxy.url) as http:
            s = await start(http)
            client = sdk(proxy, s["api_key"])
            c = await client.chat.completions.create(model="default", messages=QUESTION, n=4, seed=7, logprobs=True)
            assert [ch.index for ch in c.choices] == [0, 1, 2, 3]
            assert sorted(ch.message.content for ch in c.choices) == ["#### 1", "#### 2", "#### 3", "#### 4"]
            assert c.usage.prompt_tokens == len(backend.log[0][0])
            assert c.usage.completion_tokens == sum(out.output_len for _, out in backend.log)
            for ch in c.choices:  # each choice's reward, by its interaction id
                r = await http.post("/rl/set_reward", json={"interaction_id": f"{c.id}-{ch.index}",
                                                            "reward": float(ch.message.content[-1])},
                                    headers=bearer(s))
                assert r.status_code == 200, r.text
            # streamed with n=2: each choice's chunks carry its index
            stream = await client.chat.completions.create(model="default", messages=QUESTION, n=2, stream=True)
            texts = {}
            async for chunk in stream:
                for ch in chunk.choices:
                    texts[ch.index] = texts.get(ch.index, "") + (ch.delta.content or "")
            assert sorted(texts.values()) == ["#### 5", "#### 6"]
            await http.post("/rl/end_session", json={}, headers=bearer(s))
            result = await engine.wait_for_task(s["task_id"])
            stats = engine.statistics()
    assert result.status == "accepted" and stats.retokenization_drifts == 0
    assert 7 in seeds[:4] and len(set(seeds[:4])) == 4  # choice 0 keeps the seed; the others get their own
    prompts = [inp for inp, _ in backend.log]
    assert prompts[0] == prompts[1] == prompts[2] == prompts[3]  # one prompt, n samples
    # one row per choice; the order of the rows is the order of the choices, each row its own sample
    traj = result.trajectory
    assert traj.batch_size == torch.Size([6])
    by_text = {tok.decode(out.output_tokens, skip_special_tokens=True): (inp, out) for inp, out in backend.log}
    rows = [by_text[ch.message.content] for ch in c.choices] + [by_text[t] for t in (texts[0], texts[1])]
    assert_rows_are_the_backend_log(traj, rows)
    assert traj["rewards"].tolist()[:4] == [float(ch.message.content[-1]) for ch in c.choices]


async def test_streamed_completions_and_their_usage(sdk):
    tok = build_tiny_tokenizer()
    async with open_rollout_engine(ScriptedBackend(tok, ["lo", "la"]), reward_pool=InProcessRewardPool()) as engine:
        async with open_openai_proxy(engine, tok) as proxy, httpx.AsyncClient(base_url=proxy.url) as http:
            s = await start(http)
            client = sdk(proxy, s["api_key"])
            chunks = [c async for c in await client.completions.create(
                model="default", prompt="hel", max_tokens=4, n=2, stream=True, stream_options={"include_usage": True})]
            assert sorted(c.choices[0].text for c in chunks[:2]) == ["la", "lo"]
            assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6
            with pytest.raises(openai.BadRequestError, match="stream_options is only allowed with stream=True"):
                await client.completions.create(model="default", prompt="hel", stream_options={"include_usage": True})
            await http.post("/rl/end_session", json={}, headers=bearer(s))
            result = await engine.wait_for_task(s["task_id"])
    assert result.status == "accepted" and result.trajectory.batch_size == torch.Size([2])

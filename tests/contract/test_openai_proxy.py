"""Contract tier: the OpenAI-compatible proxy (engine.openai.open_openai_proxy)
on a real HTTP server on 127.0.0.1, with the real ``openai`` SDK (AsyncOpenAI
under trio) as its client; the trajectories the engine returns are compared
with what the backend received and sampled.  Real sockets: the real clock
(idle timeouts of a fraction of a second), no autojump."""

from __future__ import annotations

import httpx
import openai
import pytest
import torch
import trio

from engine import EngineConfig, HFBackend, SimBackend, SimConfig, open_rollout_engine
from engine.openai import ProxyConfig, open_openai_proxy
from engine.testing import TINY_EOS_ID, InProcessRewardPool, build_tiny_model, build_tiny_tokenizer
from openai_fixtures import CALCULATOR, ScriptedBackend, tool_call_text

QUESTION = [{"role": "user", "content": "What is 2+3?"}]
CALL = tool_call_text("calculator", {"expression": "2+3"})


@pytest.fixture
async def sdk():
    """``sdk(proxy, api_key)``: an ``openai.AsyncOpenAI`` for the proxy, closed after the test."""
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


async def tool_conversation(client):
    msgs = list(QUESTION)
    first = await client.chat.completions.create(model="default", messages=msgs, tools=[CALCULATOR])
    call = first.choices[0].message.tool_calls[0]
    msgs += [first.choices[0].message.model_dump(exclude_none=True),
             {"role": "tool", "tool_call_id": call.id, "content": "5"}]
    second = await client.chat.completions.create(model="default", messages=msgs, tools=[CALCULATOR])
    return first, second


async def test_a_two_turn_tool_calling_session_through_the_sdk_becomes_exact_rows(sdk):
    tok = build_tiny_tokenizer()
    backend = ScriptedBackend(tok, [CALL, "#### 5"])
    async with open_rollout_engine(backend, reward_pool=InProcessRewardPool()) as engine:
        async with open_openai_proxy(engine, tok) as proxy, httpx.AsyncClient(base_url=proxy.url) as http:
            assert proxy.url.startswith("http://127.0.0.1:")
            s = await start(http, {"answer": "#### 5"})
            first, second = await tool_conversation(sdk(proxy, s["api_key"]))
            assert first.choices[0].finish_reason == "tool_calls"
            assert first.choices[0].message.tool_calls[0].function.name == "calculator"
            assert second.choices[0].message.content == "#### 5"
            r = await http.post("/rl/set_reward", json={"interaction_id": first.id, "reward": 0.1}, headers=bearer(s))
            assert r.status_code == 200
            await http.post("/rl/set_reward", json={"reward": 1.0}, headers=bearer(s))
            r = await http.post("/rl/end_session", json={"discount": 0.5}, headers=bearer(s))
            assert r.json() == {"session_id": s["session_id"], "task_id": s["task_id"], "interactions": 2}
            result = await engine.wait_for_task(s["task_id"])
            stats, pstats = engine.statistics(), proxy.statistics()
    assert result.status == "accepted" and result.data == {"answer": "#### 5"}
    traj = result.trajectory
    (in1, out1), (in2, out2) = backend.log
    assert in2[:len(in1) + out1.output_len] == in1 + out1.output_tokens  # token-exact across calls
    for row, (inp, out) in enumerate(backend.log):
        real = traj["attention_mask"][row]
        assert traj["input_ids"][row][real].tolist() == inp + out.output_tokens
        assert traj["loss_mask"][row][real].tolist() == [0] * len(inp) + [1] * out.output_len
        assert traj["versions"][row][real].tolist() == [-1] * len(inp) + out.output_versions
        assert torch.equal(traj["logprobs"][row][real], torch.tensor([0.0] * len(inp) + out.output_logprobs))
    assert traj["rewards"].tolist() == pytest.approx([0.1 + 0.5 * 1.0, 1.0])  # discounted back once
    assert traj["is_truncated"].tolist() == [False, False]
    assert stats.retokenization_drifts == 0 and not traj["retokenization_drift"].any()
    assert (pstats.started, pstats.ended, pstats.abandoned, pstats.requests) == (1, 1, 0, 2)


async def test_a_real_tiny_model_conversation_through_the_proxy_is_token_exact(tmp_path, sdk):
    path = build_tiny_model(tmp_path / "tiny")
    tok = build_tiny_tokenizer()
    log = []

    class Recording(HFBackend):
        async def generate(self, request, budget):
            resp = await super().generate(request, budget)
            log.append((list(request.input_ids), (resp.output_tokens, resp.output_logprobs, resp.stop_reason)))
            return resp

    backend = Recording(path, tok, max_batch_size=2, batch_window_s=0.0)
    async with open_rollout_engine(backend, reward_pool=InProcessRewardPool()) as engine:
        async with open_openai_proxy(engine, tok) as proxy, httpx.AsyncClient(base_url=proxy.url) as http:
            s = await start(http)
            client = sdk(proxy, s["api_key"])
            msgs = list(QUESTION)
            first = await client.chat.completions.create(model="default", messages=msgs, max_tokens=12,
                                                         temperature=1.0, seed=3, tools=[CALCULATOR])
            msgs += [first.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "Sure?"}]
            # seeded: unseeded random bytes from the tiny model can (rarely) re-tokenize differently
            await client.chat.completions.create(model="default", messages=msgs, max_tokens=12, seed=4,
                                                 tools=[CALCULATOR])
            await http.post("/rl/set_reward", json={"reward": 1.0}, headers=bearer(s))
            await http.post("/rl/end_session", json={"style": "concat"}, headers=bearer(s))
            result = await engine.wait_for_task(s["task_id"])
            drifts = engine.statistics().retokenization_drifts
    assert result.status == "accepted" and drifts == 0
    (in1, (tokens1, *_)), (in2, (tokens2, *_)) = log
    assert in2[:len(in1) + len(tokens1)] == in1 + tokens1
    traj = result.trajectory
    assert traj.batch_size == torch.Size([1])  # concat: one row for the conversation
    assert traj["input_ids"][0].tolist() == in2 + tokens2
    mask = traj["loss_mask"][0].tolist()
    assert sum(mask) == len(tokens1) + len(tokens2) and mask[len(in1):len(in1) + len(tokens1)] == [1] * len(tokens1)
    assert mask[-len(tokens2):] == [1] * len(tokens2)


async def test_a_crafted_history_is_counted_as_drift_by_the_engine(sdk):
    tok = build_tiny_tokenizer()
    backend = ScriptedBackend(tok, ["I think 6", "#### 5"])
    async with open_rollout_engine(backend, reward_pool=InProcessRewardPool()) as engine:
        async with open_openai_proxy(engine, tok) as proxy, httpx.AsyncClient(base_url=proxy.url) as http:
            s = await start(http)
            client = sdk(proxy, s["api_key"])
            await client.chat.completions.create(model="default", messages=QUESTION)
            edited = [*QUESTION, {"role": "assistant", "content": "I think 5"}, {"role": "user", "content": "ok?"}]
            await client.chat.completions.create(model="default", messages=edited)
            await http.post("/rl/end_session", headers=bearer(s))
            result = await engine.wait_for_task(s["task_id"])
            drifts = engine.statistics().retokenization_drifts
    assert drifts == 1
    assert result.trajectory["retokenization_drift"].tolist() == [False, True]


async def test_an_idle_session_is_accounted_as_failed_never_lost(sdk):
    tok = build_tiny_tokenizer()
    async with open_rollout_engine(ScriptedBackend(tok), reward_pool=InProcessRewardPool()) as engine:
        # 1 s: the first SDK request must come within it (0.2 s was too short on a loaded 2-core machine)
        config = ProxyConfig(session_idle_timeout_s=1.0)
        async with open_openai_proxy(engine, tok, config) as proxy, httpx.AsyncClient(base_url=proxy.url) as http:
            s = await start(http)
            await sdk(proxy, s["api_key"]).chat.completions.create(model="default", messages=QUESTION)
            result = await engine.wait_for_task(s["task_id"])  # the agent never ends its session
            with pytest.raises(openai.AuthenticationError, match="unknown or ended session"):
                await sdk(proxy, s["api_key"]).chat.completions.create(model="default", messages=QUESTION)
            pstats = proxy.statistics()
        stats = engine.statistics()
    assert (result.status, result.reason, result.error_type) == ("failed", "session_abandoned", "SessionAbandonedError")
    assert "no request for 1 s" in result.error_message
    assert stats.failed_by_reason == {"session_abandoned": 1} and stats.submitted == 1
    assert (pstats.abandoned, pstats.ended, pstats.active) == (1, 0, 0)


async def test_a_client_that_disconnects_mid_completion_withdraws_it_and_the_session_is_accounted():
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
        config = ProxyConfig(session_idle_timeout_s=0.2)
        async with open_openai_proxy(engine, tok, config) as proxy, httpx.AsyncClient(base_url=proxy.url) as http:
            s = await start(http)
            async with trio.open_nursery() as nursery:
                async def call():
                    async with httpx.AsyncClient(base_url=proxy.base_url) as gone:
                        await gone.post("/chat/completions", json={"messages": QUESTION}, headers=bearer(s))

                nursery.start_soon(call)
                await received.wait()
                nursery.cancel_scope.cancel()  # the client goes away while the backend generates
            await cancelled.wait()  # the generation was withdrawn
            result = await engine.wait_for_task(s["task_id"])
    assert (result.status, result.reason) == ("failed", "session_abandoned")


async def test_closing_the_proxy_abandons_open_sessions():
    tok = build_tiny_tokenizer()
    async with open_rollout_engine(ScriptedBackend(tok), reward_pool=InProcessRewardPool()) as engine:
        async with open_openai_proxy(engine, tok) as proxy, httpx.AsyncClient(base_url=proxy.url) as http:
            s = await start(http)
        result = await engine.wait_for_task(s["task_id"])
    assert (result.status, result.reason) == ("failed", "session_abandoned")
    assert "the proxy closed" in result.error_message


async def test_admission_is_the_engines_and_a_session_given_up_is_still_accounted():
    tok = build_tiny_tokenizer()
    config = EngineConfig(max_concurrent_rollouts=1)
    async with open_rollout_engine(ScriptedBackend(tok), config, reward_pool=InProcessRewardPool()) as engine:
        pconfig = ProxyConfig(admission_timeout_s=0.2)
        async with open_openai_proxy(engine, tok, pconfig) as proxy, httpx.AsyncClient(base_url=proxy.url) as http:
            first = await start(http)
            r = await http.post("/rl/start_session", json={})  # the engine runs one episode at a time
            assert r.status_code == 503 and "did not admit" in r.json()["error"]["message"]
            await http.post("/rl/end_session", headers=bearer(first))
            a = await engine.wait_for_task(first["task_id"])
            b = await engine.wait_for_task(1)  # the given-up session's episode starts, then fails at once
    assert (a.status, a.reason) == ("rejected", "workflow_returned_none")  # no completion: nothing to train on
    assert (b.status, b.reason) == ("failed", "session_abandoned")


async def test_errors_are_openai_shaped_and_the_other_routes_work(sdk):
    tok = build_tiny_tokenizer()
    async with open_rollout_engine(ScriptedBackend(tok, ["lo"]), reward_pool=InProcessRewardPool()) as engine:
        config = ProxyConfig(model="tiny", admin_api_key="admin")
        async with open_openai_proxy(engine, tok, config) as proxy, httpx.AsyncClient(base_url=proxy.url) as http:
            r = await http.post("/rl/start_session", json={})
            assert r.status_code == 401
            s = (await http.post("/rl/start_session", headers={"Authorization": "Bearer admin"})).json()
            client = sdk(proxy, s["api_key"])
            assert [m.id for m in (await client.models.list()).data] == ["tiny"]
            c = await client.completions.create(model="tiny", prompt="hel", max_tokens=4)
            assert c.choices[0].text == "lo" and c.model == "tiny"
            with pytest.raises(openai.BadRequestError, match="n must be an int"):
                await client.chat.completions.create(model="tiny", messages=QUESTION, n=129)
            with pytest.raises(openai.AuthenticationError):
                await sdk(proxy, "sk-nope").chat.completions.create(model="tiny", messages=QUESTION)
            r = await http.post("/rl/set_reward", json={"interaction_id": "nope", "reward": 1}, headers=bearer(s))
            assert r.status_code == 404 and r.json()["error"]["code"] == "interaction_not_found"
            r = await http.post("/rl/set_reward", json={"reward": "high"}, headers=bearer(s))
            assert r.status_code == 400 and "finite real number" in r.json()["error"]["message"]
            named = {**bearer(s), "X-Session-Id": s["session_id"]}  # the id may name the key's session (issue 24)
            r = await http.post("/rl/end_session", json={"style": "flat"}, headers=named)
            assert r.status_code == 400
            r = await http.post("/v1/chat/completions", content=b"{", headers=bearer(s))
            assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
            r = await http.post("/rl/end_session", json={}, headers=named)
            assert r.json()["interactions"] == 1
            result = await engine.wait_for_task(s["task_id"])
    assert result.status == "accepted"


async def test_256_simultaneous_sessions_on_the_sim_are_all_accounted():
    tok = build_tiny_tokenizer()
    sim = SimBackend(SimConfig(vocab_size=len(tok), eos_token_id=TINY_EOS_ID, first_token_id=5, out_len_median=6,
                               out_len_sigma=0.5, per_token_s=0.001, seed=1))
    n = 256
    config = EngineConfig(max_concurrent_rollouts=n)
    async with open_rollout_engine(sim, config, reward_pool=InProcessRewardPool()) as engine:
        async with open_openai_proxy(engine, tok) as proxy:
            # agents in groups of 16, each group with its own connection pools (a pool's cost per request
            # grows with its connections; real agents live in many processes)
            pools = [(httpx.AsyncClient(base_url=proxy.url, timeout=60),
                      openai.AsyncOpenAI(base_url=proxy.base_url, api_key="unused", max_retries=0))
                     for _ in range(n // 16)]
            ended = []

            async def agent(i):
                http, base = pools[i % len(pools)]
                s = await start(http, {"i": i})
                client = base.with_options(api_key=s["api_key"])
                msgs = [{"role": "user", "content": f"question {i}"}]
                c = await client.chat.completions.create(model="default", messages=msgs, max_tokens=8)
                msgs += [c.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "again"}]
                await client.chat.completions.create(model="default", messages=msgs, max_tokens=8)
                await http.post("/rl/set_reward", json={"reward": float(i % 2)}, headers=bearer(s))
                r = await http.post("/rl/end_session", json={"style": "concat"}, headers=bearer(s))
                ended.append(r.json()["interactions"])

            async with trio.open_nursery() as nursery:
                for i in range(n):
                    nursery.start_soon(agent, i)
            for http, base in pools:
                await http.aclose()
                await base.close()
            results = await engine.wait_results(n)
            stats, pstats = engine.statistics(), proxy.statistics()
    assert ended == [1] * n
    assert sorted(r.status for r in results) == ["accepted"] * n
    assert (stats.submitted, stats.accepted, stats.failed, stats.rejected) == (n, n, 0, 0)
    assert stats.retokenization_drifts == 0 and (pstats.ended, pstats.requests) == (n, 2 * n)
    for r in results:  # each concat row: two sampled turns, the reward the agent set
        assert r.trajectory["num_turns"].tolist() == [2]
        assert r.trajectory["rewards"].tolist() == [float(r.data["i"] % 2)]


async def test_a_trainer_can_wait_for_sessions_before_any_client_started_one(sdk):
    """Regression (new-user trial): the documented recipe called engine.wait(n) right after
    opening the proxy, which raises before any session exists."""
    tok = build_tiny_tokenizer()
    backend = ScriptedBackend(tok, ["#### 5", "#### 4"])
    async with open_rollout_engine(backend, reward_pool=InProcessRewardPool()) as engine:
        async with open_openai_proxy(engine, tok) as proxy, httpx.AsyncClient(base_url=proxy.url) as http:
            with pytest.raises(TimeoutError, match="0 started"):
                await proxy.wait_episodes(1, timeout=0.05)
            got = []

            async def trainer():
                got.extend(await proxy.wait_episodes(2))

            async def agent():
                for _ in range(2):
                    s = await start(http, {"answer": "#### 5"})
                    await sdk(proxy, s["api_key"]).chat.completions.create(model="default", messages=QUESTION)
                    await http.post("/rl/set_reward", json={"reward": 1.0}, headers=bearer(s))
                    await http.post("/rl/end_session", json={}, headers=bearer(s))

            async with trio.open_nursery() as nursery:
                nursery.start_soon(trainer)
                await trio.testing.wait_all_tasks_blocked()  # the trainer waits before any session exists
                nursery.start_soon(agent)
    assert len(got) == 2 and all(t is not None and t["rewards"].tolist() == [1.0] for t in got)

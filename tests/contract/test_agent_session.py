"""Contract tier: engine.openai.open_agent_session, an episode's session on the engine's
shared OpenAI-compatible proxy (a real HTTP server on 127.0.0.1), driven from the engine's
asyncio loop (engine.aio.run_asyncio) with the real ``openai`` SDK, and the proxy's own
sessions driven from an asyncio loop of the trainer's (open_asyncio_loop).  Real sockets
and a real thread: the real clock, no autojump."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest
import trio

from engine import RolloutWorkflow, open_rollout_engine
from engine.aio import open_asyncio_loop, run_asyncio
from engine.openai import open_agent_session, open_openai_proxy
from engine.openai.agent_session import shared_proxy
from engine.testing import InProcessRewardPool, build_tiny_tokenizer
from openai_fixtures import ScriptedBackend

QUESTION = [{"role": "user", "content": "What is 2+3?"}]
BOUND_S = 60.0


async def ask(base_url, api_key, messages, **kwargs):
    async with openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0) as client:
        c = await client.chat.completions.create(model="default", messages=messages, **kwargs)
        return c.choices[0].message.content


class Agent(RolloutWorkflow):
    """Asks through its session (in the engine's asyncio loop), then runs ``after(session)``."""

    def __init__(self, tok, messages_list, after=None):
        self.tok, self.messages_list, self.after, self.seen = tok, messages_list, after, []

    async def arun_episode(self, engine, data):
        async with open_agent_session(engine, self.tok) as session:
            for messages in self.messages_list:
                self.seen.append(await run_asyncio(engine, ask, session.base_url, session.api_key, messages))
            if self.after is not None:
                await self.after(session)
        self.session = session
        session.set_last_reward(1.0)
        return session.export_interactions()


async def test_the_drift_of_a_session_counts_in_its_episode_and_the_key_ends_with_the_block():
    tok = build_tiny_tokenizer()
    edited = [*QUESTION, {"role": "assistant", "content": "I think 5"}, {"role": "user", "content": "sure?"}]
    workflow = Agent(tok, [QUESTION, edited])
    with trio.fail_after(BOUND_S):
        async with open_rollout_engine(ScriptedBackend(tok, ["I think 6", "#### 5"]),
                                       reward_pool=InProcessRewardPool()) as engine:
            result = await engine.wait_for_task(engine.submit({}, workflow))
            proxy = await shared_proxy(engine)
            with pytest.raises(openai.AuthenticationError):  # the session's key died with its block
                await ask(proxy.base_url, workflow.session.api_key, QUESTION)
            async with httpx.AsyncClient(base_url=proxy.url) as http:  # the shared proxy starts no sessions
                assert (await http.post("/rl/start_session", json={})).status_code == 401
            stats, pstats = engine.statistics(), proxy.statistics()
    assert workflow.seen == ["I think 6", "#### 5"] and result.status == "accepted"
    assert stats.retokenization_drifts == 1 and result.trajectory["retokenization_drift"].tolist() == [False, True]
    assert (pstats.started, pstats.ended, pstats.abandoned, pstats.active) == (1, 1, 0, 0)


async def test_a_request_in_flight_when_the_block_ends_is_withdrawn_and_end_session_is_refused():
    tok = build_tiny_tokenizer()
    received, cancelled = trio.Event(), trio.Event()

    class Blocking(ScriptedBackend):
        async def _answer(self, request, budget):
            if len(self.log) == 1:  # the second request hangs until it is withdrawn
                received.set()
                try:
                    await trio.sleep_forever()
                except trio.Cancelled:
                    cancelled.set()
                    raise
            return await super()._answer(request, budget)

    statuses, fired = [], []

    async def fire(base_url, api_key):  # asyncio: a request the agent does not wait for
        async def call():
            try:
                await ask(base_url, api_key, QUESTION)
            except openai.APIStatusError as exc:
                statuses.append((exc.status_code, exc.body["code"]))

        fired.append(asyncio.get_running_loop().create_task(call()))

    async def join():
        await fired[0]

    class Leaving(Agent):
        async def arun_episode(self, engine, data):
            async with open_agent_session(engine, self.tok) as session:
                await run_asyncio(engine, ask, session.base_url, session.api_key, QUESTION)
                async with httpx.AsyncClient() as http:
                    r = await http.post(session.base_url.removesuffix("/v1") + "/rl/end_session", json={},
                                        headers={"Authorization": f"Bearer {session.api_key}"})
                    statuses.append((r.status_code, r.json()["error"]["code"]))
                await run_asyncio(engine, fire, session.base_url, session.api_key)
                await received.wait()
            await cancelled.wait()  # leaving the block withdrew the generation in flight
            await run_asyncio(engine, join)
            session.set_last_reward(1.0)
            return session.export_interactions()

    with trio.fail_after(BOUND_S):
        async with open_rollout_engine(Blocking(tok, ["#### 5"]), reward_pool=InProcessRewardPool()) as engine:
            result = await engine.wait_for_task(engine.submit({}, Leaving(tok, [])))
            pstats = (await shared_proxy(engine)).statistics()
    assert statuses == [(409, "session_attached"), (409, "session_ended")]
    assert result.status == "accepted" and result.trajectory.batch_size[0] == 1  # the withdrawn call: no row
    assert (pstats.ended, pstats.requests_in_flight) == (1, 0)


async def test_a_trainer_drives_proxy_sessions_from_an_asyncio_loop_of_its_own():
    tok = build_tiny_tokenizer()
    n = 8
    with trio.fail_after(BOUND_S):
        async with open_rollout_engine(ScriptedBackend(tok, default="#### 5"),
                                       reward_pool=InProcessRewardPool()) as engine:
            async with open_openai_proxy(engine, tok) as proxy, httpx.AsyncClient(base_url=proxy.url) as http, \
                    open_asyncio_loop() as loop:
                async def session(i):
                    s = (await http.post("/rl/start_session", json={"data": {"i": i}})).json()
                    assert await loop.run(ask, proxy.base_url, s["api_key"], QUESTION) == "#### 5"
                    auth = {"Authorization": f"Bearer {s['api_key']}"}
                    await http.post("/rl/set_reward", json={"reward": 1.0}, headers=auth)
                    await http.post("/rl/end_session", json={}, headers=auth)

                async with trio.open_nursery() as nursery:
                    for i in range(n):
                        nursery.start_soon(session, i)
                trajs = await proxy.wait_episodes(n)
    assert [t["rewards"].tolist() for t in trajs] == [[1.0]] * n


async def test_a_session_opened_while_the_engine_closes_ends_its_episode_cancelled_not_failed():
    # a new-user trial: Ctrl-C closed the shared proxy before the episodes' cancellation reached
    # them; an episode that opened its session then failed with workflow_error (ClosedResourceError)
    # and --resume never ran it again.  A cancelled episode must see its cancellation.
    tok = build_tiny_tokenizer()
    with trio.fail_after(BOUND_S):
        async with open_rollout_engine(ScriptedBackend(tok, ["#### 5"]), reward_pool=InProcessRewardPool()) as engine:
            async with open_openai_proxy(engine, tok) as proxy:
                pass  # closed
            with trio.CancelScope() as closing:
                closing.cancel()  # what the engine's close does to its episodes
                async with open_agent_session(engine, tok, proxy=proxy):
                    pytest.fail("a session on a closed proxy")
            assert closing.cancelled_caught  # the cancellation won: the episode ends cancelled
            with pytest.raises(trio.ClosedResourceError):  # outside a close: the error, as before
                async with open_agent_session(engine, tok, proxy=proxy):
                    pass

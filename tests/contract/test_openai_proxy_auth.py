"""Contract tier: issue 24, class 7.  Only a session's own api_key authenticates it on the
OpenAI-compatible proxy.  A session id (``X-Session-Id`` or ``session_id`` in the body) is a
name, never a credential: alone, or with an unknown key, it is refused (401); one that
disagrees with the bearer key is refused (403), never silently rerouted to the key's
session.  Keys are never written to the logs.  A real HTTP server on 127.0.0.1, the real
``openai`` SDK and raw httpx as clients; real clock, no autojump."""

from __future__ import annotations

import logging

import httpx
import openai
import pytest

from engine import open_rollout_engine
from engine.openai import ProxyConfig, open_openai_proxy
from engine.testing import InProcessRewardPool, build_tiny_tokenizer
from openai_fixtures import ScriptedBackend

QUESTION = [{"role": "user", "content": "What is 2+3?"}]


@pytest.fixture
async def sdk():
    """``sdk(proxy, api_key, **options)``: an ``openai.AsyncOpenAI`` for the proxy, closed after the test."""
    clients = []

    def make(proxy, key, **options):
        clients.append(openai.AsyncOpenAI(base_url=proxy.base_url, api_key=key, max_retries=0, **options))
        return clients[-1]

    yield make
    for client in clients:
        await client.close()


async def _start(http):
    r = await http.post("/rl/start_session", json={"data": {}})
    assert r.status_code == 200, r.text
    return r.json()


def _bearer(session):
    return {"Authorization": f"Bearer {session['api_key']}"}


def _error(r, status):
    assert r.status_code == status, r.text
    return r.json()["error"]


async def test_a_session_id_alone_does_not_authenticate_any_route(sdk):
    tok = build_tiny_tokenizer()
    async with open_rollout_engine(ScriptedBackend(tok), reward_pool=InProcessRewardPool()) as engine:
        async with open_openai_proxy(engine, tok) as proxy, httpx.AsyncClient(base_url=proxy.url) as http:
            s = await _start(http)
            sid = {"X-Session-Id": s["session_id"]}
            err = _error(await http.post("/v1/chat/completions", json={"messages": QUESTION}, headers=sid), 401)
            assert err["code"] == "invalid_api_key" and "api_key" in err["message"]
            _error(await http.post("/rl/set_reward", json={"reward": 1.0}, headers=sid), 401)
            _error(await http.post("/rl/set_reward", json={"reward": 1.0, "session_id": s["session_id"]}), 401)
            _error(await http.post("/rl/end_session", json={"session_id": s["session_id"]}), 401)
            _error(await http.post("/rl/end_session", json={}, headers=sid), 401)
            # an unknown bearer key with a live session's id: refused too (the SDK's own error type)
            stranger = sdk(proxy, "sk-nope", default_headers=sid)
            with pytest.raises(openai.AuthenticationError, match="api_key"):
                await stranger.chat.completions.create(model="default", messages=QUESTION)
            assert proxy.statistics().requests == 0 and proxy.sessions[s["session_id"]].state == "active"
            # the session's own key still works, and ends it
            await sdk(proxy, s["api_key"]).chat.completions.create(model="default", messages=QUESTION)
            r = await http.post("/rl/end_session", json={}, headers=_bearer(s))
            assert r.status_code == 200 and r.json()["interactions"] == 1
            result = await engine.wait_for_task(s["task_id"])
    assert result.status == "accepted"


async def test_a_key_with_another_sessions_id_is_refused_not_rerouted(sdk):
    tok = build_tiny_tokenizer()
    async with open_rollout_engine(ScriptedBackend(tok), reward_pool=InProcessRewardPool()) as engine:
        async with open_openai_proxy(engine, tok) as proxy, httpx.AsyncClient(base_url=proxy.url) as http:
            a, b = await _start(http), await _start(http)
            crossed = sdk(proxy, a["api_key"], default_headers={"X-Session-Id": b["session_id"]})
            with pytest.raises(openai.PermissionDeniedError, match="another session"):
                await crossed.chat.completions.create(model="default", messages=QUESTION)
            with pytest.raises(openai.PermissionDeniedError, match="another session"):  # the id in the body
                await sdk(proxy, a["api_key"]).chat.completions.create(
                    model="default", messages=QUESTION, extra_body={"session_id": b["session_id"]})
            err = _error(await http.post("/rl/set_reward", json={"reward": 1.0, "session_id": b["session_id"]},
                                         headers=_bearer(a)), 403)
            assert err["type"] == "permission_error" and err["code"] == "session_mismatch"
            _error(await http.post("/rl/end_session", json={}, headers={**_bearer(a), "X-Session-Id": "sess-00"}),
                   403)
            _error(await http.post("/rl/end_session", json={"session_id": b["session_id"]}, headers=_bearer(a)), 403)
            assert proxy.statistics().requests == 0
            assert [proxy.sessions[s["session_id"]].state for s in (a, b)] == ["active", "active"]
            # an id that agrees with the key is accepted (header and body)
            agreed = sdk(proxy, a["api_key"], default_headers={"X-Session-Id": a["session_id"]})
            await agreed.chat.completions.create(model="default", messages=QUESTION,
                                                 extra_body={"session_id": a["session_id"]})
            r = await http.post("/rl/set_reward", json={"reward": 0.5, "session_id": a["session_id"]},
                                headers=_bearer(a))
            assert r.status_code == 200
            r = await http.post("/rl/end_session", json={}, headers={**_bearer(a), "X-Session-Id": a["session_id"]})
            assert r.status_code == 200 and r.json()["interactions"] == 1
            await http.post("/rl/end_session", json={}, headers=_bearer(b))
            ra, rb = await engine.wait_for_task(a["task_id"]), await engine.wait_for_task(b["task_id"])
    assert ra.status == "accepted" and ra.trajectory["rewards"].tolist() == [0.5]
    assert (rb.status, rb.reason) == ("rejected", "workflow_returned_none")  # b made no request: nothing to train on


async def test_keys_are_never_written_to_the_logs(sdk, caplog):
    tok = build_tiny_tokenizer()
    caplog.set_level(logging.DEBUG)
    async with open_rollout_engine(ScriptedBackend(tok), reward_pool=InProcessRewardPool()) as engine:
        config = ProxyConfig(session_idle_timeout_s=2.0, admin_api_key="sk-admin-secret")
        async with open_openai_proxy(engine, tok, config) as proxy, httpx.AsyncClient(base_url=proxy.url) as http:
            r = await http.post("/rl/start_session", headers={"Authorization": "Bearer sk-admin-secret"})
            s = r.json()
            session = proxy.sessions[s["session_id"]]
            assert s["api_key"] not in repr(session)  # what a traceback or a debug line would print
            assert "sk-admin-secret" not in repr(proxy.config)
            await sdk(proxy, s["api_key"]).chat.completions.create(model="default", messages=QUESTION)
            await engine.wait_for_task(s["task_id"])  # abandoned when idle: logged
            r = await http.post("/rl/end_session", json={}, headers=_bearer(s))
            assert r.status_code == 401 and s["api_key"] not in r.text  # an ended key is not echoed back
    assert any("abandoned" in rec.getMessage() for rec in caplog.records)
    logged = "\n".join(rec.getMessage() for rec in caplog.records)
    assert s["api_key"] not in logged and "sk-admin-secret" not in logged

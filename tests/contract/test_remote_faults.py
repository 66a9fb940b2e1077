"""Contract tier: fault injection against small fake servers on real sockets on 127.0.0.1
(the fakes of ``tests/fixtures/fake_servers.py`` served by ``engine.serve.serve_http``, trio-native).

Each fault is retried, failed over, or failed with a clear error, and none hangs the run.
Real time (real sockets): short timeouts and backoff, every test bounded by ``trio.fail_after``.
"""

from __future__ import annotations

import socket

import httpx
import pytest
import trio

from engine import BackendError, EngineConfig, ModelRequest, open_rollout_engine
from engine.backends.remote import RemoteCallError, make_remote_backend
from engine.trajectory import trajectory_from_response
from engine.serve import HTTPResponse, serve_http
from engine.types import GenerationHyperparameters as G
from fake_servers import FakeSGLang, FakeVLLM, fake_tokens
from workflows import RolloutWorkflow

PROMPT = [3, 10, 20, 30]
FAST = {"backoff_initial_s": 0.01, "backoff_max_s": 0.05, "health_interval_s": 0.2, "health_timeout_s": 1.0,
        "connect_timeout_s": 1.0, "request_timeout_s": 10.0, "abort_timeout_s": 1.0}


async def serve(nursery, fake) -> str:
    port = await nursery.start(serve_http, fake.handle, "127.0.0.1", 0)
    return f"http://127.0.0.1:{port}"


def closed_port_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"  # nothing listens: connections are refused


def backend(urls, kind="sglang", **opts):
    return make_remote_backend(kind, urls, **{**FAST, **opts})


def req(rid="r", n=4):
    return ModelRequest(rid=rid, input_ids=PROMPT, gconfig=G(max_new_tokens=n))


async def test_5xx_and_malformed_json_are_retried(reward_pool):
    fake = FakeSGLang()
    fake.script = ["500", "503", "malformed", "ok"]
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            b = backend([await serve(nursery, fake)], eject_after_failures=10)
            async with open_rollout_engine(b, reward_pool=reward_pool) as engine:
                resp = await engine.agenerate(req())
                fake.script = ["malformed"] * 10
                with pytest.raises(BackendError, match="attempt 6 .*malformed JSON"):
                    await engine.agenerate(req())
            nursery.cancel_scope.cancel()
    assert resp.output_tokens == fake_tokens(PROMPT, 4)[0] and b.statistics().retries == 3 + 5


async def test_timeout_fails_over_and_aborts_the_slow_server(reward_pool):
    slow, fast = FakeSGLang(), FakeSGLang()
    slow.script = ["hang"]
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            urls = [await serve(nursery, slow), await serve(nursery, fast)]
            b = backend(urls, attempt_timeout_s=0.3)
            async with open_rollout_engine(b, reward_pool=reward_pool) as engine:
                resp = await engine.agenerate(req())
            nursery.cancel_scope.cancel()
    assert resp.output_len == 4 and len(fast.generate_calls) == 1
    assert slow.aborts == [{"rid": slow.generate_calls[0]["rid"]}] and not slow.running


async def test_refused_connection_fails_over_and_ejects(reward_pool):
    fake = FakeSGLang()
    dead = closed_port_url()
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            b = backend([dead, await serve(nursery, fake)])
            async with open_rollout_engine(b, reward_pool=reward_pool) as engine:
                assert not b.pool[dead].healthy  # refused at start-up
                b.pool.readmit(b.pool[dead])  # pretend it looked fine: the request must fail over
                resp = await engine.agenerate(req())
            nursery.cancel_scope.cancel()
    stats = {s.url: s for s in b.statistics().servers}
    assert resp.output_len == 4 and not stats[dead].healthy and "cannot connect" in stats[dead].last_error


async def test_evidence_faults_fail_with_a_clear_error(reward_pool):
    fake = FakeSGLang()
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            b = backend([await serve(nursery, fake)])
            async with open_rollout_engine(b, reward_pool=reward_pool) as engine:
                fake.script = ["mismatch"]
                with pytest.raises(BackendError, match="4 output_tokens but 3 output_logprobs"):
                    await engine.agenerate(req())
                fake.script = ["sentinel"]
                with pytest.raises(BackendError, match=r"output_logprobs\[0\] = -9999.0"):
                    await engine.agenerate(req())
                assert (await engine.agenerate(req())).output_len == 4  # the server is still in use
            nursery.cancel_scope.cancel()


class OneShot(RolloutWorkflow):
    async def arun_episode(self, engine, data):
        resp = await engine.agenerate(ModelRequest(rid=f"ep{data}", input_ids=PROMPT, gconfig=G(max_new_tokens=4)))
        return trajectory_from_response(resp, reward=1.0)


async def test_a_server_answering_403_forever_is_ejected_and_its_requests_fail_over(reward_pool):
    bad, good = FakeSGLang(), FakeSGLang()
    bad.script = ["403"] * 1000
    with trio.fail_after(15):
        async with trio.open_nursery() as nursery:
            urls = [await serve(nursery, bad), await serve(nursery, good)]
            b = backend(urls)
            async with open_rollout_engine(b, EngineConfig(max_concurrent_rollouts=8),
                                           reward_pool=reward_pool) as engine:
                for i in range(20):
                    engine.submit(i, OneShot())
                results = await engine.wait_results(20)
                servers = {s.url: s for s in b.pool.statistics()}
            nursery.cancel_scope.cancel()
    assert sorted(r.task_id for r in results) == list(range(20))
    assert all(r.status == "accepted" for r in results)  # 401/403: the server is out, its requests fail over
    assert 1 <= len(bad.generate_calls) <= 8  # at most the requests already sent to it when it first refused
    assert servers[urls[0]].access_denied and not servers[urls[0]].healthy
    assert len(good.generate_calls) == 20


async def test_serve_http_cancels_the_handler_when_the_client_disconnects():
    seen = []
    release = trio.Event()

    async def handler(request):
        try:
            await release.wait()
        except trio.Cancelled:
            seen.append("cancelled")
            raise
        return HTTPResponse(200, b"{}")

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            port = await nursery.start(serve_http, handler, "127.0.0.1", 0)
            async with httpx.AsyncClient() as client:
                with trio.move_on_after(0.2):
                    await client.get(f"http://127.0.0.1:{port}/x")
                while not seen:
                    await trio.sleep(0.01)  # the server notices the closed socket
                release.set()
                ok = await client.get(f"http://127.0.0.1:{port}/x")  # the server still serves
            nursery.cancel_scope.cancel()
    assert seen == ["cancelled"] and ok.status_code == 200


async def test_vllm_fake_over_sockets_abort_by_choice_id(reward_pool):
    fake = FakeVLLM()
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            b = backend([await serve(nursery, fake)], kind="vllm")
            async with open_rollout_engine(b, reward_pool=reward_pool) as engine:
                assert (await engine.agenerate(req())).output_len == 4 and b.model == "tiny"
                fake.script = ["hang"]
                async with trio.open_nursery() as inner:
                    inner.start_soon(engine.agenerate, req("gone"))
                    while not fake.running:
                        await trio.sleep(0.01)
                    inner.cancel_scope.cancel()
                while not fake.aborts:
                    await trio.sleep(0.01)
            nursery.cancel_scope.cancel()
    wire = fake.generate_calls[1]["request_id"]
    assert wire.startswith("gone@") and fake.aborts == [{"request_ids": [f"cmpl-{wire}-0"]}]


async def test_non_retryable_error_message_names_request_server_and_cause():
    fake = FakeSGLang()
    fake.script = [("reject", 400)]
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            url = await serve(nursery, fake)
            b = backend([url])
            with pytest.raises(RemoteCallError) as info:
                await b.generate(req("named"), 4)
            await b.aclose()
            nursery.cancel_scope.cancel()
    message = str(info.value)
    assert "request named" in message and url in message and "rejected the request" in message

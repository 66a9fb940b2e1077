"""Issue 13, class 7 (remote): HTTP 401/403 is a permanent, server-level error.

* a server answering 403 on every route, health included, fails start-up at once (under
  5 s on real sockets, not after ``startup_timeout_s`` = 300 s);
* a server refusing every generate with 401/403 leaves the rotation after its first refusal;
  the request fails over; when every server refuses, requests fail at once;
* ``served_models`` reports what the servers serve (SGLang ``/get_model_info``, vLLM
  ``/v1/models``), for the CLI's tokenizer check.
"""

from __future__ import annotations

import time

import pytest
import trio

from engine import BackendError, ModelRequest, open_rollout_engine
from engine.backends.remote import RemoteCallError, make_remote_backend
from engine.serve import HTTPResponse, serve_http
from engine.types import GenerationHyperparameters as G
from fake_servers import FakeSGLang, FakeVLLM, mock_transport

A, B = "http://a:1", "http://b:1"
PROMPT = [3, 10, 20, 30]


def make(fakes, kind="sglang", **opts):
    return make_remote_backend(kind, list(fakes), transport=mock_transport(fakes), seed=0, **opts)


def req(rid="r"):
    return ModelRequest(rid=rid, input_ids=PROMPT, gconfig=G(max_new_tokens=4))


async def _forbidden(request):
    return HTTPResponse(403, b'{"detail": "Forbidden"}')


@pytest.mark.parametrize("kind", ["sglang", "vllm"])
async def test_a_server_answering_403_on_every_route_fails_start_up_in_under_5_s(reward_pool, kind):
    async with trio.open_nursery() as nursery:
        port = await nursery.start(serve_http, _forbidden, "127.0.0.1", 0)
        backend = make_remote_backend(kind, [f"http://127.0.0.1:{port}"])  # default startup_timeout_s: 300 s
        assert backend.timeouts.startup_timeout_s == 300
        start = time.monotonic()
        with trio.fail_after(5):
            with pytest.raises(BackendError, match=r"every server refused access.*/health: HTTP 403"):
                async with open_rollout_engine(backend, reward_pool=reward_pool):
                    pytest.fail("the engine must not open")
        assert time.monotonic() - start < 5
        nursery.cancel_scope.cancel()


async def test_start_up_waits_for_a_server_that_is_not_up_yet_but_not_for_one_that_refuses(autojump_clock):
    fa, fb = FakeSGLang(), FakeSGLang()
    fa.health, fb.refuse = 401, True  # A refuses us; B is not up yet
    backend = make({A: fa, B: fb}, startup_timeout_s=30.0)

    async def b_comes_up():
        await trio.sleep(10)
        fb.refuse = False

    async with trio.open_nursery() as nursery:
        nursery.start_soon(b_comes_up)
        await backend.wait_ready()
    assert 10 <= trio.current_time() < 12
    assert [s.url for s in backend.pool.healthy] == [B] and backend.pool[A].denied


@pytest.mark.parametrize("status", ["401", "403"])
async def test_a_server_refusing_every_generate_leaves_the_rotation(status, autojump_clock):
    fa, fb = FakeSGLang(), FakeSGLang()
    fa.script = [status] * 100
    backend = make({A: fa, B: fb})
    for i in range(10):
        resp = await backend.generate(req(f"r{i}"), 4)
        assert resp.output_len == 4  # failed over at once
    assert len(fa.generate_calls) == 1 and len(fb.generate_calls) == 10
    await backend.check_health()  # A's health route answers 200: still out
    assert not backend.pool[A].healthy and backend.pool[A].denied
    stats = {s.url: s for s in backend.statistics().servers}
    assert stats[A].access_denied and f"HTTP {status}" in stats[A].last_error
    assert trio.current_time() < 1.0  # no backoff


async def test_when_every_server_refuses_requests_fail_at_once(autojump_clock):
    fa, fb = FakeSGLang(), FakeSGLang()
    fa.script, fb.script = ["403"] * 100, ["403"] * 100
    backend = make({A: fa, B: fb}, request_timeout_s=600)
    with pytest.raises(RemoteCallError, match="HTTP 403") as info:
        await backend.generate(req(), 4)
    assert info.value.access_denied
    with pytest.raises(RemoteCallError, match="every server refused access"):
        await backend.generate(req("again"), 4)  # no server left: fails now, not at the 600 s deadline
    assert len(fa.generate_calls) == len(fb.generate_calls) == 1
    assert trio.current_time() < 1.0


async def test_served_models_are_what_the_servers_report(autojump_clock):
    sglang = make({A: FakeSGLang()})
    await sglang.wait_ready()
    assert await sglang.served_models() == {A: "fake"}
    vllm = make({B: FakeVLLM()}, kind="vllm")
    await vllm.wait_ready()
    assert await vllm.served_models() == {B: "tiny"}

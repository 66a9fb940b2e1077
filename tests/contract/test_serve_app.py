"""Contract tier: ``rollout serve``'s ASGI app (Starlette routes over the tiny random Llama
of ``engine.testing`` on CPU), in-process through ``httpx.ASGITransport``, and served by
hypercorn's trio worker on a real socket on 127.0.0.1 (:func:`engine.serve.serve_asgi`).

Checks what the HTTP layer decides: status codes and error bodies (503 while loading, 404
and 405 as ``{"detail"}``, 400 and 413 as SGLang-style errors), plain routes, and a
``/generate`` answer in the wire format the ``sglang`` client reads.
"""

from __future__ import annotations

import httpx
import pytest
import trio

from engine.backends import sglang_wire as wire
from engine.backends.hf import HFBackend
from engine.serve import SGLangServer, serve_asgi
from engine.testing import build_tiny_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("serve-app") / "tiny", seed=0)


async def test_routes_status_codes_and_error_bodies(tiny, monkeypatch):
    server = SGLangServer(HFBackend(tiny), model_path=tiny, served_model_name="tiny")
    transport = httpx.ASGITransport(app=server.app)
    async with httpx.AsyncClient(transport=transport, base_url="http://serve") as client:
        assert (await client.get("/health")).status_code == 503  # loading
        loading = await client.post("/generate", json={"input_ids": [3, 4]})
        assert loading.status_code == 503 and loading.json()["error"]["message"] == "the model is still loading"
        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                await nursery.start(server.run)
                assert (await client.get("/health")).status_code == 200
                missing, wrong = await client.get("/nope"), await client.get("/generate")
                assert (missing.status_code, missing.json()) == (404, {"detail": "Not Found"})
                assert (wrong.status_code, wrong.json()) == (405, {"detail": "Method Not Allowed"})
                bad = await client.post("/generate", content=b"{bad")
                assert bad.status_code == 400 and bad.json()["code"] == 400
                assert bad.json()["error"]["message"].startswith("malformed JSON body")
                streamed = await client.post("/generate", json={"input_ids": [3], "stream": True})
                assert streamed.status_code == 400 and "does not stream" in streamed.json()["message"]
                monkeypatch.setattr("engine.serve._http.MAX_BODY_BYTES", 1000)
                big = await client.post("/generate", json={"input_ids": [3] * 1000})
                assert big.status_code == 413 and big.json()["error"]["message"] == "body too large"
                monkeypatch.undo()
                answer = await client.put("/generate", json={"input_ids": [3, 10, 20], "rid": "q", "return_logprob": True,
                                                             "sampling_params": {"max_new_tokens": 5, "ignore_eos": True}})
                assert answer.status_code == 200
                parsed = wire.parse_generate_answer(answer.json())
                assert len(parsed.tokens) == len(parsed.logprobs) == 5 and parsed.stop_reason == "length"
                assert parsed.weight_version == "0" and answer.json()["meta_info"]["id"] == "q"
                assert all(lp <= 0 for lp in parsed.logprobs)
                models = (await client.get("/v1/models")).json()
                assert models["data"][0]["id"] == "tiny"
                flushed = await client.post("/flush_cache")
                assert flushed.text == "Cache flushed." and flushed.headers["content-type"].startswith("text/plain")
                assert (await client.get("/get_load")).json() == {"num_running_reqs": 0, "num_waiting_reqs": 0}
                info = (await client.get("/get_server_info")).json()
                assert info["counters"]["completed"] == 1 and info["backend"]["kind"] == "hf"
                abort = await client.post("/abort_request", json={})
                assert abort.status_code == 400 and "give rid" in abort.json()["message"]
                nursery.cancel_scope.cancel()


async def test_hypercorn_serves_the_app_on_a_socket_with_keep_alive(tiny):
    server = SGLangServer(HFBackend(tiny), model_path=tiny)
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            port = await nursery.start(serve_asgi, server.app, "127.0.0.1", 0)
            await nursery.start(server.run)
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
                for _ in range(3):  # the server keeps the connection open between requests
                    answer = await client.post("/generate", json={"input_ids": [3, 10], "sampling_params": {
                        "max_new_tokens": 2, "ignore_eos": True}})
                    assert answer.status_code == 200 and len(answer.json()["output_ids"]) == 2
                    assert answer.headers.get("connection") != "close"
            nursery.cancel_scope.cancel()


async def test_a_busy_port_is_one_oserror_naming_it():
    from engine.serve import open_listeners

    sockets = await open_listeners("127.0.0.1", 0)
    port = sockets[0].getsockname()[1]
    try:
        with pytest.raises(OSError, match=f"cannot listen on 127.0.0.1:{port}: .*in use"):
            await open_listeners("127.0.0.1", port)
    finally:
        for s in sockets:
            s.close()

"""Contract tier: the ``sglang`` backend pointed at a real sglang-router (PyPI
``sglang-router`` 0.3.2, a Rust wheel without torch) in front of two ``rollout serve``
processes on 127.0.0.1 -- the router URL works as one server.

Marked ``router`` (and ``slow``), an opt-in tier: run with ``pytest --router``; then every
test *fails* (never skips) when there is no venv with ``sglang_router``
(``$TRIO_ROLLOUT_ROUTER_VENV``, default ``.venv-router``; make it with
``python -m venv .venv-router && .venv-router/bin/pip install sglang-router==0.3.2``).
Real processes: real-time bounds and polling of server state.
"""

from __future__ import annotations

import os
import socket
import subprocess
import time
from pathlib import Path

import httpx
import pytest
import trio

from engine import BackendError, EngineConfig, ModelRequest, open_rollout_engine
from engine.backends.remote import make_remote_backend
from engine.testing import build_tiny_model
from engine.types import GenerationHyperparameters as G
from test_remote_serve import PROMPT, OneShot, ServeProcess

ROOT = Path(__file__).resolve().parents[2]
VENV = Path(os.environ.get("TRIO_ROLLOUT_ROUTER_VENV", ROOT / ".venv-router"))


def _has_router() -> bool:
    return any((VENV / "lib").glob("python3*/site-packages/sglang_router")) if (VENV / "lib").exists() else False


pytestmark = [pytest.mark.router, pytest.mark.slow]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def router(tmp_path_factory):
    if not _has_router():
        pytest.fail(f"--router asked for the real sglang-router tier, but there is no venv with sglang_router at "
                    f"{VENV} (python -m venv {VENV} && {VENV}/bin/pip install sglang-router==0.3.2)")
    root = tmp_path_factory.mktemp("router")
    model = build_tiny_model(root / "tiny", seed=0)
    workers = [ServeProcess(model, root / f"serve{i}.log") for i in range(2)]
    proc = None
    try:
        urls = [w.wait_ready() for w in workers]
        port = _free_port()
        with (root / "router.log").open("w") as log:  # the child keeps its own copy of the descriptor
            proc = subprocess.Popen(
                [str(VENV / "bin" / "python"), "-m", "sglang_router.launch_router", "--worker-urls", *urls,
                 "--policy", "round_robin", "--host", "127.0.0.1", "--port", str(port), "--log-level", "warn"],
                stdout=log, stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:  # until the router lists both workers as healthy
            try:
                listed = httpx.get(url + "/workers", timeout=2).json()["workers"]
                if sum(w["is_healthy"] for w in listed) == 2:
                    break
            except (httpx.HTTPError, ValueError, KeyError):
                pass
            if time.monotonic() > deadline or proc.poll() is not None:
                pytest.fail(f"the router did not come up:\n{(root / 'router.log').read_text()[-3000:]}")
            time.sleep(0.2)
        yield url, urls
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=30)
        for w in workers:
            w.terminate()
        for w in workers:
            w.stop()


async def test_router_url_works_as_one_server(router, reward_pool):
    url, workers = router
    backend = make_remote_backend("sglang", [url], health_interval_s=0.5, request_timeout_s=60.0)

    async def counters():
        return [(await backend.call(w, "GET", "/get_server_info"))["counters"] for w in workers]

    async def running():
        return sum([(await backend.call(w, "GET", "/get_load"))["num_running_reqs"] for w in workers])

    with trio.fail_after(90):
        async with open_rollout_engine(backend, EngineConfig(max_concurrent_rollouts=8),
                                       reward_pool=reward_pool) as engine:
            for i in range(20):
                engine.submit({"i": i, "ids": PROMPT + [5 + i]}, OneShot())
            results = await engine.wait_results(20)
            assert all(r.status == "accepted" for r in results)
            assert all(c.get("completed", 0) >= 5 for c in await counters())  # the router spread them
            # a cancelled episode: the router 404s /abort_request, the dropped connection stops the worker
            before = sum(c.get("cancelled", 0) for c in await counters())
            async with trio.open_nursery() as nursery:
                nursery.start_soon(engine.agenerate, ModelRequest(input_ids=PROMPT, gconfig=G(
                    max_new_tokens=1500, ignore_eos=True)))
                while not await running():
                    await trio.sleep(0.02)
                nursery.cancel_scope.cancel()
            while await running():
                await trio.sleep(0.02)
            assert sum(c.get("cancelled", 0) for c in await counters()) == before + 1
            # control calls go to the workers, found through the router
            assert sorted(await backend.router_workers()) == sorted(workers)
            with pytest.raises(BackendError, match="404"):
                await backend.pause_generation()
            await backend.pause_generation(servers=workers)
            await backend.continue_generation(servers=workers)
            assert (await engine.agenerate(ModelRequest(input_ids=PROMPT, gconfig=G(max_new_tokens=4)))).output_len == 4
    stats = backend.statistics()
    assert stats.aborts_sent == 1 and stats.aborts_failed == 1

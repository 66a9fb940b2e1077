"""The ``vllm`` backend's weight update against fake vLLM servers: the calls in order, the
worker extension chosen from ``/server_info``, and the refusal of a CPU server without it
(vLLM 0.32's CPU reload keeps a tied LM head's start-up weights; the real-server evidence is
``test_remote_vllm.py::test_stock_reload_weights_keeps_the_tied_head_on_cpu``)."""

from __future__ import annotations

import pytest

from engine import BackendError, open_rollout_engine
from engine.backends.remote import WORKER_EXTENSION, make_remote_backend, vllm_worker_dir
from fake_servers import FakeVLLM, mock_transport

A, B = "http://fake-a:1", "http://fake-b:1"


def _backend(fakes):
    return make_remote_backend("vllm", list(fakes), transport=mock_transport(fakes))


def _control(fake):
    return [what for what, _ in fake.control]


async def test_stock_reload_then_prefix_cache_reset_then_version_on_a_gpu_server(reward_pool):
    fake = FakeVLLM(device="cuda")
    async with open_rollout_engine(_backend({A: fake}), reward_pool=reward_pool) as engine:
        await engine.update_weights("/ckpt/b", version=1)
    assert _control(fake) == ["pause", "rpc", "reset_prefix_cache", "version", "resume"]
    assert fake.control[1][1]["method"] == "reload_weights" and fake.weights == "/ckpt/b"
    assert fake.weight_version == "1" and engine.version == 1


async def test_every_server_with_the_extension_reloads_through_it(reward_pool):
    fakes = {u: FakeVLLM(device="cpu", worker_extension_cls=WORKER_EXTENSION) for u in (A, B)}
    async with open_rollout_engine(_backend(fakes), reward_pool=reward_pool) as engine:
        await engine.update_weights("/ckpt/b", version=1)
    for fake in fakes.values():
        rpc = fake.control[1][1]
        assert rpc == {"method": "rollout_reload_weights", "kwargs": {"weights_path": "/ckpt/b"}}
        assert _control(fake) == ["pause", "rpc", "reset_prefix_cache", "version", "resume"]


async def test_a_cpu_server_without_the_extension_is_refused_before_anything_loads(reward_pool):
    fakes = {A: FakeVLLM(device="cpu", worker_extension_cls=WORKER_EXTENSION), B: FakeVLLM(device="cpu")}
    async with open_rollout_engine(_backend(fakes), reward_pool=reward_pool) as engine:
        with pytest.raises(BackendError, match=f"{B} run\\(s\\) without the worker extension") as info:
            await engine.update_weights("/ckpt/b", version=1)
        assert engine.version == 0 and not engine.paused
    assert WORKER_EXTENSION in str(info.value) and vllm_worker_dir() in str(info.value)
    for fake in fakes.values():
        assert fake.weights == "" and "rpc" not in _control(fake) and _control(fake)[-1] == "resume"


def test_the_extension_module_is_where_the_backend_says():
    from pathlib import Path

    module, cls = WORKER_EXTENSION.split(".")
    source = (Path(vllm_worker_dir()) / f"{module}.py").read_text()
    assert f"class {cls}:" in source and "def rollout_reload_weights(self, weights_path: str)" in source
    assert "import engine" not in source and "from engine" not in source  # the server's venv lacks this package


async def test_a_refused_reload_resumes_the_server_and_reports_the_servers_reason(reward_pool):
    """Regression (vLLM 0.32 CPU, a folder the server cannot read): /collective_rpc answered
    500 and uvicorn then closed the keep-alive connection; the /resume sent on it failed with
    'connection reset', so the server stayed paused (every later request blocked) and the
    error named the resume instead of the refused weights."""
    fake = FakeVLLM(device="cpu", worker_extension_cls=WORKER_EXTENSION)
    fake.reload_error = "rollout_reload_weights: /ckpt/b is not a folder on this server"
    backend = _backend({A: fake})
    async with open_rollout_engine(backend, reward_pool=reward_pool) as engine:
        with pytest.raises(BackendError) as info:
            await engine.update_weights("/ckpt/b", version=1)
        assert engine.version == 0 and not engine.paused and not backend.paused
    message = str(info.value)
    assert message.startswith("vllm: the weight update to /ckpt/b failed on every server: ")
    assert f"{A}/collective_rpc: HTTP 500" in message and "/ckpt/b is not a folder on this server" in message
    assert "continue" not in message and "reset by peer" not in message
    assert _control(fake) == ["pause", "rpc", "resume"] and not fake.paused and fake.weights == ""

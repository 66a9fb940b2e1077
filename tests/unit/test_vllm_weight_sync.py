"""The ``vllm`` backend's weight update against fake vLLM servers: the calls in order, the
worker extension chosen from ``/server_info``, and the refusal of a CPU server without it
(vLLM 0.32's CPU reload keeps a tied LM head's start-up weights; the real-server evidence is
``test_remote_vllm.py::test_stock_reload_weights_keeps_the_tied_head_on_cpu``)."""

from __future__ import annotations

import shutil

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


def _extension():
    """The worker extension's module, loaded from its file (it runs inside vLLM's workers)."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("rollout_vllm_worker",
                                                  Path(vllm_worker_dir()) / "rollout_vllm_worker.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class _Worker:
    """What the extension needs of vLLM's worker: ``reload_weights`` (recorded, or raising),
    and ``vllm_config.model_config.model`` (the folder it started from)."""

    def __init__(self, fail=None, started_from=""):
        import types

        self.fail, self.reloads = fail, []
        self.vllm_config = types.SimpleNamespace(model_config=types.SimpleNamespace(model=started_from))

    def reload_weights(self, weights_path, is_checkpoint_format):
        self.reloads.append(weights_path)
        if self.fail is not None:
            raise self.fail


@pytest.mark.parametrize("case", ["missing", "relative", "file", "no weights"])
def test_the_extension_refuses_a_folder_it_cannot_load_before_touching_the_model(tmp_path, monkeypatch, case):
    """Regression (vLLM 0.32 CPU): a reload of a path that is no folder on the server (a
    relative path, a trainer's local folder) failed *after* vLLM had moved every layer to
    the meta device (its layer-by-layer reload), with a Hub error ('Cannot find an
    appropriate cached snapshot folder'); the next request then killed the engine core
    (onednn_mm on Meta tensors).  Now nothing is touched and the error names the path."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a-file").write_text("")
    (tmp_path / "empty").mkdir()
    path = {"missing": str(tmp_path / "step-3"), "relative": "empty", "file": str(tmp_path / "a-file"),
            "no weights": str(tmp_path / "empty")}[case]
    worker = _Worker()
    with pytest.raises(ValueError) as info:
        _extension().RolloutWorkerExtension.rollout_reload_weights(worker, path)
    assert worker.reloads == []  # the model was not touched
    message = str(info.value)
    assert message.startswith("rollout_reload_weights: nothing was loaded: ")
    assert message.endswith(f" (weights_path {path!r})")
    if case == "relative":
        assert f"not an absolute path (the server would look it up in its own working directory, {tmp_path}, " \
               "or on the Hugging Face Hub)" in message
    elif case == "no weights":
        assert "no weight files (*.safetensors, *.bin, *.pt) in the folder" in message
    else:
        assert "no such folder on this server" in message
    assert "a folder the server can read at the same path" in message or case == "no weights"


def test_a_reload_that_fails_midway_says_the_server_must_be_restarted(tmp_path):
    folder = _checkpoint(tmp_path / "step-1", w=(2, 2))
    worker = _Worker(fail=RuntimeError("start (0) + length (256) exceeds dimension size (192)."))
    with pytest.raises(RuntimeError) as info:
        _extension().RolloutWorkerExtension.rollout_reload_weights(worker, folder)
    assert worker.reloads == [folder]
    message = str(info.value)
    assert message.startswith("rollout_reload_weights: the reload failed midway (RuntimeError: start (0) + "
                              "length (256) exceeds dimension size (192).), so this server's model is now partly "
                              "replaced")
    assert "restart the server" in message and "not the served model's" in message
    assert message.endswith(f"(weights_path {folder!r})")


def test_the_extension_refuses_an_unreadable_safetensors_file(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"\x05")  # cut short: e.g. a save still under way
    worker = _Worker()
    with pytest.raises(ValueError, match="nothing was loaded: model.safetensors is not a readable safetensors file"):
        _extension().RolloutWorkerExtension.rollout_reload_weights(worker, str(tmp_path))
    assert worker.reloads == []


def _checkpoint(folder, **shapes):
    """A safetensors checkpoint in ``folder`` with zero tensors of these shapes."""
    import torch
    from safetensors.torch import save_file

    folder.mkdir()
    save_file({name.replace("__", "."): torch.zeros(shape) for name, shape in shapes.items()},
              str(folder / "model.safetensors"))
    return str(folder)


def test_the_extension_refuses_a_checkpoint_of_another_shape_before_touching_the_model(tmp_path):
    """Regression (vLLM 0.32 CPU, a trainer whose model is not the served one): the reload
    failed midway ('start (0) + length (256) exceeds dimension size (192)') with the model
    partly replaced, and the next request killed the engine core.  The shapes are compared
    first: with the folder the server started from, then with the checkpoint loaded last."""
    served = _checkpoint(tmp_path / "served", embed__weight=(259, 128), mlp__up__weight=(256, 128))
    same = _checkpoint(tmp_path / "step-1", embed__weight=(259, 128), mlp__up__weight=(256, 128))
    other = _checkpoint(tmp_path / "other", embed__weight=(259, 128), mlp__up__weight=(192, 128))
    worker = _Worker(started_from=served)
    extension = _extension().RolloutWorkerExtension
    with pytest.raises(ValueError) as info:
        extension.rollout_reload_weights(worker, other)
    assert worker.reloads == []
    assert str(info.value) == (
        "rollout_reload_weights: nothing was loaded: not a checkpoint of the served model: 1 tensor(s) have "
        f"other shapes, e.g. mlp.up.weight [192, 128] (served: [256, 128]) (weights_path {other!r})")
    with pytest.raises(ValueError):  # nothing learned from a refused checkpoint
        extension.rollout_reload_weights(worker, other)
    worker.reloads.clear()
    try:
        extension.rollout_reload_weights(worker, same)
    except ModuleNotFoundError:  # the LM-head reprocessing after the reload needs vllm
        pass
    assert worker.reloads == [same]
    worker.vllm_config.model_config.model = same  # (what vLLM's reload does)
    shutil.rmtree(same)  # (what the TRL adapter does once the next step loads): its shapes were kept
    with pytest.raises(ValueError, match="nothing was loaded: not a checkpoint of the served model"):
        extension.rollout_reload_weights(worker, other)

"""``engine.integrations.trl``'s folder weight sync (the server backends' path), with a fake
engine and a fake trainer: the path the servers are sent, the folders kept, and the one
error of a refused load.  The real-server proof is ``tests/contract/test_trl_vllm.py``."""

from __future__ import annotations

import types
from pathlib import Path

import pytest

from engine.errors import BackendError
from engine.integrations._trl_engine import BlockingEngine, sync_weights


class FakeEngine:
    """The blocking facade as the adapter sees it; ``refuse`` makes the next load fail."""

    def __init__(self) -> None:
        self.version = 0
        self.loads: list[tuple[str, int, list[str]]] = []  # (source, version, files there at the time)
        self.refuse: str | None = None

    def update_weights(self, source, *, version):
        self.loads.append((source, version, sorted(p.name for p in Path(source).iterdir())))
        if self.refuse is not None:
            raise BackendError(self.refuse)
        self.version = version

    def statistics(self):
        return types.SimpleNamespace(backend=types.SimpleNamespace(kind="vllm"))


class FakeModel:
    peft_config = None

    def save_pretrained(self, folder):
        Path(folder).mkdir(parents=True)
        (Path(folder) / "model.safetensors").write_bytes(b"weights")


def fake_trainer():
    model = FakeModel()
    return types.SimpleNamespace(model=model, accelerator=types.SimpleNamespace(unwrap_model=lambda m: m))


def test_a_relative_weights_dir_is_sent_as_an_absolute_path(tmp_path, monkeypatch):
    """Regression: ``weights_dir="weights"`` sent ``weights/step-0``, which a server resolves
    in its own working directory (or takes for a Hugging Face Hub id)."""
    monkeypatch.chdir(tmp_path)
    engine, folders = FakeEngine(), []
    assert sync_weights(BlockingEngine(engine), fake_trainer(), version=0, mode="auto", weights_dir="weights",
                        previous=folders) == "folder"
    assert engine.loads == [(str(tmp_path / "weights" / "step-0"), 0, ["model.safetensors"])]
    assert folders == [tmp_path / "weights" / "step-0"]


def test_each_load_removes_the_previous_folder(tmp_path):
    engine, folders = FakeEngine(), []
    for version in range(3):
        sync_weights(BlockingEngine(engine), fake_trainer(), version=version, mode="folder",
                     weights_dir=str(tmp_path), previous=folders)
        assert sorted(p.name for p in tmp_path.iterdir()) == [f"step-{version}"]
    assert [v for _, v, _ in engine.loads] == [0, 1, 2] and engine.version == 2


def test_a_refused_load_is_one_error_naming_the_step_the_folder_and_the_fix(tmp_path):
    """Regression: the backend's error came alone (nothing said which step, or that the
    servers must read ``weights_dir``), and the refused step's folder stayed on disk."""
    engine, folders = FakeEngine(), []
    sync_weights(BlockingEngine(engine), fake_trainer(), version=0, mode="folder", weights_dir=str(tmp_path),
                 previous=folders)
    engine.refuse = "vllm: the weight update to X failed on every server: http://s:1/collective_rpc: HTTP 500: no"
    with pytest.raises(BackendError) as info:
        sync_weights(BlockingEngine(engine), fake_trainer(), version=1, mode="folder", weights_dir=str(tmp_path),
                     previous=folders)
    folder = tmp_path / "step-1"
    message = str(info.value)
    assert message.startswith(f"rollout_func weight sync: the vllm backend did not load the trainer's weights of "
                              f"step 1 from {folder}: vllm: the weight update to X failed on every server: ")
    assert f"weights_dir ({tmp_path}) must be a folder every server reads at the same path" in message
    assert message.endswith("the engine's weights version stays 0")
    assert isinstance(info.value.__cause__, BackendError)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-0"]  # the folder loaded last is kept
    assert folders == [tmp_path / "step-0"] and engine.version == 0


def test_an_object_that_is_not_an_engine_is_refused_when_the_adapter_is_built():
    # a new-user trial: TRLRollout(object(), workflow) was accepted and failed only at TRL's first call
    with pytest.raises(TypeError, match=r"a object is not a rollout engine \(no update_weights, statistics\).*RolloutEngineThread"):
        BlockingEngine(object())

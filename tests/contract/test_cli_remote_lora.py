"""``rollout run --backend sglang --lora PATH`` against a fake SGLang server on a real socket
(127.0.0.1): every request samples ``lora-v0``, loaded from a folder of the run's own and
unloaded when the run ends; a server without LoRA is one line and exit status 2."""

from __future__ import annotations

import pytest

pytest.importorskip("peft")

from conftest import run_cli  # noqa: E402
from engine.testing import build_tiny_lora, build_tiny_model  # noqa: E402
from fake_servers import FakeSGLang  # noqa: E402
from test_cli_remote import RUN, _error_lines, serving  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    model = build_tiny_model(root / "tiny-model", seed=0)
    return str(model), build_tiny_lora(model, root / "adapter", seed=1)


def _fake(model):
    fake = FakeSGLang()
    fake.model_path = fake.base_model = model
    return fake


def test_a_remote_run_samples_the_adapter_and_unloads_it_at_the_end(tiny, tmp_path, capsys):
    model, adapter = tiny
    fake = _fake(model)
    with serving(fake.handle) as url:
        code, _, err = run_cli([*RUN, "--server", url, "--lora", str(adapter), "--out", str(tmp_path / "o")], capsys)
    assert code == 0, err
    assert len(fake.generate_calls) == 3 and {c["lora_path"] for c in fake.generate_calls} == {"lora-v0"}
    loads = [body for what, body in fake.control if what == "load_lora"]
    assert len(loads) == 1 and loads[0]["lora_path"] != str(adapter)  # a folder of the run's own
    assert fake.loras == {} and ("unload_lora", {"lora_name": "lora-v0"}) in fake.control and not fake.broken


def test_a_server_without_lora_is_one_line(tiny, tmp_path, capsys):
    model, adapter = tiny
    fake = _fake(model)
    fake.lora = False
    with serving(fake.handle) as url:
        code, _, err = run_cli([*RUN, "--server", url, "--lora", str(adapter), "--out", str(tmp_path / "o")], capsys)
    lines = _error_lines(err)
    assert code == 2 and len(lines) == 1, err
    assert "runs without LoRA: restart it with --enable-lora --max-lora-rank 8" in lines[0]
    assert fake.generate_calls == []

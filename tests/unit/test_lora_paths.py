"""``--lora PATH`` says what is wrong with the path (a new-user trial: a typo'd path and a
path to ``adapter_config.json`` itself both read "is not a LoRA adapter folder")."""

from __future__ import annotations

import pytest

from conftest import run_cli
from engine.errors import InvalidRequestError
from engine.serve import ServeConfig


def _paths(tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "adapter_config.json").write_text("{}")
    return {"missing": (tmp_path / "nowhere", "does not exist"),
            "file": (tmp_path / "adapter_config.json", "is a file, not an adapter folder"),
            "empty": (tmp_path / "empty", "is not a LoRA adapter folder (no adapter_config.json")}


@pytest.mark.parametrize("case", ["missing", "file", "empty"])
def test_run_lora_path_errors_say_what_is_wrong(tmp_path, capsys, case):
    path, needle = _paths(tmp_path)[case]
    code, _, err = run_cli(["run", "--backend", "sim", "--dataset", "builtin:arith:1", "--lora", str(path),
                            "--out", str(tmp_path / "o")], capsys)
    assert code == 2 and f"argument --lora: {path} {needle}" in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("case", ["missing", "file", "empty"])
def test_serve_lora_path_errors_say_what_is_wrong(tmp_path, case):
    path, needle = _paths(tmp_path)[case]
    with pytest.raises(InvalidRequestError) as info:
        ServeConfig(lora=str(path))
    assert str(info.value).startswith(f"--lora {path} {needle}") and "\n" not in str(info.value)

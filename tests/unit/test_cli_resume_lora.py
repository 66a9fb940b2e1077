"""--resume keeps the run's LoRA adapter (a new-user trial: the resumed part of a
``rollout run --lora`` sampled the base model, silently)."""

from __future__ import annotations

import json

import pytest

from engine.cli._journal import resolve_resume_options
from engine.cli._parser import _explicit_options, build_parser


def _run_dir(tmp_path, **options):
    out = tmp_path / "out"
    out.mkdir()
    (tmp_path / "adapter").mkdir()
    (out / "run.json").write_text(json.dumps({"format": 1, "options": options, "cwd": str(tmp_path)}))
    return out


def _resume(argv):
    args = build_parser().parse_args(argv)
    resolve_resume_options(args, _explicit_options(argv))
    return args


def test_resume_takes_the_runs_adapter_and_its_name(tmp_path):
    out = _run_dir(tmp_path, backend="vllm", lora="adapter", lora_name="policy")  # saved relative to the run's cwd
    args = _resume(["run", "--resume", str(out), "--server", "http://127.0.0.1:1"])
    assert args.lora == str(tmp_path / "adapter") and args.lora_name == "policy"


def test_resume_refuses_another_adapter(tmp_path):
    out = _run_dir(tmp_path, backend="vllm", lora="adapter", lora_name="policy")
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "adapter_config.json").write_text(json.dumps({"r": 8, "peft_type": "LORA"}))
    with pytest.raises(ValueError, match="--lora .* differs from the run's --lora"):
        _resume(["run", "--resume", str(out), "--lora", str(tmp_path / "other")])

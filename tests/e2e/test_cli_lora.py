"""End to end: ``rollout run --lora PATH`` on the hf backend (the tiny model + a rank-8
adapter): the run samples the adapter (its stored logprobs are peft's, teacher-forced), and
the LoRA options' bad input is one line and exit status 2."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("peft")

from conftest import run_cli  # noqa: E402
from engine.cli import load_trajectories  # noqa: E402
from engine.testing import build_tiny_lora, build_tiny_model  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    model = build_tiny_model(root / "model", seed=0)
    return model, build_tiny_lora(model, root / "adapter", seed=3)


def test_run_samples_the_adapter(tiny, tmp_path, capsys):
    import warnings

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model, adapter = tiny
    out = tmp_path / "out"
    code, _, err = run_cli(["run", "--backend", "hf", "--model", str(model), "--lora", str(adapter), "--lora-name",
                            "policy", "--dataset", "builtin:arith:2", "--n-samples", "1", "--max-new-tokens", "6",
                            "--quiet", "--out", str(out)], capsys)
    assert code == 0, err
    batch = load_trajectories(out)
    assert batch.batch_size[0] == 2
    base = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        peft_model = PeftModel.from_pretrained(base, adapter).eval()
    for i in range(2):
        real = batch["attention_mask"][i]
        ids, gen = batch["input_ids"][i][real].long(), batch["loss_mask"][i][real].bool()
        with torch.no_grad():
            logp = torch.log_softmax(peft_model(input_ids=ids[None]).logits[0].float(), -1)  # [T, V]
        pos = torch.nonzero(gen).squeeze(1)
        assert (logp[pos - 1, ids[pos]] - batch["logprobs"][i][real][gen]).abs().max() < 1e-4
        assert (batch["versions"][i][real][gen] == 0).all()
    summary = json.loads((out / "summary.json").read_text())  # written after the close
    assert summary["backend_statistics"]["lora"]["last_served"] == {"policy": "policy-v0"}


@pytest.mark.parametrize(("extra", "needle"), [
    (["--lora-name", "x"], "--lora-name names the adapter of --lora PATH: give --lora too"),
    (["--backend", "sim", "--lora", "ADAPTER"], "--lora needs a model to adapt"),
    (["--lora", "/nonexistent"], "--lora: /nonexistent does not exist"),
    (["--lora", "ADAPTER", "--lora-name", "a b"], "--lora-name: must be a name without spaces"),
])
def test_bad_lora_options_are_one_line_and_exit_2(tiny, tmp_path, capsys, extra, needle):
    _, adapter = tiny
    args = ["run", "--dataset", "builtin:arith:1", "--quiet", "--out", str(tmp_path / "o"),
            *[str(adapter) if a == "ADAPTER" else a for a in extra]]
    if "--backend" not in args:
        args += ["--backend", "sim"]
    code, _, err = run_cli(args, capsys)
    assert code == 2 and needle in err and len(err.strip().splitlines()) == 1, err

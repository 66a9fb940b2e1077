"""The tiny offline models: a byte-level tokenizer, a tiny random causal LM, a tiny random VLM.

Nothing here touches the network; everything is deterministic across processes.  The
public entry is :mod:`engine.testing` (ids and shapes are documented there); the model
cache (:mod:`engine.models`) builds ``builtin:tiny`` and ``builtin:tiny-vlm`` from the
``write_*`` recipes, which is why they live here, below both (``engine.testing`` sits
above the reward package, which uses the model cache).  ``write_*`` fill an empty
folder; ``build_*`` write a folder atomically (:func:`engine.models._folders.atomic_build`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from engine.models._folders import atomic_build

__all__ = [
    "TINY_BOS_ID",
    "TINY_EOS_ID",
    "TINY_IMAGE_TOKEN",
    "TINY_IMAGE_TOKEN_ID",
    "TINY_PAD_ID",
    "TINY_VLM_IMAGE_TOKENS",
    "build_tiny_model",
    "build_tiny_tokenizer",
    "build_tiny_vlm",
    "build_tiny_vlm_processor",
    "write_tiny_model",
    "write_tiny_vlm",
]

_SPECIALS = ("<pad>", "<bos>", "<eos>", "<|im_start|>", "<|im_end|>")
TINY_PAD_ID = 0
TINY_BOS_ID = 1
TINY_EOS_ID = 4  # <|im_end|>

#: ChatML without a default system prompt.
_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_ARCHS = ("llama", "qwen2")

TINY_IMAGE_TOKEN = "<image>"
TINY_IMAGE_TOKEN_ID = 261
TINY_VLM_IMAGE_TOKENS = 17  # per image: (32 / 8) ** 2 patches + the CLS feature

#: ChatML whose message content is a string or a list of parts (``{"type": "image"}`` or
#: ``"image_url"`` -> ``<image>``, ``{"type": "text", "text": ...}`` -> the text).
_VLM_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for part in m['content'] %}"
    "{% if part['type'] in ('image', 'image_url') %}<image>{% elif part['type'] == 'text' %}{{ part['text'] }}"
    "{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table, in a fixed order.

    (``tokenizers.pre_tokenizers.ByteLevel.alphabet()`` returns the same characters in a
    different order in every process, so it must not be used to assign ids.)
    """
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def build_tiny_tokenizer():
    """A deterministic byte-level ``PreTrainedTokenizerFast`` with a ChatML chat template.

    See the module docstring for the ids. ``len(tokenizer) == 261``.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {s: i for i, s in enumerate(_SPECIALS)}
    vocab |= {ch: b + len(_SPECIALS) for b, ch in _bytes_to_unicode().items()}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None))  # no merges: pure bytes
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(list(_SPECIALS))
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<bos>",
        eos_token="<|im_end|>",
        pad_token="<pad>",
        additional_special_tokens=["<eos>", "<|im_start|>"],
        padding_side="left",
        model_max_length=2048,
    )
    tokenizer.chat_template = _CHAT_TEMPLATE
    return tokenizer


def build_tiny_model(path: str | os.PathLike[str], *, seed: int = 0, arch: str = "llama") -> str:
    """Write a tiny random causal LM with the tiny tokenizer to ``path``; return ``str(path)``.

    ``arch`` is ``"llama"`` (``LlamaForCausalLM``) or ``"qwen2"`` (``Qwen2ForCausalLM``):
    vocab 261, hidden 64, 2 layers, 4 heads, 2 kv heads, intermediate 128, tied embeddings,
    float32, max 2048 positions.

    For ``"qwen2"`` note that transformers 5 ignores ``tokenizer_class`` for this model type
    and ``AutoTokenizer`` loads the folder as ``Qwen2Tokenizer``: it appends
    ``<|endoftext|>`` as id 261 (so the model's vocab is 262, larger than
    ``len(build_tiny_tokenizer())`` as in real Qwen checkpoints) and NFC-normalizes text
    (decomposed accents then encode differently); plain text and chat prompts give the same
    ids as :func:`build_tiny_tokenizer`. The weights depend only on ``seed`` (and the torch
    version): two builds give byte-identical ``model.safetensors``. Idempotent: a complete
    folder at ``path`` is returned untouched (note: whatever its seed/arch). The folder
    appears atomically; ``path`` must not exist or be an empty directory.
    """
    if arch not in _ARCHS:
        raise ValueError(f"arch: expected one of {_ARCHS}, got {arch!r}")
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise TypeError(f"seed: expected an int, got {seed!r}")
    dest = atomic_build(Path(path), lambda tmp: write_tiny_model(tmp, seed=seed, arch=arch))
    return str(dest)


def write_tiny_model(out: Path, *, seed: int, arch: str) -> dict:
    """Write the tiny model of :func:`build_tiny_model` into the empty folder ``out``
    (not atomic); return what describes it (for a cache marker)."""
    import torch
    from transformers import GenerationConfig

    tokenizer = build_tiny_tokenizer()
    shape: dict[str, Any] = dict(
        # qwen2: AutoTokenizer loads the folder as Qwen2Tokenizer, which appends <|endoftext|> (261)
        vocab_size=len(tokenizer) + (1 if arch == "qwen2" else 0),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        initializer_range=0.2,  # spread logits: log-probs differ by token (std ~1.7 nats)
        bos_token_id=TINY_BOS_ID,
        eos_token_id=TINY_EOS_ID,
        pad_token_id=TINY_PAD_ID,
    )
    import transformers

    config_class: Any = transformers.LlamaConfig if arch == "llama" else transformers.Qwen2Config
    model_class: Any = transformers.LlamaForCausalLM if arch == "llama" else transformers.Qwen2ForCausalLM
    config = config_class(**shape, dtype="float32")
    with torch.random.fork_rng(devices=[]):  # leave the caller's RNG state alone
        torch.manual_seed(seed)
        with torch.device("cpu"):
            model = model_class(config).to(torch.float32)
    model.generation_config = GenerationConfig(
        bos_token_id=TINY_BOS_ID, eos_token_id=TINY_EOS_ID, pad_token_id=TINY_PAD_ID
    )
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return {"kind": "tiny-random", "arch": arch, "seed": seed}


def build_tiny_vlm_processor():
    """The tiny VLM's ``LlavaProcessor``: the tiny tokenizer plus ``<image>`` (id
    :data:`TINY_IMAGE_TOKEN_ID`) and a CLIP image processor (any image -> ``pixel_values``
    ``[1, 3, 32, 32]`` float32; each ``<image>`` in the text becomes
    :data:`TINY_VLM_IMAGE_TOKENS` image tokens). Its chat template (also the tokenizer's)
    renders list content: image parts as ``<image>``, text parts as their text.
    """
    from transformers import LlavaProcessor

    try:  # the PIL backend by name: CLIPImageProcessor would warn that torchvision is missing, then use it
        from transformers import CLIPImageProcessorPil as ImageProcessor
    except ImportError:  # transformers without per-backend image processor classes
        from transformers import CLIPImageProcessor as ImageProcessor

    tokenizer = build_tiny_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": ["<eos>", "<|im_start|>", TINY_IMAGE_TOKEN]})
    if tokenizer.convert_tokens_to_ids(TINY_IMAGE_TOKEN) != TINY_IMAGE_TOKEN_ID:
        raise RuntimeError(f"the tiny tokenizer gave {TINY_IMAGE_TOKEN} an unexpected id")
    tokenizer.chat_template = _VLM_CHAT_TEMPLATE
    image_processor = ImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    # "full" keeps the CLS feature, so each image has one feature more than it has patches
    return LlavaProcessor(image_processor=image_processor, tokenizer=tokenizer, patch_size=8,
                          vision_feature_select_strategy="full", image_token=TINY_IMAGE_TOKEN,
                          num_additional_image_tokens=1, chat_template=_VLM_CHAT_TEMPLATE)


def build_tiny_vlm(path: str | os.PathLike[str], *, seed: int = 0) -> str:
    """Write a tiny random Llava model and its processor to ``path``; return ``str(path)``.

    Vision tower: CLIP, hidden 32, 1 layer, 2 heads, 32x32 images, patch 8. Language model:
    the tiny Llama of :func:`build_tiny_model` (hidden 64, 2 layers) with vocab 262 (the tiny
    tokenizer plus ``<image>``). Loads with ``AutoModelForImageTextToText`` and
    ``AutoProcessor`` (no download). Same guarantees as :func:`build_tiny_model`: weights
    depend only on ``seed``, idempotent, the folder appears atomically.

    Raises:
        TypeError: ``seed`` is not an int.
    """
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise TypeError(f"seed: expected an int, got {seed!r}")
    return str(atomic_build(Path(path), lambda tmp: write_tiny_vlm(tmp, seed=seed)))


def write_tiny_vlm(out: Path, *, seed: int) -> dict:
    """Write the tiny VLM of :func:`build_tiny_vlm` into the empty folder ``out`` (not
    atomic); return what describes it (for a cache marker)."""
    import torch
    from transformers import CLIPVisionConfig, GenerationConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

    processor = build_tiny_vlm_processor()
    text = LlamaConfig(
        vocab_size=len(processor.tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048, tie_word_embeddings=True,
        initializer_range=0.2, bos_token_id=TINY_BOS_ID, eos_token_id=TINY_EOS_ID, pad_token_id=TINY_PAD_ID,
    )
    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                              image_size=32, patch_size=8)
    config = LlavaConfig(vision_config=vision, text_config=text, image_token_index=TINY_IMAGE_TOKEN_ID,
                         vision_feature_layer=-1, vision_feature_select_strategy="full", dtype="float32")
    with torch.random.fork_rng(devices=[]):  # leave the caller's RNG state alone
        torch.manual_seed(seed)
        with torch.device("cpu"):
            model: Any = LlavaForConditionalGeneration(config)
            model = model.to(torch.float32)
    model.generation_config = GenerationConfig(
        bos_token_id=TINY_BOS_ID, eos_token_id=TINY_EOS_ID, pad_token_id=TINY_PAD_ID
    )
    model.save_pretrained(out)
    processor.save_pretrained(out)
    return {"kind": "tiny-random-vlm", "arch": "llava", "seed": seed}

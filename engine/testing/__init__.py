"""Offline helpers for testing workflows: tiny models and test doubles.

* the tiny models (from :mod:`engine.models._tiny`, which the model cache shares): a byte-level
  tokenizer, a tiny random causal LM and a tiny random VLM;
* :mod:`._doubles`: :class:`MockBackend` (an async function as a backend) and
  :class:`InProcessRewardPool` (rewards computed in-process).

Nothing here touches the network; everything is deterministic across processes.

::

    from engine.testing import InProcessRewardPool, MockBackend, build_tiny_model, build_tiny_tokenizer

    pool = InProcessRewardPool()                        # open_rollout_engine(backend, reward_pool=pool)

    tok = build_tiny_tokenizer()                        # 261 tokens, ChatML template
    path = build_tiny_model(tmp_path / "tiny")          # HF folder: config, weights, tokenizer
    # then use `path` wherever a model spec is accepted (a local directory)
    vlm = build_tiny_vlm(tmp_path / "vlm")              # Llava: config, weights, processor
    lora = build_tiny_lora(path, tmp_path / "lora-1", seed=1)  # rank-8 peft adapter folder (needs peft)

Tokenizer ids: ``<pad>`` 0, ``<bos>`` 1, ``<eos>`` 2, ``<|im_start|>`` 3, ``<|im_end|>`` 4,
then byte ``b`` is id ``b + 5`` (no merges: one token per UTF-8 byte, so ids are easy to
reason about). ``eos_token`` is ``<|im_end|>`` (4): chat turns end with it, so a
generation config built with ``new_with_stop_and_pad_token_ids`` stops there; ``pad_token``
is ``<pad>`` (0); ``<eos>`` (2) is an ordinary special token that stops nothing.
Padding is on the left (for batched generation).

The model is a random ``LlamaForCausalLM`` (or ``Qwen2ForCausalLM``) of ~0.1M parameters:
wire, abort, logprob and padding tests run in milliseconds on CPU; its text is noise. Its
weights are drawn with std 0.2 (not the usual 0.02) so that next-token distributions are
far from flat: a near-uniform model would give every token the same log-prob and hide an
off-by-one between tokens and log-probs. Greedy output may hit ``<|im_end|>`` early; pass
``ignore_eos`` or a fixed budget where a test needs a length.

The tiny vision-language model (:func:`build_tiny_vlm`, ``TOOLING_NOTES.md`` §10) is a random
``LlavaForConditionalGeneration``: a 1-layer CLIP vision tower on 32x32 images (patch 8, so 16
patches + CLS = 17 image features), a projector, and the tiny Llama above as its language model.
Its tokenizer is the tiny tokenizer plus ``<image>`` (id 261); its processor (``LlavaProcessor``,
CLIP image processor, PIL backend) expands each ``<image>`` in the text to 17 of them and turns
an image into ``pixel_values`` of shape ``[1, 3, 32, 32]`` float32.
"""

from ._doubles import InProcessRewardPool, MockBackend
from ._lora import TINY_LORA_TARGETS, build_tiny_lora
from engine.models._tiny import (
    TINY_BOS_ID,
    TINY_EOS_ID,
    TINY_IMAGE_TOKEN,
    TINY_IMAGE_TOKEN_ID,
    TINY_PAD_ID,
    TINY_VLM_IMAGE_TOKENS,
    build_tiny_model,
    build_tiny_tokenizer,
    build_tiny_vlm,
    build_tiny_vlm_processor,
)

__all__ = [
    "TINY_BOS_ID",
    "TINY_EOS_ID",
    "TINY_IMAGE_TOKEN",
    "TINY_IMAGE_TOKEN_ID",
    "TINY_LORA_TARGETS",
    "TINY_PAD_ID",
    "TINY_VLM_IMAGE_TOKENS",
    "InProcessRewardPool",
    "MockBackend",
    "build_tiny_lora",
    "build_tiny_model",
    "build_tiny_tokenizer",
    "build_tiny_vlm",
    "build_tiny_vlm_processor",
]

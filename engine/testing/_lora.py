"""A tiny random LoRA adapter for a tiny model (:func:`build_tiny_lora`): peft's folder
layout, deterministic, far from the identity (so that a test can tell two versions and the
base apart).  Needs peft (``pip install 'trio-rollout[lora]'``)."""

from __future__ import annotations

import math
import os
from pathlib import Path

__all__ = ["TINY_LORA_TARGETS", "build_tiny_lora"]

#: the projections a tiny adapter adapts (every linear layer of a Llama block)
TINY_LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def build_tiny_lora(model_dir: str | os.PathLike[str], out: str | os.PathLike[str], *, seed: int = 0, rank: int = 8,
                    alpha: int = 16, scale: float = 0.2, base_model_name_or_path: str | None = None) -> Path:
    """Write a random rank-``rank`` LoRA adapter of the model in ``model_dir`` into the new
    folder ``out`` (``adapter_config.json`` + ``adapter_model.safetensors``, what peft's
    ``save_pretrained`` writes; loadable by ``PeftModel.from_pretrained``, vLLM and SGLang);
    returns ``out``.

    ``lora_A`` ``[rank, in]`` is uniform in ``+-1/sqrt(in)``, ``lora_B`` ``[out, rank]`` normal
    with std ``scale``, both float32 from a ``torch.Generator`` seeded with ``seed`` (torch's
    global RNG is not touched); every linear layer of :data:`TINY_LORA_TARGETS` is adapted.
    ``base_model_name_or_path`` (default: ``model_dir``) goes into the config.

    Raises:
        ImportError: peft is not installed.
        BackendError: ``out`` exists and is not empty.
    """
    import torch
    from peft import LoraConfig
    from transformers import AutoConfig, AutoModelForCausalLM

    from ..backends.lora import AdapterWeights, _jsonable, write_adapter

    config = AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):  # shapes only: no weights read, no RNG drawn
        model = AutoModelForCausalLM.from_config(config)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] in TINY_LORA_TARGETS and isinstance(module, torch.nn.Linear):
            bound = 1.0 / math.sqrt(module.in_features)
            a = (torch.rand(rank, module.in_features, generator=gen) * 2 - 1) * bound
            b = torch.randn(module.out_features, rank, generator=gen) * scale
            tensors[f"base_model.model.{name}.lora_A.weight"] = a
            tensors[f"base_model.model.{name}.lora_B.weight"] = b
    lora_config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(TINY_LORA_TARGETS), task_type="CAUSAL_LM",
                             inference_mode=True, base_model_name_or_path=base_model_name_or_path or str(model_dir))
    return write_adapter(AdapterWeights(_jsonable(lora_config.to_dict()), tensors), out)

"""Helpers of the OpenRLHF tier: the vLLM stand-in, OpenRLHF's own consumer, the recomputation.

* :func:`vllm_stand_in`: a ``vllm`` module with ``SamplingParams`` (ours,
  :class:`engine.integrations.openrlhf.SamplingParams`), ``vllm.inputs.TokensPrompt`` and
  ``vllm.utils.random_uuid``: what ``openrlhf.trainer.ppo_utils.samples_generator`` and
  ``openrlhf.trainer.ray.vllm_engine`` import at module level.  vLLM itself needs CUDA; OpenRLHF's
  own tests (``tests/test_agent.py``) replace it the same way.  Nothing of it runs: the
  engine's actors never import vllm.
* :func:`samples_generator`: OpenRLHF's ``samples_generator`` module, imported unmodified.
* :func:`openrlhf_logprobs`: the log-probs OpenRLHF's trainer computes for an ``Experience``,
  written out from ``openrlhf/models/actor.py`` ``Actor.forward`` (that module imports
  DeepSpeed and flash-attn at import time, so it cannot be imported here): position ids from
  the attention mask, float32 logits divided by the temperature, ``log_softmax`` at the rolled
  labels, ``[:, :-1]``, then the last ``action_mask.shape[1]`` positions times the mask.
"""

from __future__ import annotations

import importlib
import sys
import types
import uuid

import torch


def vllm_stand_in() -> types.ModuleType:
    from engine.integrations.openrlhf import SamplingParams

    vllm = types.ModuleType("vllm")
    vllm.__version__ = "0.29.0"  # OpenRLHF 0.11.2's pin; only compared, never used
    vllm.SamplingParams = SamplingParams
    inputs = types.ModuleType("vllm.inputs")
    inputs.TokensPrompt = dict
    utils = types.ModuleType("vllm.utils")
    utils.random_uuid = lambda: uuid.uuid4().hex
    vllm.inputs, vllm.utils = inputs, utils
    return vllm


def install_vllm_stand_in(monkeypatch) -> None:
    vllm = vllm_stand_in()
    for name, module in (("vllm", vllm), ("vllm.inputs", vllm.inputs), ("vllm.utils", vllm.utils)):
        if name not in sys.modules:
            monkeypatch.setitem(sys.modules, name, module)


def samples_generator(monkeypatch):
    install_vllm_stand_in(monkeypatch)
    return importlib.import_module("openrlhf.trainer.ppo_utils.samples_generator")


def openrlhf_logprobs(model, experience, temperature: float, *, full: bool = False):
    """``Actor.forward(sequences, action_mask, attention_mask)`` of OpenRLHF 0.11.2 (no packing):
    ``[B, A]`` log-probs of the action tokens (0 elsewhere); with ``full``, also the whole
    ``[B, A, V]`` log-softmax at the same positions."""
    sequences, attention_mask, action_mask = experience.sequences, experience.attention_mask, experience.action_mask
    rolled = torch.roll(sequences, shifts=-1, dims=1)
    position_ids = attention_mask.long().cumsum(-1) - 1
    position_ids.masked_fill_(attention_mask == 0, 1)
    with torch.no_grad():
        logits = model(sequences, attention_mask=attention_mask, position_ids=position_ids)["logits"].to(torch.float32)
    if temperature != 1.0:
        logits = logits / temperature
    everything = torch.log_softmax(logits, dim=-1)
    log_probs = everything.gather(-1, rolled.unsqueeze(-1)).squeeze(-1)[:, :-1]
    actions = log_probs[:, -action_mask.shape[1]:] * action_mask.float()
    return (actions, everything[:, :-1][:, -action_mask.shape[1]:]) if full else actions

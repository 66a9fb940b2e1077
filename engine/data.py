"""Trajectories as TensorDicts, and AReaL's padding/concatenation rules.

A trajectory (what ``RolloutWorkflow.arun_episode`` returns) is a
``tensordict.TensorDict`` with batch size ``[B]`` (``B = 1`` for one episode)
holding the fields of :data:`TRAJECTORY_SCHEMA` (field set from AReaL
``areal/workflow/rlvr.py``).  Returning ``None`` from a workflow rejects the episode.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import cast

import torch
from tensordict import TensorDict


__all__ = ["TRAJECTORY_PAD_VALUES", "TRAJECTORY_SCHEMA", "concat_padded_tensors"]

#: field -> (dims, dtype).  ``"BT"`` = ``[B, T]`` per token, ``"B"`` = ``[B]`` per episode.
TRAJECTORY_SCHEMA: dict[str, tuple[str, torch.dtype]] = {
    "input_ids": ("BT", torch.int32),  # prompt + completion token ids
    "loss_mask": ("BT", torch.int32),  # 0 on prompt, 1 on generated tokens
    "logprobs": ("BT", torch.float32),  # 0.0 on prompt; sampled-token logprob on generated
    "versions": ("BT", torch.int32),  # -1 on prompt; policy version per generated token
    "turn_ids": ("BT", torch.int32),  # -1 on prompt; turn index on generated tokens
    "attention_mask": ("BT", torch.bool),  # True on real tokens, False on padding
    "rewards": ("B", torch.float32),  # scalar reward per episode
    "is_truncated": ("B", torch.bool),  # stop_reason == "length"
}

#: The value :func:`concat_padded_tensors` right-pads each per-token field with
#: (per-episode ``[B]`` fields are never padded).  ``versions`` and ``turn_ids``
#: pad with -1, their "no generated token here" value: 0 is a real policy
#: version and a real turn index.  Any other ``[B, T, ...]`` field pads with the
#: ``pad_value`` argument (default 0), as in AReaL.
TRAJECTORY_PAD_VALUES: dict[str, float] = {
    "input_ids": 0,  # whatever the tokenizer's pad id: attention_mask says what is real
    "loss_mask": 0,
    "logprobs": 0.0,
    "versions": -1,
    "turn_ids": -1,
    "attention_mask": 0,  # False: always, whatever pad_value / pad_values say
}
_FIXED_PADS = {"versions": -1, "turn_ids": -1}


def concat_padded_tensors(tds: Sequence[TensorDict], pad_value: float = 0.0, *,
                          pad_values: Mapping[str, float] | None = None) -> TensorDict:
    """Concatenate trajectories on the batch dim, right-padding ragged dims.

    Rules (AReaL ``concat_padded_tensors`` in ``areal/utils/data.py``): all inputs
    must have the same key set; tensors with >= 2 dims are right-padded on every
    non-batch dim to the maximum over inputs, then concatenated on dim 0; 1-D
    tensors are concatenated unpadded; ``attention_mask`` is always padded with 0
    (False), every other key with ``pad_value``.  Ours: ``versions`` and
    ``turn_ids`` pad with -1 (their value on non-generated tokens; 0 is a real
    version and turn), see :data:`TRAJECTORY_PAD_VALUES`; dtypes are preserved
    and must agree (tensordict's ``pad_sequence`` silently drops mismatched keys
    and casts dtypes, so it is not used here).

    Args:
        tds: TensorDicts with batch sizes ``[B_i]``.
        pad_value: padding for every key except ``attention_mask``, ``versions``
            and ``turn_ids``.
        pad_values: per-key padding that overrides the above (except for
            ``attention_mask``, always 0), e.g. ``{"input_ids": tokenizer.pad_token_id}``.

    Returns:
        A TensorDict with batch size ``[sum B_i]``; an empty ``TensorDict`` for no input.

    Raises:
        ValueError: key sets differ (names the offending index and keys), dtypes
            differ, ranks differ, or a TensorDict has a batch rank other than 1.
    """
    if not tds:
        return TensorDict({}, batch_size=[0])
    keys = set(tds[0].keys())
    for i, td in enumerate(tds):
        if td.batch_dims != 1:
            raise ValueError(f"trajectory {i}: batch size must be [B], got {list(td.batch_size)}")
        if set(td.keys()) != keys:
            missing, extra = sorted(keys - set(td.keys())), sorted(set(td.keys()) - keys)
            raise ValueError(
                f"trajectory {i} has a different key set from trajectory 0: missing {missing}, extra {extra}"
            )
    out: dict[str, torch.Tensor] = {}
    for key in cast("list[str]", sorted(keys)):  # a trajectory's keys are plain strings
        tensors = [td.get(key) for td in tds]
        first = tensors[0]
        for i, t in enumerate(tensors):
            if t.dtype != first.dtype:
                raise ValueError(f"trajectory {i}: {key!r} has dtype {t.dtype}, trajectory 0 has {first.dtype}")
            if t.dim() != first.dim():
                raise ValueError(f"trajectory {i}: {key!r} has {t.dim()} dims, trajectory 0 has {first.dim()}")
        if first.dim() >= 2:
            target = [max(t.shape[d] for t in tensors) for d in range(1, first.dim())]
            fill: float
            if key == "attention_mask":
                fill = 0
            elif pad_values is not None and key in pad_values:
                fill = pad_values[key]
            else:
                fill = _FIXED_PADS.get(key, pad_value)
            padded = []
            for t in tensors:
                if list(t.shape[1:]) != target:
                    full = torch.full((t.shape[0], *target), fill, dtype=t.dtype)
                    full[(slice(None), *(slice(0, s) for s in t.shape[1:]))] = t
                    t = full
                padded.append(t)
            tensors = padded
        out[key] = torch.cat(tensors, dim=0)
    return TensorDict(out, batch_size=[sum(td.batch_size[0] for td in tds)])

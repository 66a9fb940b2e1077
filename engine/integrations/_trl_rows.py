"""TRL's rows in, TRL's columns out: the data of the adapter's episodes and the
per-completion lists ``rollout_func`` returns.

In (:func:`batch_rows`, :func:`episode_data`).  TRL 1.16 hands ``rollout_func`` only the
prompts (``_generate(prompts)``); the dataset rows they came from (every column) are the
``inputs`` of the calling ``GRPOTrainer._generate_and_score_completions`` frame, which is
where TRL's own reward functions get their columns from.  :func:`batch_rows` reads them
there (checked: one row per prompt); the workflow's data is the row's columns plus the
prompt, as ``messages`` (a conversational prompt: a list of ``{"role", "content"}``) or as
``trl_prompt`` / ``trl_prompt_ids`` (a plain-text prompt, tokenized as TRL does:
``processing_class(text=prompt)["input_ids"]``).

Out (:func:`completion_columns`).  One trajectory row (``engine.data.TRAJECTORY_SCHEMA``)
becomes one completion: ``prompt_ids`` = the real tokens before the first generated one
(``loss_mask`` 1), ``completion_ids`` / ``logprobs`` / ``token_versions`` / ``env_mask`` =
the rest (``env_mask`` is the ``loss_mask`` there: 1 = a sampled token, 0 = a tool or
template token of a multi-turn episode; TRL's reserved field, its ``tool_mask``).
"""

from __future__ import annotations

import logging
import sys
from types import FrameType
from typing import Any

from ..errors import InvalidRequestError

__all__ = ["COLUMNS", "batch_rows", "completion_columns", "episode_data", "is_conversational"]

logger = logging.getLogger(f"rollout.{__name__}")

#: the per-completion columns of the output, in order (``env_mask`` is added when it has a 0)
COLUMNS = ("prompt_ids", "completion_ids", "logprobs", "engine_reward", "stop_reason", "is_truncated",
           "token_versions")

_FRAME = "_generate_and_score_completions"  # GRPOTrainer's method that calls _generate -> rollout_func
_MAX_DEPTH = 8  # rollout_func <- _generate <- _generate_and_score_completions (+ wrappers, subclasses)


def is_conversational(prompt: Any) -> bool:
    """TRL's rule (``trl.data_utils.is_conversational``): a list of dicts with ``role``."""
    return isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], dict) and "role" in prompt[0]


def batch_rows(prompts: list[Any], trainer: Any) -> list[dict[str, Any]] | None:
    """The dataset rows of this ``rollout_func`` call (one per prompt), read from the
    calling ``_generate_and_score_completions(inputs)`` frame of ``trainer``; None when no
    such frame is on the stack (another TRL version, or a direct call)."""
    frame: FrameType | None = sys._getframe(1)
    try:
        for _ in range(_MAX_DEPTH):
            if frame is None:
                return None
            if frame.f_code.co_name == _FRAME and frame.f_locals.get("self") is trainer:
                inputs = frame.f_locals.get("inputs")
                if isinstance(inputs, list) and len(inputs) == len(prompts) and all(isinstance(r, dict) for r in inputs):
                    return inputs
                return None
            frame = frame.f_back
        return None
    finally:
        del frame  # no reference cycle through this frame


def episode_data(prompt: Any, row: dict[str, Any] | None, processing_class: Any) -> dict[str, Any]:
    """The workflow's data for one prompt: the row's columns (``prompt`` left out), then the
    prompt as ``messages`` (conversational) or ``trl_prompt`` + ``trl_prompt_ids`` (text)."""
    data = {k: v for k, v in (row or {}).items() if k != "prompt"}
    if is_conversational(prompt):
        data["messages"] = prompt
    elif isinstance(prompt, str):
        data["trl_prompt"] = prompt
        data["trl_prompt_ids"] = list(processing_class(text=prompt)["input_ids"])
    else:
        raise InvalidRequestError(
            f"rollout_func: a prompt is a {type(prompt).__name__}; TRL prompts are a string or a list of "
            "{'role', 'content'} messages (the dataset's 'prompt' column)")
    return data


def completion_columns(traj: Any) -> list[dict[str, Any]]:
    """One dict per row of the trajectory ``traj`` (batch ``[B]``) with the keys of
    :data:`COLUMNS` plus ``env_mask``.  ``engine_reward`` is the raw reward
    (``original_rewards`` when the engine normalised ``rewards`` within the group).

    Raises:
        InvalidRequestError: a row has no generated token (``loss_mask`` all 0).
    """
    rewards = traj["original_rewards"] if "original_rewards" in traj.keys() else traj["rewards"]  # [B] float32
    truncated = traj["is_truncated"] if "is_truncated" in traj.keys() else None  # [B] bool
    out = []
    for r in range(traj.batch_size[0]):
        real = traj["attention_mask"][r].bool()  # [T]
        ids = traj["input_ids"][r][real].tolist()
        loss = traj["loss_mask"][r][real].tolist()
        if 1 not in loss:
            raise InvalidRequestError("rollout_func: a trajectory row has no generated token (loss_mask all 0)")
        p = loss.index(1)  # the first sampled token: everything before it is the prompt
        is_truncated = bool(truncated[r]) if truncated is not None else False
        out.append({
            "prompt_ids": ids[:p],
            "completion_ids": ids[p:],
            "logprobs": traj["logprobs"][r][real][p:].tolist(),  # the behaviour policy's, per token
            "engine_reward": float(rewards[r]),
            "stop_reason": "length" if is_truncated else "stop",
            "is_truncated": is_truncated,
            "token_versions": traj["versions"][r][real][p:].tolist(),  # -1 on tool/template tokens
            "env_mask": loss[p:],
        })
    return out

"""AReaL's types <-> the engine's: requests, responses, trajectories.

* Requests and responses (AReaL ``areal/api/io_struct.py``, ``cli_args.py``): the fields
  have the same names and meanings; AReaL's ``GenerationHyperparameters`` adds
  ``lora_name`` (ignored: the engine serves one policy) and ``use_beam_search``
  (refused), its ``ModelResponse`` adds ``input_images``, ``itl`` and
  ``routed_experts`` (filled as AReaL's remote engine fills them without MoE routing).
* Trajectories.  An AReaL workflow returns a ``dict`` of tensors ``[B, T]`` / ``[B]``;
  the engine carries it as a ``TensorDict`` of batch ``[B]`` (:func:`to_engine_trajectory`)
  and concatenates group members and batches with its own padding rule, which differs
  from AReaL's (``areal/utils/data.py: concat_padded_tensors`` pads everything but
  ``attention_mask`` with 0; ours pads ``versions`` and ``turn_ids`` with -1).  So each
  row also carries, per tensor key of rank >= 2, its own width (``_areal_w:<key>``);
  :func:`to_areal_groups` cuts the engine's batch back into AReaL's per-group dicts, each
  padded to its own group's width with AReaL's pad values, the engine's bookkeeping keys
  (``group_id``, ``group_size``, ``is_stale``, ...) removed: the dicts AReaL's own
  executor returns, key for key, dtype for dtype, pad for pad.
"""

from __future__ import annotations

from typing import Any

import torch
from tensordict import TensorDict

from ..errors import InvalidRequestError, WorkflowError
from ..types import GenerationHyperparameters, ModelRequest, ModelResponse

__all__ = ["ENGINE_KEYS", "WIDTH_PREFIX", "from_engine_response", "to_areal_groups", "to_engine_request",
           "to_engine_trajectory"]

#: keys the engine adds to a trajectory (removed from what AReaL sees unless kept)
ENGINE_KEYS = frozenset({"group_id", "group_size", "is_stale", "original_rewards"})
#: per-row width of each rank >= 2 tensor: ``_areal_w:<key>`` (int64 [B])
WIDTH_PREFIX = "_areal_w:"

_GCONFIG_FIELDS = ("n_samples", "max_new_tokens", "min_new_tokens", "max_tokens", "greedy", "top_p", "top_k",
                   "temperature", "stop_token_ids", "ignore_eos", "skip_special_tokens", "stop", "frequency_penalty")


def to_engine_gconfig(gconfig: Any) -> GenerationHyperparameters:
    """AReaL's ``GenerationHyperparameters`` as ours (same fields; ``lora_name`` dropped).

    Raises:
        InvalidRequestError: ``use_beam_search=True`` (the engine samples; no beam search).
    """
    if getattr(gconfig, "use_beam_search", False):
        raise InvalidRequestError("agenerate: gconfig.use_beam_search=True is not supported by trio-rollout's "
                                  "engine (it samples); set use_beam_search=False")
    values = {name: getattr(gconfig, name) for name in _GCONFIG_FIELDS if hasattr(gconfig, name)}
    values["stop_token_ids"] = [int(t) for t in values.get("stop_token_ids") or [] if t is not None]
    if values.get("stop") is not None:
        values["stop"] = list(values["stop"])
    return GenerationHyperparameters(**values)


def to_engine_request(req: Any) -> ModelRequest:
    """AReaL's ``ModelRequest`` as ours (``rid``, ``input_ids``, ``gconfig``, ``metadata``,
    ``tokenizer``, ``image_data`` (AReaL's empty list = None), ``processor``).

    Raises:
        InvalidRequestError: ``use_beam_search``, or ``vision_msg_vllm`` set (vLLM-only).
    """
    if getattr(req, "vision_msg_vllm", None):
        raise InvalidRequestError("agenerate: ModelRequest.vision_msg_vllm is vLLM's own message format; "
                                  "pass images as image_data (base64) instead")
    images = getattr(req, "image_data", None)
    return ModelRequest(rid=str(req.rid), input_ids=list(req.input_ids), gconfig=to_engine_gconfig(req.gconfig),
                        metadata=dict(req.metadata or {}), tokenizer=req.tokenizer,
                        image_data=list(images) if images else None, processor=getattr(req, "processor", None))


def from_engine_response(resp: ModelResponse, req: Any, response_cls: type) -> Any:
    """Our ``ModelResponse`` as AReaL's ``response_cls`` (``areal.api.ModelResponse``), filled
    as AReaL's remote engine fills it: ``input_images`` from the request, ``itl`` empty,
    ``routed_experts`` None."""
    return response_cls(input_tokens=list(resp.input_tokens), output_tokens=list(resp.output_tokens),
                        output_logprobs=list(resp.output_logprobs), output_versions=list(resp.output_versions),
                        stop_reason=resp.stop_reason, tokenizer=req.tokenizer,
                        input_images=list(getattr(req, "image_data", None) or []),
                        processor=getattr(req, "processor", None), latency=resp.latency, ttft=resp.ttft)


def to_engine_trajectory(traj: Any) -> TensorDict | None:
    """An AReaL trajectory ``dict`` (tensors ``[B, ...]``) as a ``TensorDict`` of batch ``[B]``
    plus the per-row widths (``_areal_w:<key>``) of its rank >= 2 tensors.  ``None`` and an
    empty dict stay ``None`` (a rejection).

    Raises:
        WorkflowError: not a dict, a value that is not a tensor (AReaL's list and multimodal
            values are not carried), tensors that disagree on ``B``, no ``input_ids`` /
            ``attention_mask`` (AReaL's ``check_trajectory_format``).
    """
    if traj is None:
        return None
    if not isinstance(traj, dict):
        raise WorkflowError(f"an AReaL workflow returned {type(traj).__name__}; expected a dict of tensors or None")
    if not traj:
        return None
    missing = {"input_ids", "attention_mask"} - traj.keys()
    if missing:
        raise WorkflowError(f"an AReaL workflow returned a trajectory without {sorted(missing)} "
                            "(AReaL requires input_ids and attention_mask)")
    rows = None
    values: dict[str, torch.Tensor] = {}
    for key, value in traj.items():
        if not isinstance(value, torch.Tensor):
            raise WorkflowError(f"an AReaL workflow returned trajectory key {key!r} as {type(value).__name__}: this "
                                "adapter carries tensors only (lists and multimodal inputs are not supported)")
        if value.dim() == 0:
            raise WorkflowError(f"trajectory key {key!r} is a 0-d tensor; AReaL trajectories are [B, ...] "
                                "(unsqueeze(0) it, as AReaL's workflows do)")
        rows = value.shape[0] if rows is None else rows
        if value.shape[0] != rows:
            raise WorkflowError(f"trajectory key {key!r} has {value.shape[0]} rows, another key has {rows}")
        values[key] = value
    assert rows is not None
    for key, value in list(values.items()):
        if value.dim() >= 2:
            values[WIDTH_PREFIX + key] = torch.full((rows,), value.shape[1], dtype=torch.int64)
    return TensorDict(values, batch_size=[rows])


def to_areal_groups(td: TensorDict, *, keep_engine_keys: bool = False) -> list[dict[str, Any]]:
    """Cut an engine batch (one episode's result, or ``prepare_batch``'s concatenation of
    several) into AReaL's list of per-group dicts (see the module docstring); order kept.
    A batch without ``group_id`` is one group."""
    if td.batch_size[0] == 0:
        return []
    if "group_id" in td.keys():
        ids = td.get("group_id").tolist()
        bounds = [0] + [i for i in range(1, len(ids)) if ids[i] != ids[i - 1]] + [len(ids)]
    else:
        bounds = [0, td.batch_size[0]]
    return [_areal_dict(td, start, stop, keep_engine_keys) for start, stop in zip(bounds, bounds[1:])]


def _areal_dict(td: TensorDict, start: int, stop: int, keep_engine_keys: bool) -> dict[str, Any]:
    out: dict[str, Any] = {}
    keys = [k for k in td.keys() if isinstance(k, str)]
    for key in keys:
        if key.startswith(WIDTH_PREFIX) or (key in ENGINE_KEYS and not keep_engine_keys):
            continue
        value = td.get(key)[start:stop]
        width_key = WIDTH_PREFIX + key
        if value.dim() >= 2 and width_key in keys:
            widths = td.get(width_key)[start:stop]  # [rows] int64
            value = value[:, : int(widths.max())]
            beyond = torch.arange(value.shape[1]).unsqueeze(0) >= widths.unsqueeze(1)  # [rows, W] bool
            if bool(beyond.any()):  # the engine's padding: AReaL pads every key with 0 (False)
                value = value.masked_fill(beyond.view(*beyond.shape, *([1] * (value.dim() - 2))), 0)
        out[key] = value.contiguous()
    return out

"""Test doubles of the AReaL tier: one seeded inference behind both AReaL's own executor and
the adapter, and the comparison of what each returns.

:class:`SeededInference` answers a prompt with tokens, logprobs and a stop reason that depend
only on the prompt ids and on how many times that prompt was asked before: so AReaL's
``WorkflowExecutor`` (through :class:`SeededAReaLEngine`) and the adapter (through
:func:`seeded_backend`) see the same multiset of responses, whatever order their concurrent
episodes ask in.  Group members are exchangeable, so a group's rows are compared as a multiset
(:func:`canonical`) and groups are matched by their rows.
"""

from __future__ import annotations

import hashlib
import threading
from collections import Counter
from typing import Any

import pytest
import torch

from engine import MockBackend
from engine import ModelResponse as OurResponse


class SeededInference:
    """Deterministic responses (see the module docstring).

    Args:
        eos_id: the stop token put last on a response shorter than its budget.
        max_len: the longest response, in tokens.
    """

    def __init__(self, eos_id: int, max_len: int = 7) -> None:
        self.eos_id = eos_id
        self.max_len = max_len
        self.asked: Counter[tuple[int, ...]] = Counter()
        self._lock = threading.Lock()

    def respond(self, input_ids: list[int], budget: int) -> tuple[list[int], list[float], str]:
        key = tuple(input_ids)
        with self._lock:
            k = self.asked[key]
            self.asked[key] += 1
        h = hashlib.blake2b(repr((key, k)).encode(), digest_size=32).digest()
        n = 1 + h[0] % min(budget, self.max_len)
        tokens = [5 + h[1 + i] % 200 for i in range(n)]  # byte tokens of the tiny tokenizer: never eos/pad
        logprobs = [-(1 + h[16 + i % 16]) / 64.0 for i in range(n)]
        if n < budget:
            tokens[-1] = self.eos_id
            return tokens, logprobs, "stop"
        return tokens, logprobs, "length"


def seeded_backend(inference: SeededInference) -> MockBackend:
    """The engine's backend answering with ``inference`` (tokens tagged with the engine's version)."""
    backend: MockBackend

    async def handler(request: Any, budget: int) -> OurResponse:
        tokens, logprobs, stop = inference.respond(list(request.input_ids), budget)
        return OurResponse(input_tokens=list(request.input_ids), output_tokens=tokens, output_logprobs=logprobs,
                           output_versions=[backend.version] * len(tokens), stop_reason=stop)  # type: ignore[arg-type]

    backend = MockBackend(handler)
    return backend


def seeded_areal_engine(inference: SeededInference) -> Any:
    """An ``areal.api.engine_api.InferenceEngine`` for AReaL's own ``WorkflowExecutor``,
    answering with ``inference`` as AReaL's remote engine fills a response."""
    from areal.api import ModelResponse
    from areal.api.engine_api import InferenceEngine

    class SeededAReaLEngine(InferenceEngine):
        def __init__(self) -> None:
            self._version = 0

        @property
        def initialized(self) -> bool:
            return True

        def get_version(self) -> int:
            return self._version

        def set_version(self, version: int) -> None:
            self._version = version

        async def agenerate(self, req: Any) -> Any:
            g = req.gconfig
            budget = min(g.max_tokens - len(req.input_ids), g.max_new_tokens)
            tokens, logprobs, stop = inference.respond(list(req.input_ids), budget)
            return ModelResponse(input_tokens=list(req.input_ids), output_tokens=tokens, output_logprobs=logprobs,
                                 output_versions=[self._version] * len(tokens), stop_reason=stop,
                                 tokenizer=req.tokenizer)

    return SeededAReaLEngine()


def areal_executor(config: Any, inference_engine: Any) -> Any:
    """AReaL's own ``WorkflowExecutor`` over ``inference_engine`` (initialized; destroy it)."""
    from areal.infra.workflow_executor import WorkflowExecutor

    executor = WorkflowExecutor(config=config, inference_engine=inference_engine)
    executor.initialize(train_data_parallel_size=1)
    return executor


def grouped(workflow: Any, group_size: int) -> Any:
    """What AReaL's ``RemoteInfEngine._resolve_workflow`` hands its executor for ``group_size``."""
    if group_size == 1:
        return workflow
    from areal.infra.remote_inf_engine import GroupedRolloutWorkflow
    from areal.utils import logging

    return GroupedRolloutWorkflow(workflow, group_size, logging.getLogger("test"))


def _row_key(group: dict[str, Any], row: int) -> tuple:
    return tuple(tuple(group[k][row].flatten().tolist()) for k in sorted(group))


def canonical(groups: list[dict[str, Any]]) -> list[tuple]:
    """Each group as (sorted keys, ((key, dtype, shape) ...), sorted rows' values), the groups
    sorted: equal for two lists iff they hold the same groups with the same keys, dtypes,
    shapes (padding) and values, row order within a group and group order aside."""
    out = []
    for g in groups:
        rows = g["attention_mask"].shape[0]
        layout = tuple((k, str(g[k].dtype), tuple(g[k].shape)) for k in sorted(g))
        out.append((tuple(sorted(g)), layout, tuple(sorted(_row_key(g, r) for r in range(rows)))))
    return sorted(out)


def describe(groups: list[dict[str, Any]]) -> list[dict[str, tuple]]:
    """Keys -> (dtype, shape) of each group, for assertion messages."""
    return [{k: (str(v.dtype), tuple(v.shape)) for k, v in sorted(g.items())} for g in groups]


def prompts(n: int, tag: str = "q") -> list[dict[str, Any]]:
    """``n`` distinct chat items (distinct prompts: a prompt's responses depend on its own count only)."""
    return [{"messages": [{"role": "user", "content": f"{tag} {i}: what is {i} + {i}?"}], "answer": str(2 * i)}
            for i in range(n)]


def tensor_rows(groups: list[dict[str, Any]]) -> int:
    return sum(int(g["attention_mask"].shape[0]) for g in groups)


def assert_areal_shaped(group: dict[str, Any], rows: int) -> None:
    """The layout of AReaL's RLVR/multi-turn trajectories: ``[rows, T]`` tensors and ``rewards [rows]``."""
    T = group["input_ids"].shape[1]
    for key in ("input_ids", "loss_mask", "logprobs", "versions", "attention_mask"):
        assert tuple(group[key].shape) == (rows, T), (key, tuple(group[key].shape))
    assert tuple(group["rewards"].shape) == (rows,)
    assert group["attention_mask"].dtype == torch.bool


def _row(group: dict[str, Any], r: int) -> dict[str, Any]:
    """Row ``r`` of ``group`` without its padding (as one trajectory dict)."""
    n = int(group["attention_mask"][r].sum())
    return {k: (v[r:r + 1, :n] if v.dim() >= 2 else v[r:r + 1]) for k, v in group.items()}


def max_logp_error(actor: Any, groups: list[dict[str, Any]], *, row_by_row: bool = True) -> float:
    """max |engine logprob - AReaL's recomputation| over the generated tokens of ``groups``.

    The recomputation is the actor's own (``FSDPPPOActor.compute_logp``: position t scores
    token t + 1; compared as ``PPOActor`` aligns the behaviour logprobs, ``torch.roll(-1)``).
    AReaL's FSDP engine packs a micro-batch into one sequence, and with ``attn_impl="sdpa"`` on
    CPU (no flash-attention varlen kernel) packed rows attend to each other: so either one row
    at a time, or (``row_by_row=False``) with an ``mb_spec`` that puts one row per micro-batch.
    """
    pieces = ([[_row(g, r)] for g in groups for r in range(g["input_ids"].shape[0])] if row_by_row else [groups])
    worst = 0.0
    for piece in pieces:
        for g, logp in zip(piece, actor.compute_logp(piece)):
            target = torch.roll(g["logprobs"], shifts=-1, dims=-1)
            mask = torch.roll(g["loss_mask"], shifts=-1, dims=-1).bool()
            worst = max(worst, float((logp - target).abs()[mask].max()))
    return worst


#: warnings AReaL 1.0.4 and its stack raise on this box, none of them ours (the suite errors on
#: every warning): each module of the tier sets ``pytestmark = AREAL_WARNINGS``
AREAL_WARNINGS = [
    # torchdata 0.11's StatefulDataLoader calls a torch API deprecated in torch 2.13
    pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning"),
    # FSDP2 on CPU (AReaL's FSDPEngine): torch's own deprecation notices, raised inside torch
    pytest.mark.filterwarnings("ignore:Slicing a flattened dim from root mesh:UserWarning"),
    pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning"),
    # swanlab 0.6.12 (imported by AReaL's stats logger) on Python 3.11
    pytest.mark.filterwarnings("ignore:In 3.13 classes created inside an enum:DeprecationWarning"),
    # torch.compile (AReaL compiles its logprob gather) tracing a tensor that requires grad
    pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf Tensor:UserWarning"),
    # AReaL's fsdp_utils without NVIDIA's optional kernels
    pytest.mark.filterwarnings("ignore:Transformer Engine and Apex are not installed:UserWarning"),
]

"""One generation, segment by segment: the loop behind :meth:`RolloutEngine.agenerate`
(its docstring has the contract).  Each segment waits while the engine is paused, is one
``await backend.generate(request, budget)``, and is checked against the evidence rules;
an aborted segment is resumed with prompt + partial output (AReaL PR #1569).

Under a scheduling policy that shapes segments (``admission.policy.segments``:
:mod:`engine._scheduling`), each segment is planned first (it may wait: a parked member,
a probe's siblings, a dispatch slot), sent with the plan's ``priority`` and token budget,
and reported back; a segment that stops at a budget below what the generation has left
(a chunk) is continued like an aborted one.  Under ``"fcfs"`` none of that runs."""

from __future__ import annotations

from dataclasses import replace
import trio

from ._admission import Admission
from ._ledger import Ledger
from ._records import episode_id, sample_index
from ._schedule_base import SegmentGate, SegmentPlan
from .backends.base import InferenceBackend, validate_response
from .errors import BackendError, InvalidRequestError
from .types import ModelRequest, ModelResponse

__all__ = ["generate"]


async def generate(req: ModelRequest, backend: InferenceBackend, admission: Admission, ledger: Ledger) -> ModelResponse:
    """``req`` on ``backend``, segment by segment; each segment waits while ``admission``
    is paused; ``ledger`` counts the tokens and the resumed segments."""
    if admission.closed:
        if episode_id.get() is not None:  # an episode started as the engine closed: its nursery is
            await trio.lowlevel.checkpoint()  # cancelled, so it ends as "cancelled", not failed
        raise trio.ClosedResourceError("the rollout engine is closed")
    budget = req.validate()
    if req.lora_name is not None and getattr(backend, "lora", None) is None:
        raise InvalidRequestError(f"request {req.rid}: lora_name={req.lora_name!r}, but the {backend.kind} backend "
                                  "serves no LoRA adapter (give it one: HFBackend(..., lora=PATH), "
                                  "make_remote_backend(..., lora=PATH), rollout run --lora PATH)")
    task_id = episode_id.get()
    if task_id is not None and "routing_key" not in req.metadata:  # sticky routing per episode
        req = replace(req, metadata={**req.metadata, "routing_key": f"episode-{task_id}"})
    prompt = list(req.input_ids)
    tokens: list[int] = []
    logprobs: list[float] = []
    versions: list[int] = []
    start = trio.current_time()
    ttft = None
    gate = admission.policy.segments if task_id is not None else None  # None under "fcfs"
    while True:
        plan = None
        if gate is not None:
            assert task_id is not None
            plan = await gate.begin((task_id, sample_index.get()), req, len(tokens), budget - len(tokens))
        segment_req = req if not tokens else replace(
            req, input_ids=prompt + tokens,  # resume: the new segment continues the partial output
            gconfig=req.gconfig.new(min_new_tokens=max(0, req.gconfig.min_new_tokens - len(tokens))))
        if plan is None:
            if not admission.unpaused.is_set():  # (no schedule point when not paused)
                await admission.unpaused.wait()
            resp = await backend.generate(segment_req, budget - len(tokens))
        else:
            assert gate is not None
            resp = await _planned_segment(gate, plan, segment_req, backend, admission)
        validate_response(resp, segment_req)
        if ttft is None:
            ttft = resp.ttft
        tokens += resp.output_tokens
        logprobs += resp.output_logprobs
        versions += resp.output_versions
        ledger.generated_tokens += resp.output_len
        if len(tokens) > resp.output_len:
            ledger.segments_resumed += 1
        if len(tokens) > budget:
            raise BackendError(f"request {req.rid}: backend returned {len(tokens)} tokens for a budget of {budget}")
        stop_reason = resp.stop_reason
        if stop_reason != "abort" and (plan is None or plan.finished(resp)):
            break
        if len(tokens) == budget:
            stop_reason = "length"
            break
    return ModelResponse(
        input_tokens=prompt, output_tokens=tokens, output_logprobs=logprobs, output_versions=versions,
        stop_reason=stop_reason, latency=trio.current_time() - start, ttft=ttft,
        tokenizer=req.tokenizer, processor=req.processor,
    )


async def _planned_segment(gate: SegmentGate, plan: SegmentPlan, req: ModelRequest, backend: InferenceBackend,
                           admission: Admission) -> ModelResponse:
    """One segment as ``plan`` says (its budget and priority), once the engine is not
    paused; reported to ``gate`` exactly once, whatever happens."""
    if req.priority != plan.priority:
        req = replace(req, priority=plan.priority)
    try:
        if not admission.unpaused.is_set():
            await admission.unpaused.wait()
        resp = await backend.generate(req, plan.budget)
    except BaseException:
        gate.end(plan, None)
        raise
    gate.end(plan, resp)
    return resp

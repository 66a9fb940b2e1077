"""AReaL's own workflows, run by AReaL's own executor and by the adapter on the same seeded
responses: the trajectories are equal in keys, dtypes, padding and values.

``areal.workflow.RLVRWorkflow`` and ``MultiTurnWorkflow`` (imported from ``areal``, unchanged)
run once under AReaL 1.0.4's ``WorkflowExecutor`` (over an ``InferenceEngine`` answering from
:class:`SeededInference`; groups through AReaL's ``GroupedRolloutWorkflow``, as its remote
engine does) and once under ``AReaLInferenceEngine`` (over the engine with a backend answering
from another ``SeededInference``).  AReaL's executor shuffles what ``wait`` returns and its
group members are exchangeable, so rows are compared as multisets per group.
"""

from __future__ import annotations

import pytest

pytest.importorskip("areal", reason="needs the areal venv: make test-integrations")

import torch  # noqa: E402
from areal.api.cli_args import GenerationHyperparameters, InferenceEngineConfig  # noqa: E402
from areal.workflow import MultiTurnWorkflow, RLVRWorkflow  # noqa: E402
from areal_doubles import (AREAL_WARNINGS, SeededInference, areal_executor, canonical, describe, grouped, prompts,  # noqa: E402
                           seeded_areal_engine, seeded_backend)
from areal_rewards import parity_reward  # noqa: E402
from torchdata.stateful_dataloader import StatefulDataLoader  # noqa: E402

from engine.integrations.areal import AReaLInferenceEngine  # noqa: E402
from engine.testing import build_tiny_tokenizer  # noqa: E402

torch.set_num_threads(1)

pytestmark = AREAL_WARNINGS


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer()


def _config(**kw):
    base = dict(experiment_name="side-by-side", trial_name="t0", consumer_batch_size=2, max_concurrent_rollouts=8,
                max_head_offpolicyness=int(1e10))
    return InferenceEngineConfig(**{**base, **kw})


def _rlvr(tok):
    return RLVRWorkflow(reward_fn=parity_reward, gconfig=GenerationHyperparameters(max_new_tokens=6), tokenizer=tok)


def _multi_turn(tok):
    return MultiTurnWorkflow(reward_fn=parity_reward, gconfig=GenerationHyperparameters(max_new_tokens=5),
                             tokenizer=tok, max_turns=3, turn_discount=0.5)


def _areal_side(tok, make_workflow, run, **config):
    executor = areal_executor(_config(**config), seeded_areal_engine(SeededInference(tok.eos_token_id)))
    try:
        return run(executor, make_workflow(tok))
    finally:
        executor.destroy()


def _our_side(tok, make_workflow, run, **config):
    adapter = AReaLInferenceEngine(_config(**config), backend=seeded_backend(SeededInference(tok.eos_token_id)))
    adapter.initialize()
    try:
        return run(adapter, make_workflow(tok))
    finally:
        adapter.destroy()


def _assert_same(theirs, ours):
    assert len(theirs) == len(ours)
    assert canonical(theirs) == canonical(ours), (describe(theirs), describe(ours))


@pytest.mark.parametrize("make_workflow", [_rlvr, _multi_turn], ids=["RLVRWorkflow", "MultiTurnWorkflow"])
@pytest.mark.parametrize("group_size", [1, 3])
def test_rollout_batch_equals_areals_executor(tok, make_workflow, group_size):
    items = prompts(4)
    theirs = _areal_side(tok, make_workflow,
                         lambda ex, wf: ex.rollout_batch(items, workflow=grouped(wf, group_size)))
    ours = _our_side(tok, make_workflow, lambda eng, wf: eng.rollout_batch(items, workflow=wf, group_size=group_size))
    _assert_same(theirs, ours)
    lengths = {int(g["attention_mask"].sum(1).max()) for g in ours}
    assert len(lengths) > 1, "the seeded responses must give groups of different widths (padding is compared)"
    if group_size > 1:  # within a group too: some rows are padded
        assert any(not bool(g["attention_mask"].all()) for g in ours)
    keys = {"input_ids", "loss_mask", "logprobs", "versions", "attention_mask", "rewards"}
    assert all(set(g) == keys for g in ours)


def test_submit_wait_equals_areals_executor(tok):
    items = prompts(3, tag="w")

    def run(engine, wf, group_size=2):
        for item in items:
            engine.submit(item, workflow=grouped(wf, group_size)) if not isinstance(engine, AReaLInferenceEngine) \
                else engine.submit(item, workflow=wf, group_size=group_size)
        return [r for r in engine.wait(count=len(items), timeout=60) if r is not None]

    theirs = _areal_side(tok, _multi_turn, run)
    ours = _our_side(tok, _multi_turn, run)
    _assert_same(theirs, ours)


def test_prepare_batch_equals_areals_executor(tok):
    """Two training steps of the asynchronous path (eta=0: each batch is the next B items)."""
    items = prompts(8, tag="p")

    def run(engine, wf):
        loader = StatefulDataLoader(items, batch_size=2, shuffle=False, collate_fn=lambda rows: rows)
        batches = []
        for step in range(2):
            if isinstance(engine, AReaLInferenceEngine):
                batches.append(engine.prepare_batch(loader, workflow=wf, group_size=2))
            else:
                batches.append(engine.prepare_batch(loader, workflow=grouped(wf, 2)))
            engine.inference_engine.set_version(step + 1) if not isinstance(engine, AReaLInferenceEngine) \
                else engine.set_version(step + 1)
        return batches

    theirs = _areal_side(tok, _rlvr, run, max_head_offpolicyness=0)
    ours = _our_side(tok, _rlvr, run, max_head_offpolicyness=0)
    for step, (a, b) in enumerate(zip(theirs, ours)):
        _assert_same(a, b)
        assert {int(v) for g in b for v in g["versions"][g["loss_mask"].bool()]} == {step}

"""verl 0.9.1's own agent loops on the engine: ``TrioAgentLoopManager.generate_sequences``
runs verl's ``AgentLoopWorker`` (in-process), ``SingleTurnAgentLoop`` / ``ToolAgentLoop`` and
verl's post-processing over ``TrioLLMServerClient`` (the tiny random Llama, ``hf`` backend).

Checked field by field: the keys, shapes and dtypes of the ``DataProto``, the padding side
of each tensor, ``rollout_log_probs`` against the actor's teacher-forced recomputation
(within 1e-4), ``response_mask`` 0 on tool tokens, the policy versions after a weight
update, and rows aligned when a backend request or a streaming reward fails once.
"""

from __future__ import annotations

import pytest

pytest.importorskip("verl", reason="needs the verl venv: make test-integrations")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from verl.protocol import DataProto  # noqa: E402
from verl_doubles import (PROMPT_LENGTH, RESPONSE_LENGTH, RewardHandle, generation_batch, load_model,  # noqa: E402
                          messages, perturbed_state, recompute_logprobs)

from engine.integrations.verl import AgentLoopFailedError, TrioAgentLoopManager, TrioLLMServerClient  # noqa: E402

P, R = PROMPT_LENGTH, RESPONSE_LENGTH
TENSOR_FIELDS = {"prompts": (P,), "responses": (R,), "response_mask": (R,), "input_ids": (P + R,),
                 "attention_mask": (P + R,), "position_ids": (P + R,), "rollout_log_probs": (R,)}


def manager_for(config, engine, **kw) -> TrioAgentLoopManager:
    return TrioAgentLoopManager.create(config=config, llm_client=None, teacher_client=None,
                                       reward_loop_worker_handles=kw.pop("reward_loop_worker_handles", None),
                                       engine=engine)


def check_layout(out: DataProto, tok, rows: int) -> None:
    """Shapes, dtypes and padding sides as verl's trainer reads them."""
    assert set(out.batch.keys()) >= set(TENSOR_FIELDS)
    for key, shape in TENSOR_FIELDS.items():
        assert tuple(out.batch[key].shape) == (rows, *shape), key
        want = torch.float32 if key == "rollout_log_probs" else torch.int64
        assert out.batch[key].dtype == want, key
    b = out.batch
    prompt_mask, response_attn = b["attention_mask"][:, :P], b["attention_mask"][:, P:]
    for r in range(rows):
        n_prompt, n_resp = int(prompt_mask[r].sum()), int(response_attn[r].sum())
        assert n_prompt > 0 and n_resp > 0
        # prompts left-padded with the pad id, responses right-padded
        assert prompt_mask[r].tolist() == [0] * (P - n_prompt) + [1] * n_prompt
        assert response_attn[r].tolist() == [1] * n_resp + [0] * (R - n_resp)
        assert (b["prompts"][r, :P - n_prompt] == tok.pad_token_id).all()
        assert (b["responses"][r, n_resp:] == tok.pad_token_id).all()
        assert (b["rollout_log_probs"][r, n_resp:] == 0).all() and (b["response_mask"][r, n_resp:] == 0).all()
        assert torch.equal(b["input_ids"][r], torch.cat([b["prompts"][r], b["responses"][r]]))
        # position ids count the real tokens from 0 (verl's compute_position_id_with_mask)
        assert b["position_ids"][r, P - n_prompt:P + n_resp].tolist() == list(range(n_prompt + n_resp))
    assert "timing" in out.meta_info and "agent_loop/generate_sequences/mean" in out.meta_info["timing"]


def test_single_turn_dataproto_field_by_field(compose_config, engine, tok, tiny):
    config = compose_config()
    manager = manager_for(config, engine)
    assert isinstance(manager.client, TrioLLMServerClient)
    out = manager.generate_sequences(generation_batch(3, n=2, step=0))
    check_layout(out, tok, rows=6)
    b, nt = out.batch, out.non_tensor_batch
    assert torch.equal(b["response_mask"], b["attention_mask"][:, P:])  # single turn: every response token sampled
    # the input columns come through, in order (interleaved repeat: 0,0,1,1,2,2)
    assert nt["index"].tolist() == [0, 0, 1, 1, 2, 2]
    assert [list(p) for p in nt["raw_prompt"]] == [messages(i) for i in (0, 0, 1, 1, 2, 2)]
    assert nt["__num_turns__"].tolist() == [2] * 6 and nt["agent_name"].tolist() == ["single_turn_agent"] * 6
    assert nt["min_global_steps"].tolist() == [0] * 6 and nt["max_global_steps"].tolist() == [0] * 6
    for r in range(6):  # the prompt is the chat template of the row's own messages
        n_prompt = int(b["attention_mask"][r, :P].sum())
        want = tok.apply_chat_template(messages(int(nt["index"][r])), add_generation_prompt=True, tokenize=True)
        want = want["input_ids"] if hasattr(want, "keys") else want
        assert b["prompts"][r, P - n_prompt:].tolist() == list(want)
    # rollout_log_probs == the actor's teacher-forced recomputation on the sampled tokens
    mask = b["response_mask"].bool()
    diff = (recompute_logprobs(load_model(tiny), out) - b["rollout_log_probs"]).abs()[mask]
    assert float(diff.max()) < 1e-4, float(diff.max())


def test_temperature_and_validation_greedy(compose_config, engine, tiny):
    config = compose_config("actor_rollout_ref.rollout.temperature=0.7")
    out = manager_for(config, engine).generate_sequences(generation_batch(2, n=2))
    mask = out.batch["response_mask"].bool()
    diff = (recompute_logprobs(load_model(tiny), out, temperature=0.7) - out.batch["rollout_log_probs"]).abs()[mask]
    assert float(diff.max()) < 1e-4, float(diff.max())
    # validate=True: verl sends val_kwargs (temperature 0 = greedy): the copies of a prompt agree
    config = compose_config("actor_rollout_ref.rollout.val_kwargs.temperature=0", "actor_rollout_ref.rollout.val_kwargs.do_sample=False")
    val = manager_for(config, engine).generate_sequences(generation_batch(2, n=2, validate=True))
    r = val.batch["responses"]
    assert torch.equal(r[0], r[1]) and torch.equal(r[2], r[3])


def test_no_logprobs_unless_asked(compose_config, engine):
    config = compose_config("actor_rollout_ref.rollout.calculate_log_probs=False")
    out = manager_for(config, engine).generate_sequences(generation_batch(1, n=2))
    assert "rollout_log_probs" not in out.batch.keys()  # verl sends logprobs=False; vLLM returns None then


def test_tool_agent_loop_masks_tool_tokens(compose_config, engine, tok, tiny, tmp_path):
    tools = tmp_path / "tools.py"
    tools.write_text(
        "from verl.tools.function_tool import function_tool\n\n"
        "@function_tool\n"
        "def lookup(key: str) -> str:\n"
        '    """Look a key up.\n\n    Args:\n        key: the key.\n    """\n'
        "    return f'value of {key}'\n")
    config = compose_config("actor_rollout_ref.rollout.response_length=40", "actor_rollout_ref.rollout.prompt_length=48",
                            "actor_rollout_ref.rollout.multi_turn.format=trio_test_first_turn",
                            "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=2",
                            f"actor_rollout_ref.rollout.multi_turn.function_tool_path={tools}")
    manager = manager_for(config, engine)
    batch = generation_batch(2, n=2)
    batch.non_tensor_batch["agent_name"] = np.array(["tool_agent"] * len(batch), dtype=object)
    out = manager.generate_sequences(batch)
    b, nt = out.batch, out.non_tensor_batch
    assert tuple(b["responses"].shape) == (4, 40) and b["rollout_log_probs"].dtype == torch.float32
    assert nt["__num_turns__"].tolist() == [4] * 4  # user, assistant (tool call), tool, assistant
    for r in range(4):
        n_resp = int(b["attention_mask"][r, P:].sum())
        mask = b["response_mask"][r, :n_resp].tolist()
        # model turn (1s), the tool message as the chat template renders it (0s), model turn (1s), padding
        first_zero = mask.index(0)
        second_turn = first_zero + mask[first_zero:].index(1)
        assert 0 < first_zero < second_turn < n_resp and all(mask[second_turn:])
        assert (b["response_mask"][r, n_resp:] == 0).all()
        tool_text = tok.decode(b["responses"][r, first_zero:second_turn])
        first_token = int(b["responses"][r, 0])  # the test parser calls lookup(key=<first token>)
        assert f"<|im_start|>tool\nvalue of {first_token}<|im_end|>" in tool_text, tool_text
        assert (b["rollout_log_probs"][r, first_zero:second_turn] == 0).all()  # tool tokens: no logprob
    sampled = b["response_mask"].bool()
    diff = (recompute_logprobs(load_model(tiny), out) - b["rollout_log_probs"]).abs()[sampled]
    assert float(diff.max()) < 1e-4, float(diff.max())  # both model turns, the second after the tool's tokens


def test_token_versions_follow_a_weight_update(compose_config, engine, tiny, fresh_weights):
    manager = manager_for(compose_config(), engine)
    updated = perturbed_state(load_model(tiny))
    engine.update_weights(updated, version=3)
    out = manager.generate_sequences(generation_batch(2, n=2, step=3))
    nt = out.non_tensor_batch
    assert nt["min_global_steps"].tolist() == [3] * 4 and nt["max_global_steps"].tolist() == [3] * 4
    mask = out.batch["response_mask"].bool()
    diff = (recompute_logprobs(load_model(tiny, updated), out) - out.batch["rollout_log_probs"]).abs()[mask]
    assert float(diff.max()) < 1e-4, float(diff.max())  # sampled by the updated weights
    stale = (recompute_logprobs(load_model(tiny), out) - out.batch["rollout_log_probs"]).abs()[mask]
    assert float(stale.max()) > 1e-2  # and the old ones would not have given these logprobs


def test_rows_in_flight_are_not_capped_by_a_thread_pool(compose_config, engine, backend):
    """All 40 rows' requests are in the engine at once (the backend holds each until 40 are
    there): a bridge through ``run_in_executor`` (6 threads here: min(32, cpus + 4)) would
    stop at 6 and time out."""
    manager = manager_for(compose_config(), engine)
    backend.close_gate(40)
    try:
        out = manager.generate_sequences(generation_batch(20, n=2))
    finally:
        backend.gate = 0
    assert backend.peak == 40 and len(out) == 40 and manager.reruns == 0


def test_rows_stay_aligned_when_a_backend_request_fails_once(compose_config, engine, backend):
    manager = manager_for(compose_config(), engine)
    backend.fail = 1
    out = manager.generate_sequences(generation_batch(4, n=2))
    assert backend.fail == 0 and manager.reruns == 1
    assert len(out) == 8 and out.non_tensor_batch["index"].tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
    assert [list(p) for p in out.non_tensor_batch["raw_prompt"]] == [messages(i) for i in (0, 0, 1, 1, 2, 2, 3, 3)]


def test_rows_stay_aligned_when_a_streaming_reward_fails_once(compose_config, engine):
    handle = RewardHandle(fail_on=2.0)
    manager = manager_for(compose_config(), engine, reward_loop_worker_handles=[handle])
    out = manager.generate_sequences(generation_batch(4, n=2, ground_truth=[0.0, 1.0, 2.0, 3.0]))
    assert manager.reruns == 1 and handle.calls == 9
    b = out.batch
    last = b["attention_mask"][:, P:].sum(dim=1) - 1  # verl puts the score on the last response token
    scores = b["rm_scores"][torch.arange(8), last].tolist()
    assert scores == [0.0, 0.0, 1.0, 1.0, 2.0, 2.0, 3.0, 3.0]  # each row scored on its own ground truth
    assert out.non_tensor_batch["acc"].tolist() == scores


def test_a_row_that_keeps_failing_is_named(compose_config, engine, backend):
    config = compose_config("+actor_rollout_ref.rollout.custom.trio_rollout.max_attempts=2")
    manager = manager_for(config, engine)
    backend.fail = 2
    try:
        with pytest.raises(AgentLoopFailedError, match=r"row with index 0 \(rollout 0.*failed 2 time\(s\).*BackendError"):
            manager.generate_sequences(generation_batch(1, n=1))
    finally:
        backend.fail = 0

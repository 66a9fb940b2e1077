"""Contract tier: MultiTurnWorkflow is token-exact on the sim backend and on a tiny
hf model; the trajectory is compared with the backend's own record of requests.

Every test here runs the reward in-process (``InProcessRewardPool``) or through a
pool stand-in that also drives the engine between turns (a weight update), so
the turn boundaries are deterministic."""

from __future__ import annotations

import pytest
import torch

from engine import (
    EngineConfig,
    GenerationHyperparameters,
    HFBackend,
    MockBackend,
    ModelResponse,
    SimBackend,
    SimConfig,
    open_rollout_engine,
)
from engine.chat import TokenConversation, collect_drift_events, decode_text, message_delta
from engine.testing import TINY_EOS_ID, InProcessRewardPool, build_tiny_model, build_tiny_tokenizer
from workflows.multi_turn import MultiTurnWorkflow

FEEDBACK = "Wrong, try again."
QUESTION = {"messages": [{"role": "user", "content": "What is 2+3?"}]}


def zero_reward(prompt, completions, prompt_ids, completion_ids, **data) -> float:
    return 0.0


def right_after_one_retry(prompt, completions, prompt_ids, completion_ids, **data) -> float:
    """1.0 once the prompt holds one feedback message (the second turn), else 0.0."""
    return 1.0 if prompt.count(FEEDBACK) >= 1 else 0.0


class RecordingSim(SimBackend):
    """The sim, keeping ``(input_ids, response)`` of every request it served."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.log: list[tuple[list[int], ModelResponse]] = []

    async def generate(self, request, budget):
        resp = await super().generate(request, budget)
        self.log.append((list(request.input_ids), resp))
        return resp


class RecordingHF(HFBackend):
    """The hf backend, keeping ``(input_ids, (tokens, logprobs, stop_reason))`` per request."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.log: list[tuple[list[int], tuple]] = []

    async def generate(self, request, budget):
        resp = await super().generate(request, budget)
        self.log.append((list(request.input_ids), (resp.output_tokens, resp.output_logprobs, resp.stop_reason)))
        return resp


class VersionBumpingPool(InProcessRewardPool):
    """Scores in-process, then moves the engine to the next policy version (what a
    trainer's weight update between two turns looks like to the episode)."""

    def __init__(self, update=None):
        super().__init__()
        self.engine = None
        self.update = update  # async (engine, version) -> None; default engine.set_version

    async def score(self, *args, **kwargs):
        outcome = await super().score(*args, **kwargs)
        version = self.engine.version + 1
        if self.update is None:
            self.engine.set_version(version)
        else:
            await self.update(self.engine, version)
        return outcome


def check_against_record(traj, row, record, tok, *, turns):
    """The trajectory row is exactly the last request + its output; each request
    extends the previous one + its output; per-token fields are as specified;
    the injected ids between turns decode to template glue + the feedback turn."""
    real = traj["attention_mask"][row]
    ids = traj["input_ids"][row][real].tolist()
    assert len(record) == turns
    last_input, last_out = record[-1][0], record[-1][1]
    assert ids == last_input + last_out["tokens"]
    expect_mask, expect_turn, expect_lp, expect_ver = [], [], [], []
    pos = 0
    for t, (inp, out) in enumerate(record):
        assert ids[:len(inp)] == inp  # the request is a prefix of the final sequence
        injected = len(inp) - pos
        if t > 0:  # the delta between turns: end-of-turn (cut turns only), glue, feedback, generation prompt
            delta = decode_text(tok, ids[pos:len(inp)])
            prev = record[t - 1][1]
            closes = "" if prev["stop"] == "stop" else "<|im_end|>"
            assert delta == f"{closes}\n<|im_start|>user\n{FEEDBACK}<|im_end|>\n<|im_start|>assistant\n"
        expect_mask += [0] * injected + [1] * len(out["tokens"])
        expect_turn += [-1] * injected + [t] * len(out["tokens"])
        expect_lp += [0.0] * injected + out["logprobs"]
        expect_ver += [-1] * injected + out["versions"]
        assert ids[len(inp):len(inp) + len(out["tokens"])] == out["tokens"]
        pos = len(inp) + len(out["tokens"])
    assert traj["loss_mask"][row][real].tolist() == expect_mask
    assert traj["turn_ids"][row][real].tolist() == expect_turn
    assert traj["versions"][row][real].tolist() == expect_ver
    assert torch.equal(traj["logprobs"][row][real], torch.tensor(expect_lp, dtype=torch.float32))
    assert traj["num_turns"][row].item() == turns
    assert traj["is_truncated"][row].item() == (record[-1][1]["stop"] == "length")


def _sim_record(log):
    return [(inp, {"tokens": r.output_tokens, "logprobs": r.output_logprobs, "versions": r.output_versions,
                   "stop": r.stop_reason}) for inp, r in log]


async def test_three_turns_on_sim_are_exactly_what_the_backend_received_and_sampled():
    tok = build_tiny_tokenizer()
    # ids from 5 on are bytes (no special token inside a turn); lengths vary so that
    # some turns stop on EOS and others are cut by the budget
    sim = RecordingSim(SimConfig(vocab_size=len(tok), eos_token_id=TINY_EOS_ID, first_token_id=5,
                                 out_len_median=6, out_len_sigma=0.6, seed=3))
    wf = MultiTurnWorkflow(zero_reward, GenerationHyperparameters(max_new_tokens=8), tok, max_turns=3,
                           turn_discount=0.5, feedback=FEEDBACK)
    async with open_rollout_engine(sim, reward_pool=InProcessRewardPool()) as engine:
        traj = await wf.arun_episode(engine, QUESTION)
        stats = engine.statistics()
    record = _sim_record(sim.log)
    check_against_record(traj, 0, record, tok, turns=3)
    assert {out["stop"] for _, out in record} == {"stop", "length"}  # both kinds of turn end were exercised
    assert traj["rewards"].tolist() == [0.0] and traj["retokenization_drift"].tolist() == [False]
    assert stats.retokenization_drifts == 0


async def test_n_samples_run_as_rows_each_token_exact():
    tok = build_tiny_tokenizer()
    sim = RecordingSim(SimConfig(vocab_size=len(tok), eos_token_id=TINY_EOS_ID, first_token_id=5,
                                 out_len_median=6, out_len_sigma=0.6, seed=5))
    wf = MultiTurnWorkflow(zero_reward, GenerationHyperparameters(n_samples=3, max_new_tokens=8), tok,
                           max_turns=2, feedback=FEEDBACK)
    async with open_rollout_engine(sim, reward_pool=InProcessRewardPool()) as engine:
        traj = await wf.arun_episode(engine, QUESTION)
    assert traj.batch_size == torch.Size([3])
    record = _sim_record(sim.log)
    for row in range(3):  # a row's requests: the chain that ends in its sequence
        real = traj["attention_mask"][row]
        ids = traj["input_ids"][row][real].tolist()
        mine = [(inp, out) for inp, out in record if ids[:len(inp) + len(out["tokens"])] == inp + out["tokens"]]
        check_against_record(traj, row, mine, tok, turns=2)
        assert (traj["versions"][row][~real] == -1).all() and (traj["turn_ids"][row][~real] == -1).all()


async def test_reward_is_discounted_per_extra_turn_and_a_right_answer_stops_early():
    tok = build_tiny_tokenizer()
    sim = SimBackend(SimConfig(vocab_size=len(tok), eos_token_id=TINY_EOS_ID, first_token_id=5, out_len_median=4))
    wf = MultiTurnWorkflow(right_after_one_retry, GenerationHyperparameters(max_new_tokens=8), tok, max_turns=4,
                           turn_discount=0.5, feedback=FEEDBACK)
    async with open_rollout_engine(sim, reward_pool=InProcessRewardPool()) as engine:
        traj = await wf.arun_episode(engine, QUESTION)
    assert traj["num_turns"].tolist() == [2]
    assert traj["rewards"].tolist() == [0.5]  # 1.0 * turn_discount ** 1
    assert set(traj["turn_ids"][0].tolist()) == {-1, 0, 1}


async def test_no_budget_left_ends_the_episode_instead_of_failing_it():
    tok = build_tiny_tokenizer()
    prompt_len = len(TokenConversation(tok, QUESTION["messages"]).ids)
    sim = SimBackend(SimConfig(vocab_size=len(tok), eos_token_id=TINY_EOS_ID, first_token_id=5, out_len_median=4))
    # the feedback delta is ~38 tokens: room for the first turn and one more, not for a third
    g = GenerationHyperparameters(max_new_tokens=4, max_tokens=prompt_len + 64)
    wf = MultiTurnWorkflow(zero_reward, g, tok, max_turns=5, feedback=FEEDBACK)
    async with open_rollout_engine(sim, reward_pool=InProcessRewardPool()) as engine:
        traj = await wf.arun_episode(engine, QUESTION)
    assert traj["num_turns"].tolist() == [2]
    assert traj["attention_mask"].sum().item() <= g.max_tokens


async def test_a_version_change_between_turns_shows_in_versions():
    tok = build_tiny_tokenizer()
    sim = RecordingSim(SimConfig(vocab_size=len(tok), eos_token_id=TINY_EOS_ID, first_token_id=5, out_len_median=4))
    pool = VersionBumpingPool()
    wf = MultiTurnWorkflow(zero_reward, GenerationHyperparameters(max_new_tokens=8), tok, max_turns=3,
                           feedback=FEEDBACK)
    async with open_rollout_engine(sim, reward_pool=pool) as engine:
        pool.engine = engine
        traj = await wf.arun_episode(engine, QUESTION)
    gen = traj["loss_mask"][0].bool()
    by_turn = {t: set(traj["versions"][0][gen & (traj["turn_ids"][0] == t)].tolist()) for t in range(3)}
    assert by_turn == {0: {0}, 1: {1}, 2: {2}}
    assert (traj["versions"][0][~gen] == -1).all()
    check_against_record(traj, 0, _sim_record(sim.log), tok, turns=3)


# A template that rewrites every assistant turn but the last: the history the
# model saw is no longer what the template renders.
REWRITING_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['role'] == 'assistant' and not loop.last %}[earlier answer removed]{% else %}{{ m['content'] }}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


async def test_a_template_that_rewrites_earlier_turns_is_reported_as_drift():
    tok = build_tiny_tokenizer()
    tok.chat_template = REWRITING_TEMPLATE
    sim = RecordingSim(SimConfig(vocab_size=len(tok), eos_token_id=TINY_EOS_ID, first_token_id=5,
                                 out_len_median=6, out_len_sigma=0.6, seed=3))
    wf = MultiTurnWorkflow(zero_reward, GenerationHyperparameters(max_new_tokens=8), tok, max_turns=3,
                           feedback=FEEDBACK)
    async with open_rollout_engine(sim, EngineConfig(), reward_pool=InProcessRewardPool()) as engine:
        result = await engine.wait_for_task(engine.submit(QUESTION, wf))
        stats = engine.statistics()
    assert result.status == "accepted"
    traj = result.trajectory
    assert traj["retokenization_drift"].tolist() == [True]
    assert stats.retokenization_drifts == 2  # before turn 1 and before turn 2
    # the ids stay exact: what the model saw, not the template's rewrite
    check_against_record(traj, 0, _sim_record(sim.log), tok, turns=3)


def test_message_delta_reports_drift_and_keeps_going():
    tok = build_tiny_tokenizer()
    tok.chat_template = REWRITING_TEMPLATE
    conv = TokenConversation(tok, QUESTION["messages"])
    answer = tok.encode("five", add_special_tokens=False) + [TINY_EOS_ID]
    conv.add_response(ModelResponse(input_tokens=list(conv.ids), output_tokens=answer,
                                    output_logprobs=[-1.0] * len(answer), output_versions=[0] * len(answer)))
    sent = list(conv.ids)
    with collect_drift_events() as outer, collect_drift_events() as inner:
        delta = conv.append([{"role": "user", "content": FEEDBACK}])
    assert delta.drift and len(outer) == len(inner) == 1 and "five" in delta.detail
    assert conv.ids == sent + delta.ids
    assert decode_text(tok, delta.ids) == f"\n<|im_start|>user\n{FEEDBACK}<|im_end|>\n<|im_start|>assistant\n"
    # the same conversation under a template that renders it faithfully: no drift
    tok2 = build_tiny_tokenizer()
    exact = message_delta(tok2, sent, conv.messages[:-1], [{"role": "user", "content": FEEDBACK}])
    assert not exact.drift and exact.ids == delta.ids


def test_a_cut_turn_gets_the_end_of_turn_token_and_a_stopped_one_does_not():
    tok = build_tiny_tokenizer()
    for stop, output in (("length", tok.encode("fiv", add_special_tokens=False)),
                         ("stop", tok.encode("five", add_special_tokens=False) + [TINY_EOS_ID])):
        conv = TokenConversation(tok, QUESTION["messages"])
        conv.add_response(ModelResponse(input_tokens=list(conv.ids), output_tokens=output, stop_reason=stop,
                                        output_logprobs=[-1.0] * len(output), output_versions=[0] * len(output)))
        delta = conv.append([{"role": "user", "content": FEEDBACK}])
        assert delta.added_end_of_turn == (stop == "length") and not delta.drift
        assert (delta.ids[0] == TINY_EOS_ID) == (stop == "length")
    with pytest.raises(ValueError, match="input_tokens"):
        conv.add_response(ModelResponse(input_tokens=[1, 2], output_tokens=[]))


async def test_mock_backend_turns_cut_then_stopped():
    """Exact control of the turn ends: turn 0 is cut by the budget, turn 1 stops on EOS."""
    tok = build_tiny_tokenizer()
    outputs = [tok.encode("abcd", add_special_tokens=False), tok.encode("xy", add_special_tokens=False) + [4]]
    log = []

    async def handler(req, budget):
        out = outputs[len(log)]
        log.append((list(req.input_ids), out))
        return ModelResponse(input_tokens=list(req.input_ids), output_tokens=out, output_logprobs=[-0.5] * len(out),
                             output_versions=[7] * len(out), stop_reason="length" if len(log) == 1 else "stop")

    wf = MultiTurnWorkflow(zero_reward, GenerationHyperparameters(max_new_tokens=4), tok, max_turns=2,
                           feedback=FEEDBACK)
    async with open_rollout_engine(MockBackend(handler), reward_pool=InProcessRewardPool()) as engine:
        traj = await wf.arun_episode(engine, QUESTION)
    ids = traj["input_ids"][0].tolist()
    first_in, first_out = log[0]
    eot_at = len(first_in) + len(first_out)
    assert ids[eot_at] == TINY_EOS_ID and traj["loss_mask"][0, eot_at] == 0 and traj["versions"][0, eot_at] == -1
    assert ids == log[1][0] + log[1][1]
    assert traj["loss_mask"][0].sum().item() == 4 + 3
    assert traj["is_truncated"].tolist() == [False]


# -- the tiny hf model ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny-mt"), seed=0)


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return (AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval(),
            AutoTokenizer.from_pretrained(tiny_dir))


def _hf_record(log, versions_by_turn):
    return [(inp, {"tokens": row[0], "logprobs": row[1], "versions": [versions_by_turn[t]] * len(row[0]),
                   "stop": row[2]}) for t, (inp, row) in enumerate(log)]


def _teacher_forced(model, ids, positions):
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0].float(), -1)  # [T, V]
    pos = torch.tensor(positions)
    return logp[pos - 1, torch.tensor(ids)[pos]]


@pytest.mark.slow
async def test_three_turns_on_the_tiny_model_reproduce_teacher_forced_logprobs(tiny):
    model, tok = tiny
    backend = RecordingHF(model, tok, batch_window_s=0)
    # temperature 1, no top-k/top-p: the backend's logprobs are the model's own;
    # seed 0 gives a turn cut by the budget between turns stopped on EOS (CPU, this torch; per-turn seeds)
    g = GenerationHyperparameters(max_new_tokens=10, seed=0)
    wf = MultiTurnWorkflow(zero_reward, g, tok, max_turns=3, feedback=FEEDBACK)
    async with open_rollout_engine(backend, reward_pool=InProcessRewardPool()) as engine:
        traj = await wf.arun_episode(engine, QUESTION)
        stats = engine.statistics()
    record = _hf_record(backend.log, [0, 0, 0])
    check_against_record(traj, 0, record, tok, turns=3)
    assert {out["stop"] for _, out in record} == {"stop", "length"}
    assert stats.retokenization_drifts == 0 and traj["retokenization_drift"].tolist() == [False]
    ids = traj["input_ids"][0].tolist()
    gen = torch.nonzero(traj["loss_mask"][0]).squeeze(1).tolist()
    ref = _teacher_forced(model, ids, gen)
    assert (ref - traj["logprobs"][0, gen]).abs().max().item() < 1e-4


@pytest.mark.slow
async def test_a_weight_update_between_turns_on_the_tiny_model(tiny, tiny_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    model, tok = tiny
    model_a = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()
    other_dir = build_tiny_model(tmp_path / "other", seed=1)
    model_b = AutoModelForCausalLM.from_pretrained(other_dir, dtype=torch.float32).eval()
    served = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()  # gets B's weights
    backend = RecordingHF(served, tok, batch_window_s=0)

    async def update(engine, version):
        if version == 1:
            await engine.update_weights(model_b.state_dict(), version=1)
        else:
            engine.set_version(version)

    pool = VersionBumpingPool(update)
    wf = MultiTurnWorkflow(zero_reward, GenerationHyperparameters(max_new_tokens=6, seed=1), tok, max_turns=2,
                           feedback=FEEDBACK)
    async with open_rollout_engine(backend, reward_pool=pool) as engine:
        pool.engine = engine
        traj = await wf.arun_episode(engine, QUESTION)
    check_against_record(traj, 0, _hf_record(backend.log, [0, 1]), tok, turns=2)
    ids = traj["input_ids"][0].tolist()
    turn = traj["turn_ids"][0]
    for t, reference in ((0, model_a), (1, model_b)):  # each turn's logprobs come from its own weights
        pos = torch.nonzero(turn == t).squeeze(1).tolist()
        assert set(traj["versions"][0, pos].tolist()) == {t}
        ref = _teacher_forced(reference, ids, pos)
        assert (ref - traj["logprobs"][0, pos]).abs().max().item() < 1e-4


async def test_seeded_samples_of_one_prompt_differ_and_repeat_across_runs():
    """Regression (new-user trial): with a run seed every sample of a prompt shared one
    seed, so a GRPO group had identical rows and zero advantage."""
    tok = build_tiny_tokenizer()

    async def run():
        sim = SimBackend(SimConfig(vocab_size=len(tok), eos_token_id=TINY_EOS_ID, first_token_id=5,
                                   out_len_median=6, out_len_sigma=0.6, seed=5))
        wf = MultiTurnWorkflow(zero_reward, GenerationHyperparameters(n_samples=4, max_new_tokens=8, seed=3), tok,
                               max_turns=2, feedback=FEEDBACK)
        async with open_rollout_engine(sim, reward_pool=InProcessRewardPool()) as engine:
            return (await engine.wait_for_task(engine.submit(QUESTION, wf, task_id=7))).trajectory

    a, b = await run(), await run()
    rows = {tuple(a["input_ids"][i][a["attention_mask"][i]].tolist()) for i in range(4)}
    assert len(rows) == 4  # the samples differ
    assert torch.equal(a["input_ids"], b["input_ids"])  # and a seeded run repeats

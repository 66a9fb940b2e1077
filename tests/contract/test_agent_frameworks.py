"""Contract tier: agent frameworks through the engine's OpenAI-compatible proxy (the
``agents`` test extra: openai-agents, langgraph, langchain-openai, pinned in pyproject).

The GSM8K agent of :mod:`workflows.agents_sdk_math` (the OpenAI Agents SDK, its default
``OpenAIResponsesModel``: ``Runner.run`` and ``Runner.run_streamed``) and of
:mod:`workflows.langgraph_math` (LangGraph's ``create_react_agent`` over ``ChatOpenAI``,
``astream(stream_mode="messages")``, chat completions and the Responses API), run by the
engine in its one asyncio loop (engine.aio.run_asyncio) against the engine's shared proxy
(engine.openai.open_agent_session: a real HTTP server on 127.0.0.1).  In each: the rows
equal what the backend received and sampled, ``loss_mask`` is 1 exactly on sampled tokens,
0 drift events, the reward as scored, every session ended exactly once.  Tracing of both
frameworks is off (RunConfig(tracing_disabled=True); no LangSmith environment).  Real
sockets and a real thread: the real clock, no autojump."""

from __future__ import annotations

import logging
import threading

import pytest
import torch
import trio

from engine import BackendError, EngineConfig, GenerationHyperparameters, HFBackend, open_rollout_engine
from engine.openai.agent_session import shared_proxy
from engine.testing import InProcessRewardPool, build_tiny_model, build_tiny_tokenizer
from openai_fixtures import ScriptedBackend, tool_call_text
from workflows.agents_sdk_math import AgentsSDKMathWorkflow
from workflows.langgraph_math import LangGraphMathWorkflow

ITEM = {"question": "What is 2+3?", "answer": "#### 5"}
SCRIPT = [tool_call_text("calculator", {"expression": "2+3"}), "The calculator says 5.\n#### 5"]
BOUND_S = 120.0


@pytest.fixture(autouse=True)
def _no_telemetry(monkeypatch):
    for name in ("LANGSMITH_TRACING", "LANGCHAIN_TRACING_V2", "LANGSMITH_API_KEY", "LANGCHAIN_API_KEY",
                 "OPENAI_API_KEY", "OPENAI_AGENTS_DISABLE_TRACING"):
        monkeypatch.delenv(name, raising=False)


def _agent(cls, tok, **kwargs):
    return cls("rewards.gsm8k:gsm8k_reward", GenerationHyperparameters(max_new_tokens=128), tok, **kwargs)


async def _run_one(workflow, backend):
    with trio.fail_after(BOUND_S):
        async with open_rollout_engine(backend, reward_pool=InProcessRewardPool()) as engine:
            result = await engine.wait_for_task(engine.submit(dict(ITEM), workflow))
            proxy = await shared_proxy(engine)  # opened by the episode
            stats, pstats = engine.statistics(), proxy.statistics()
    return result, stats, pstats


def _assert_one_exact_conversation(result, stats, pstats, log, turns):
    assert result.status == "accepted", (result.reason, result.error_message)
    assert len(log) == turns and stats.retokenization_drifts == 0
    for (a, out_a), (b, _) in zip(log, log[1:]):  # each call extends the previous one token-exactly
        assert b[:len(a) + out_a.output_len] == a + out_a.output_tokens
    traj = result.trajectory  # concat: one row, the whole conversation
    last_in, last_out = log[-1]
    real = traj["attention_mask"][0]
    assert traj.batch_size == torch.Size([1]) and traj["num_turns"].tolist() == [turns]
    assert traj["input_ids"][0][real].tolist() == last_in + last_out.output_tokens
    mask, lps = traj["loss_mask"][0][real].tolist(), traj["logprobs"][0][real]
    assert sum(mask) == sum(out.output_len for _, out in log)
    for inp, out in log:
        assert mask[len(inp):len(inp) + out.output_len] == [1] * out.output_len
        assert torch.equal(lps[len(inp):len(inp) + out.output_len], torch.tensor(out.output_logprobs))
    assert traj["rewards"].tolist() == [1.0] and not traj["is_truncated"].any()
    assert (pstats.started, pstats.ended, pstats.abandoned, pstats.active) == (1, 1, 0, 0)
    assert pstats.requests == turns and pstats.request_errors == 0


@pytest.mark.parametrize("streamed", [False, True], ids=["Runner.run", "Runner.run_streamed"])
async def test_the_agents_sdk_default_responses_model_with_a_tool_is_token_exact(streamed):
    tok = build_tiny_tokenizer()
    backend = ScriptedBackend(tok, SCRIPT)
    result, stats, pstats = await _run_one(_agent(AgentsSDKMathWorkflow, tok, streamed=streamed), backend)
    _assert_one_exact_conversation(result, stats, pstats, backend.log, turns=2)
    text = tok.decode(backend.log[1][0])
    assert "<|im_start|>tool\n5<|im_end|>" in text  # the SDK ran the calculator; its output went back


@pytest.mark.parametrize("responses", [False, True], ids=["chat", "responses"])
async def test_a_langgraph_react_agent_streaming_messages_is_token_exact(responses):
    tok = build_tiny_tokenizer()
    backend = ScriptedBackend(tok, SCRIPT)
    result, stats, pstats = await _run_one(_agent(LangGraphMathWorkflow, tok, use_responses_api=responses), backend)
    _assert_one_exact_conversation(result, stats, pstats, backend.log, turns=2)
    assert "<|im_start|>tool\n5<|im_end|>" in tok.decode(backend.log[1][0])


@pytest.mark.parametrize("streamed", [False, True], ids=["Runner.run", "Runner.run_streamed"])
async def test_an_agent_cut_by_the_token_budget_keeps_its_interactions_and_says_budget(streamed, caplog):
    """Regression (new-user trial): the SDK logged a bare "Error getting response" (its own
    logger, at ERROR) for the turn our budget cut; the cut is ours to name, at debug level."""
    caplog.set_level(logging.DEBUG, logger="rollout.workflows.agents_sdk_math")
    sdk_filters = list(logging.getLogger("openai.agents").filters)
    tok = build_tiny_tokenizer()
    backend = ScriptedBackend(tok, ["x" * 200])  # longer than max_new_tokens: the SDK sees an incomplete response
    result, stats, pstats = await _run_one(_agent(AgentsSDKMathWorkflow, tok, streamed=streamed), backend)
    assert result.status == "accepted" and result.trajectory["is_truncated"].tolist() == [True]
    assert result.trajectory["rewards"].tolist() == [0.0] and (pstats.ended, pstats.abandoned) == (1, 0)
    sdk = [r for r in caplog.records if r.name.startswith("openai.agents") and r.levelno >= logging.WARNING]
    assert sdk == [], [r.getMessage() for r in sdk]
    ours = [r.getMessage() for r in caplog.records if r.name == "rollout.workflows.agents_sdk_math"]
    assert any("token budget" in m and "'length'" in m for m in ours), ours
    assert logging.getLogger("openai.agents").filters == sdk_filters  # nothing left installed


async def test_a_real_model_error_is_still_the_sdks_to_log(caplog):
    class Failing(ScriptedBackend):
        async def generate(self, request, budget):
            raise BackendError("injected: the server went away")

    tok = build_tiny_tokenizer()
    result, _, _ = await _run_one(_agent(AgentsSDKMathWorkflow, tok), Failing(tok))
    assert result.status == "failed"
    assert any(r.name == "openai.agents" and r.levelno == logging.ERROR for r in caplog.records)


@pytest.mark.parametrize("streamed", [False, True], ids=["Runner.run", "Runner.run_streamed"])
async def test_an_episode_timeout_while_the_agent_starts_leaves_no_coroutine_unawaited(streamed):
    """Regression (new-user trial: "RuntimeWarning: coroutine 'run_single_turn' was never
    awaited" after an episode timeout; every warning fails a test).  The agent's first step (the
    SDK's first import took ~1.5 s) runs until the episode's cancel has reached the asyncio loop;
    the SDK then creates its turn's task (a wrapper of run_single_turn) and awaits it."""
    from engine.aio import LOOP_KEY, open_asyncio_loop

    entered, cancel_sent = threading.Event(), threading.Event()

    class SlowStart(AgentsSDKMathWorkflow):
        async def run_agent(self, *args):
            entered.set()
            cancel_sent.wait(BOUND_S)  # a long first step: the cancel arrives meanwhile
            return await super().run_agent(*args)

    tok = build_tiny_tokenizer()
    with trio.fail_after(BOUND_S):
        async with open_rollout_engine(ScriptedBackend(tok, SCRIPT), EngineConfig(episode_timeout_s=0.5),
                                       reward_pool=InProcessRewardPool()) as engine:
            await shared_proxy(engine)  # opened before: the timeout falls inside the agent's first step
            loop = await engine.shared_resource(LOOP_KEY, open_asyncio_loop)
            send = loop._loop.call_soon_threadsafe

            def spy(fn, *args):  # how the episode's cancel reaches the loop (engine.aio.AsyncioLoop.run)
                handle = send(fn, *args)
                if fn.__name__ == "cancel":
                    cancel_sent.set()
                return handle

            loop._loop.call_soon_threadsafe = spy
            task_id = engine.submit(dict(ITEM), _agent(SlowStart, tok, streamed=streamed))
            result = await engine.wait_for_task(task_id)
    assert entered.is_set() and cancel_sent.is_set()
    assert (result.status, result.reason) == ("failed", "episode_timeout")


@pytest.mark.slow
async def test_32_concurrent_agents_sdk_sessions_on_the_tiny_model_are_all_accepted(tmp_path):
    tok = build_tiny_tokenizer()
    backend = HFBackend(build_tiny_model(tmp_path / "tiny"), tok, max_batch_size=32, batch_window_s=0.01)
    workflow = _agent(AgentsSDKMathWorkflow, tok, max_turns=2)
    workflow.gconfig = workflow.gconfig.new(max_new_tokens=8)
    n = 32
    with trio.fail_after(BOUND_S):
        async with open_rollout_engine(backend, EngineConfig(max_concurrent_rollouts=n),
                                       reward_pool=InProcessRewardPool()) as engine:
            for i in range(n):
                engine.submit({**ITEM, "i": i}, workflow)
            results = await engine.wait_results(n)
            pstats = (await shared_proxy(engine)).statistics()
            stats = engine.statistics()
    assert sorted(r.status for r in results) == ["accepted"] * n
    assert stats.retokenization_drifts == 0 and (pstats.started, pstats.ended, pstats.abandoned) == (n, n, 0)
    for r in results:  # random bytes from the tiny model: a truncated answer, logprobs on every sampled token
        traj = r.trajectory
        gen = traj["loss_mask"].bool()
        assert gen.any() and (traj["logprobs"][gen] < 0).all() and (traj["versions"][gen] == 0).all()

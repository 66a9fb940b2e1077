#!/usr/bin/env python3
"""Episodes per second of the GSM8K agent written three ways, through the engine's proxy.

Each scenario runs ``--episodes`` episodes, ``--concurrency`` at once, of one agent that
makes two model calls (a calculator tool call, then the answer) against a zero-latency
scripted backend (the tiny byte-level tokenizer): what an episode costs is the
framework, the HTTP round trips and the engine, not generation.

* ``openai-sdk``: the plain ``openai`` SDK (``AsyncOpenAI.chat.completions.create``),
  hand-written tool loop;
* ``agents-sdk``: :class:`workflows.agents_sdk_math.AgentsSDKMathWorkflow` (the OpenAI
  Agents SDK, ``Runner.run``, the Responses API);
* ``langgraph``: :class:`workflows.langgraph_math.LangGraphMathWorkflow`
  (``create_react_agent``, ``astream(stream_mode="messages")``, streamed chat).

All three run in the engine's one asyncio loop (``engine.aio.run_asyncio``) with a session
of the engine's shared proxy each (``engine.openai.open_agent_session``).  Needs the
``agents`` extra.  Run from the repository root::

    .venv/bin/python benchmarks/bench_agent_frameworks.py        # 64 episodes, 32 at once (~1 min)

Prints one table and writes ``benchmarks/results/bench_agent_frameworks.json``::

    {"schema": "bench_agent_frameworks/1", "config": {...},
     "scenarios": [{"framework": "agents-sdk", "episodes": 64, "accepted": 64, "wall_s": ...,
                    "episodes_per_s": ..., "calls": 128, "drifts": 0}, ...]}
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "bench_agent_frameworks.json"
sys.path.insert(0, str(ROOT))

CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2+3"}}\n</tool_call>'
FRAMEWORKS = ("openai-sdk", "agents-sdk", "langgraph")


def _backend(tok: Any) -> Any:
    """A tool call to a fresh question, the answer once a tool result is in the prompt."""
    from engine import MockBackend, ModelResponse
    from engine.testing import TINY_EOS_ID

    tool_turn = tok.encode("<|im_start|>tool", add_special_tokens=False)

    async def answer(req: Any, budget: int) -> Any:
        ids = list(req.input_ids)
        seen = any(ids[i:i + len(tool_turn)] == tool_turn for i in range(len(ids) - len(tool_turn) + 1))
        out = (tok.encode("#### 5" if seen else CALL, add_special_tokens=False) + [TINY_EOS_ID])[:budget]
        return ModelResponse(input_tokens=ids, output_tokens=out, output_logprobs=[-0.5] * len(out),
                             output_versions=[0] * len(out), stop_reason="stop")

    return MockBackend(answer)


class _PlainSDK:
    """The hand-written tool loop of the plain openai SDK, as a FrameworkMathAgent."""

    @staticmethod
    async def run_agent(base_url: str, api_key: str, question: str) -> None:
        import openai

        from workflows._framework_agent import calculator
        from workflows.math_agent import CALCULATOR_TOOL

        async with openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0) as client:
            msgs: list[Any] = [{"role": "user", "content": question}]
            for _ in range(4):
                tools: Any = [CALCULATOR_TOOL]
                c = await client.chat.completions.create(model="default", messages=msgs, tools=tools)
                message = c.choices[0].message
                msgs.append(message.model_dump(exclude_none=True))
                if not message.tool_calls:
                    return
                for call in message.tool_calls:
                    arguments = json.loads(getattr(call, "function").arguments)
                    msgs.append({"role": "tool", "tool_call_id": call.id, "content": calculator(arguments["expression"])})


def _workflow(framework: str, tok: Any) -> Any:
    from engine.types import GenerationHyperparameters
    from workflows._framework_agent import FrameworkMathAgent
    from workflows.agents_sdk_math import AgentsSDKMathWorkflow
    from workflows.langgraph_math import LangGraphMathWorkflow

    cls: Any = {"openai-sdk": FrameworkMathAgent, "agents-sdk": AgentsSDKMathWorkflow,
                "langgraph": LangGraphMathWorkflow}[framework]
    workflow = cls("rewards.gsm8k:gsm8k_reward", GenerationHyperparameters(max_new_tokens=128), tok)
    if framework == "openai-sdk":
        workflow.run_agent = _PlainSDK.run_agent
    return workflow


async def _scenario(framework: str, episodes: int, concurrency: int) -> dict[str, Any]:
    from engine import EngineConfig, open_rollout_engine
    from engine.openai.agent_session import shared_proxy
    from engine.testing import InProcessRewardPool, build_tiny_tokenizer

    tok = build_tiny_tokenizer()
    workflow = _workflow(framework, tok)
    async with open_rollout_engine(_backend(tok), EngineConfig(max_concurrent_rollouts=concurrency),
                                   reward_pool=InProcessRewardPool()) as engine:
        start = time.perf_counter()
        for i in range(episodes):
            engine.submit({"question": f"What is 2+3? ({i})", "answer": "#### 5"}, workflow)
        results = await engine.wait_results(episodes)
        wall = time.perf_counter() - start
        proxy = await shared_proxy(engine)
        calls, drifts = proxy.statistics().requests, engine.statistics().retokenization_drifts
    return {"framework": framework, "episodes": episodes, "accepted": sum(r.status == "accepted" for r in results),
            "wall_s": wall, "episodes_per_s": episodes / wall, "calls": calls, "drifts": drifts}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    parser.add_argument("--episodes", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--frameworks", nargs="+", choices=FRAMEWORKS, default=list(FRAMEWORKS))
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    import trio

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    for framework in args.frameworks:  # warm-up (imports, templates, first connections), not reported
        trio.run(_scenario, framework, 2, 2)
    rows = [trio.run(_scenario, framework, args.episodes, args.concurrency) for framework in args.frameworks]
    print(f"{'framework':>11} {'episodes':>8} {'accepted':>8} {'calls':>6} {'drifts':>6} {'wall s':>7} {'episodes/s':>10}")
    for r in rows:
        print(f"{r['framework']:>11} {r['episodes']:>8} {r['accepted']:>8} {r['calls']:>6} {r['drifts']:>6} "
              f"{r['wall_s']:>7.2f} {r['episodes_per_s']:>10.1f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "schema": "bench_agent_frameworks/1",
        "config": {"episodes": args.episodes, "concurrency": args.concurrency, "python": platform.python_version(),
                   "cpus": os.cpu_count()},
        "scenarios": rows}, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

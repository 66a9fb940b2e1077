"""The GSM8K math agent written with the OpenAI Agents SDK (``openai-agents``,
``pip install 'trio-rollout[agents]'``), on the engine (``--workflow agents_sdk_math``).

The agent is plain Agents SDK code with the SDK's default model class,
``OpenAIResponsesModel`` (the Responses API), served by the engine's proxy::

    agent = Agent(name="math", instructions=system_prompt, tools=[function_tool(calculator)],
                  model=OpenAIResponsesModel(model="default", openai_client=AsyncOpenAI(base_url, api_key)))
    await Runner.run(agent, question, max_turns=max_turns, run_config=RunConfig(tracing_disabled=True))

``streamed=True`` runs it with ``Runner.run_streamed`` and consumes ``stream_events()``
(the streamed Responses API).  Tracing is off for every run (``RunConfig(tracing_disabled=True)``:
no trace is sent anywhere; nothing process-wide is set).  A run that ends early
(``MaxTurnsExceeded``, a turn cut by the token budget: the SDK raises on an
``incomplete`` response, or no budget left) keeps its interactions; the last completion is
scored.  The rest is :class:`~workflows._framework_agent.FrameworkMathAgent`.
"""

from __future__ import annotations

import logging
from typing import Any

from ._framework_agent import FrameworkMathAgent, calculator

__all__ = ["AgentsSDKMathWorkflow"]

logger = logging.getLogger(f"rollout.{__name__}")


class AgentsSDKMathWorkflow(FrameworkMathAgent):
    """GSM8K with a calculator tool, an OpenAI Agents SDK agent (see the module docstring).

    Args:
        streamed: run with ``Runner.run_streamed`` instead of ``Runner.run``.
        **kwargs: as :class:`~workflows._framework_agent.FrameworkMathAgent`.
    """

    requires = ("agents",)

    def __init__(self, *args: Any, streamed: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.streamed = bool(streamed)

    async def run_agent(self, base_url: str, api_key: str, question: str) -> None:
        import openai
        from agents import Agent, OpenAIResponsesModel, RunConfig, Runner, function_tool
        from agents.exceptions import AgentsException

        client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
        agent = Agent(name="math", instructions=self.system_prompt, tools=[function_tool(calculator)],
                      model=OpenAIResponsesModel(model="default", openai_client=client))
        config = RunConfig(tracing_disabled=True)
        try:
            if self.streamed:
                run = Runner.run_streamed(agent, question, max_turns=self.max_turns, run_config=config)
                async for _ in run.stream_events():
                    pass
            else:
                await Runner.run(agent, question, max_turns=self.max_turns, run_config=config)
        except (AgentsException, openai.BadRequestError) as exc:  # the run ended early: score what it wrote
            logger.debug("agents sdk run ended early: %s: %s", type(exc).__name__, exc)
        finally:
            await client.close()

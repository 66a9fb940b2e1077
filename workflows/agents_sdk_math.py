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

A turn cut by the token budget is an outcome of ours, not a model error: the proxy answers
it as the Responses API does (``status="incomplete"``, ``incomplete_details.reason =
"max_output_tokens"``), the episode's last completion has ``stop_reason "length"``
(``is_truncated``), and the end of the run is logged at debug level as "ended by the token
budget".  The SDK raises on such a response and logs "Error getting response" (or "Error
streaming response") at ERROR on its own logger, ``openai.agents``; that record is dropped
by a :class:`logging.Filter` on that logger which acts only inside this workflow's runs (a
context variable) and only on the budget cut (any other model error is still the SDK's to
log).  The filter is there while runs are in flight and removed after the last one.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import sys
import threading
from collections.abc import Iterator
from typing import Any

from ._framework_agent import FrameworkMathAgent, calculator

__all__ = ["AgentsSDKMathWorkflow"]

logger = logging.getLogger(f"rollout.{__name__}")

_SDK_LOGGER = "openai.agents"  # the Agents SDK's own logger (agents/logger.py)
_in_run: contextvars.ContextVar[bool] = contextvars.ContextVar("agents_sdk_math_run", default=False)


def _budget_cut(exc: BaseException | None) -> bool:
    """Whether ``exc`` is the SDK's error for a response our token budget cut: it raises
    ``ModelBehaviorError`` on ``status="incomplete"``, naming ``incomplete_details``."""
    from agents.exceptions import ModelBehaviorError

    return isinstance(exc, ModelBehaviorError) and "max_output_tokens" in str(exc)


class _BudgetCutFilter(logging.Filter):
    """Drops the SDK's error record of a budget cut, inside this workflow's runs only."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not _in_run.get() or record.levelno < logging.ERROR:
            return True
        # the SDK redacts exc_info by default (DONT_LOG_MODEL_DATA); it logs inside its except block
        exc = record.exc_info[1] if record.exc_info else sys.exc_info()[1]
        return not _budget_cut(exc)


_filter = _BudgetCutFilter()
_filter_lock = threading.Lock()  # engines may run their asyncio loops in several threads
_filter_users = 0


@contextlib.contextmanager
def _sdk_budget_cuts_unlogged() -> Iterator[None]:
    """For the block (a run, in its asyncio task): the SDK's record of a budget cut is dropped."""
    global _filter_users
    token = _in_run.set(True)
    with _filter_lock:
        if not _filter_users:
            logging.getLogger(_SDK_LOGGER).addFilter(_filter)
        _filter_users += 1
    try:
        yield
    finally:
        with _filter_lock:
            _filter_users -= 1
            if not _filter_users:
                logging.getLogger(_SDK_LOGGER).removeFilter(_filter)
        _in_run.reset(token)


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
            with _sdk_budget_cuts_unlogged():
                if self.streamed:
                    run = Runner.run_streamed(agent, question, max_turns=self.max_turns, run_config=config)
                    async for _ in run.stream_events():
                        pass
                else:
                    await Runner.run(agent, question, max_turns=self.max_turns, run_config=config)
        except (AgentsException, openai.BadRequestError) as exc:  # the run ended early: score what it wrote
            if _budget_cut(exc):
                logger.debug("agents sdk run ended by the token budget (max_new_tokens / max_tokens): its last "
                             "completion has stop_reason 'length' and is scored")
            else:
                logger.debug("agents sdk run ended early: %s: %s", type(exc).__name__, exc)
        finally:
            await client.close()

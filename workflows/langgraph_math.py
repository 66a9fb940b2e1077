"""The GSM8K math agent written with LangGraph (``langgraph`` + ``langchain-openai``,
``pip install 'trio-rollout[agents]'``), on the engine (``--workflow langgraph_math``).

The agent is LangGraph's prebuilt ReAct agent over ``ChatOpenAI`` pointed at the
engine's proxy, streamed in ``"messages"`` mode (the model streams its tokens)::

    model = ChatOpenAI(model="default", base_url=base_url, api_key=SecretStr(api_key), max_retries=0,
                       use_responses_api=use_responses_api, http_async_client=<a client of this run>)
    agent = create_react_agent(model, [calculator], prompt=system_prompt)
    async for chunk, meta in agent.astream({"messages": [("user", question)]}, stream_mode="messages",
                                           config={"recursion_limit": 2 * max_turns + 1}): ...

``use_responses_api=True`` makes ``ChatOpenAI`` use the Responses API.  Each run gets its own
``http_async_client`` (closed after it): langchain-openai otherwise caches one async HTTP
client per process, and a client opened under another event loop fails with "Event loop is
closed".  LangSmith tracing is off unless you turn it on (``LANGSMITH_TRACING`` /
``LANGCHAIN_TRACING_V2`` in the environment); this module sets no environment variable.
A run that ends early (``GraphRecursionError``: too many turns; no token budget left)
keeps its interactions; the last completion is scored.  The rest is
:class:`~workflows._framework_agent.FrameworkMathAgent`.
"""

from __future__ import annotations

import logging
from typing import Any

from ._framework_agent import FrameworkMathAgent, calculator

__all__ = ["LangGraphMathWorkflow"]

logger = logging.getLogger(f"rollout.{__name__}")


class LangGraphMathWorkflow(FrameworkMathAgent):
    """GSM8K with a calculator tool, a LangGraph ReAct agent (see the module docstring).

    Args:
        use_responses_api: ``ChatOpenAI(use_responses_api=...)``: the Responses API
            instead of chat completions.
        **kwargs: as :class:`~workflows._framework_agent.FrameworkMathAgent`.
    """

    requires = ("langgraph", "langchain_openai")

    def __init__(self, *args: Any, use_responses_api: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.use_responses_api = bool(use_responses_api)

    async def run_agent(self, base_url: str, api_key: str, question: str) -> None:
        import openai
        from langchain_core.tools import tool
        from langchain_openai import ChatOpenAI
        from langgraph.errors import GraphRecursionError
        from langgraph.prebuilt import create_react_agent
        from pydantic import SecretStr

        http = openai.DefaultAsyncHttpxClient()
        model = ChatOpenAI(model="default", base_url=base_url, api_key=SecretStr(api_key), max_retries=0,
                           use_responses_api=self.use_responses_api, http_async_client=http)
        agent = create_react_agent(model, [tool(calculator)], prompt=self.system_prompt)
        try:
            async for _ in agent.astream({"messages": [("user", question)]}, stream_mode="messages",
                                         config={"recursion_limit": 2 * self.max_turns + 1}):
                pass
        except (GraphRecursionError, openai.BadRequestError) as exc:  # the run ended early: score what it wrote
            logger.debug("langgraph run ended early: %s: %s", type(exc).__name__, exc)
        finally:
            await http.aclose()

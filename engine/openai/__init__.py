"""OpenAI-compatible agents on the engine: a client, an HTTP proxy, interactions.

* :class:`EngineOpenAI`: an ``openai.AsyncOpenAI`` whose ``chat.completions.create``
  runs on ``engine.agenerate`` (token-exact across calls, tool calls parsed)
  and records every completion as an :class:`Interaction`;
* :class:`InteractionCache`: the completions of an episode as a conversation
  tree: rewards, discount, export as ``dict[id, Interaction]`` ("individual" or
  "concat"), which ``arun_episode`` may return;
* :func:`open_openai_proxy`: an OpenAI-compatible HTTP server on 127.0.0.1
  (hypercorn's trio worker + Starlette) inside the engine's trio loop, one
  episode per session (chat completions streamed or not, ``n > 1``, completions,
  the Responses API);
* :func:`open_agent_session`: an HTTP session of the running episode for an
  asyncio agent framework (with :func:`engine.aio.run_asyncio`).

Names resolve lazily: importing this package does not import ``openai``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

__all__ = [
    "AgentSession",
    "EngineOpenAI",
    "Interaction",
    "InteractionCache",
    "JsonInTagsToolCallParser",
    "OpenAIProxy",
    "ParsedToolCall",
    "ProxyConfig",
    "ProxySession",
    "ProxyStatistics",
    "open_agent_session",
    "open_openai_proxy",
    "resolve_tool_parser",
    "trajectory_from_interactions",
]

_LAZY = {
    "AgentSession": "engine.openai.agent_session",
    "EngineOpenAI": "engine.openai.client",
    "Interaction": "engine.openai.interaction",
    "InteractionCache": "engine.openai.cache",
    "JsonInTagsToolCallParser": "engine.openai.tool_calls",
    "OpenAIProxy": "engine.openai.proxy",
    "ParsedToolCall": "engine.openai.tool_calls",
    "ProxyConfig": "engine.openai.proxy",
    "ProxySession": "engine.openai.proxy",
    "ProxyStatistics": "engine.openai.proxy",
    "open_agent_session": "engine.openai.agent_session",
    "open_openai_proxy": "engine.openai.proxy",
    "resolve_tool_parser": "engine.openai.tool_calls",
    "trajectory_from_interactions": "engine.openai.interaction",
}


if TYPE_CHECKING:  # what type checkers see; at run time each name resolves on first access
    from .agent_session import AgentSession as AgentSession, open_agent_session as open_agent_session
    from .cache import InteractionCache as InteractionCache
    from .client import EngineOpenAI as EngineOpenAI
    from .interaction import Interaction as Interaction, trajectory_from_interactions as trajectory_from_interactions
    from .proxy import (
        OpenAIProxy as OpenAIProxy,
        ProxyConfig as ProxyConfig,
        ProxySession as ProxySession,
        ProxyStatistics as ProxyStatistics,
        open_openai_proxy as open_openai_proxy,
    )
    from .tool_calls import (
        JsonInTagsToolCallParser as JsonInTagsToolCallParser,
        ParsedToolCall as ParsedToolCall,
        resolve_tool_parser as resolve_tool_parser,
    )

from ..lazy import lazy_exports  # noqa: E402

__getattr__, __dir__ = lazy_exports(globals(), _LAZY)

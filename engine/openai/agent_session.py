"""An OpenAI-compatible endpoint for the agent of one episode: asyncio agent
frameworks (the OpenAI Agents SDK, LangGraph + langchain-openai, ...) talk HTTP to
it with the session's key, and its completions become the episode's interactions.

::

    class MyAgentWorkflow(RolloutWorkflow):
        async def arun_episode(self, engine, data):
            async with open_agent_session(engine, self.tokenizer, gconfig=self.gconfig) as session:
                answer = await run_asyncio(engine, my_agent, session.base_url, session.api_key, data)
            session.set_last_reward(score(answer, data))
            return session.export_interactions("concat")

:func:`open_agent_session` attaches a session
(:meth:`~engine.openai.OpenAIProxy.attach_session`) to the engine's shared proxy: one
HTTP server on 127.0.0.1 for all of the engine's agent sessions, opened on first use and
closed when the engine closes (:meth:`engine.RolloutEngine.shared_resource`), or to a
proxy you pass.  Every request made with the session's key (chat completions, streamed
or not, ``n > 1``, completions, the Responses API) runs on the episode's engine through
an :class:`~engine.openai.EngineOpenAI` whose cache the session exposes: token-exact
across calls, tool calls parsed, one interaction per completion.  The shared proxy
starts no sessions of its own (``/rl/start_session`` needs a random admin key nobody
has).

Leaving the block ends the session: requests still in flight are cancelled (their
generations withdrawn), its key stops working, and the drift events of its requests
are recorded in the episode (``EngineStatistics.retokenization_drifts``).  The cache
stays readable, so rewards are set and interactions exported after the block.
"""

from __future__ import annotations

import trio

import functools
import os
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from ..chat import record_drift
from ..types import GenerationHyperparameters
from .cache import InteractionCache
from .client import EngineOpenAI
from .interaction import Interaction

__all__ = ["AgentSession", "PROXY_KEY", "open_agent_session", "shared_proxy"]

#: The key of the engine's shared agent proxy (:meth:`engine.RolloutEngine.shared_resource`).
PROXY_KEY = "engine.openai.agent_proxy"


@dataclass(eq=False)
class AgentSession:
    """One episode's agent session (what :func:`open_agent_session` yields).

    Attributes:
        base_url: the OpenAI base URL (``http://127.0.0.1:PORT/v1``) for the agent's client.
        api_key: the session's key (the bearer token an OpenAI client sends; left out of ``repr``).
        session_id: its name in the proxy's log lines.
        client: the :class:`~engine.openai.EngineOpenAI` that serves its requests.
    """

    base_url: str
    api_key: str = field(repr=False)
    session_id: str
    client: EngineOpenAI = field(repr=False)

    @property
    def cache(self) -> InteractionCache:
        """The session's completions (:class:`InteractionCache`)."""
        return self.client.cache

    def set_reward(self, interaction_id: str, reward: float) -> None:
        """:meth:`InteractionCache.set_reward`."""
        self.client.cache.set_reward(interaction_id, reward)

    def set_last_reward(self, reward: float) -> None:
        """:meth:`InteractionCache.set_last_reward`."""
        self.client.cache.set_last_reward(reward)

    def apply_reward_discount(self, turn_discount: float = 1.0) -> dict[str, float]:
        """:meth:`InteractionCache.apply_reward_discount`."""
        return self.client.cache.apply_reward_discount(turn_discount)

    def export_interactions(self, style: str = "individual", *,
                            drop_retry_orphans: bool = False) -> dict[str, Interaction]:
        """:meth:`InteractionCache.export_interactions` (what ``arun_episode`` returns)."""
        return self.client.cache.export_interactions(style, drop_retry_orphans=drop_retry_orphans)


def _shared_proxy(engine: Any) -> Any:
    from .proxy import ProxyConfig, open_openai_proxy

    # no session of its own: start_session needs a key that nobody is given
    return open_openai_proxy(engine, None, ProxyConfig(admin_api_key=os.urandom(24).hex()))


async def shared_proxy(engine: Any) -> Any:
    """The engine's shared :class:`~engine.openai.OpenAIProxy` (opened if it is not yet):
    its ``statistics()`` count the agent sessions and their requests.

    Raises:
        trio.ClosedResourceError: the engine is closed.
    """
    return await engine.shared_resource(PROXY_KEY, functools.partial(_shared_proxy, engine))


@asynccontextmanager
async def open_agent_session(engine: Any, tokenizer: Any, *, gconfig: GenerationHyperparameters | None = None,
                             tool_parser: Any = "hermes", chat_template_kwargs: Mapping[str, Any] | None = None,
                             model: str = "default", proxy: Any = None) -> AsyncIterator[AgentSession]:
    """An agent session of the running episode for the block (see the module docstring).

    Args:
        engine: the engine given to ``arun_episode``.
        tokenizer: a transformers tokenizer with a chat template.
        gconfig, tool_parser, chat_template_kwargs, model: as :class:`~engine.openai.EngineOpenAI`
            (``gconfig.n_samples`` is ignored: one request, one sample, unless it asks ``n``).
        proxy: an :class:`~engine.openai.OpenAIProxy` to attach to; by default the
            engine's shared one.

    Raises:
        trio.ClosedResourceError: the engine or the proxy is closed.
        OSError: the shared proxy cannot bind its port.
    """
    client = EngineOpenAI(engine, tokenizer, gconfig=gconfig, tool_parser=tool_parser,
                          chat_template_kwargs=chat_template_kwargs, model=model)
    try:
        if proxy is None:
            proxy = await shared_proxy(engine)
        session = proxy.attach_session(client)
    except trio.ClosedResourceError:
        # the engine is closing (Ctrl-C, close()): its shared proxy may be gone before this
        # episode's cancellation reaches it; a checkpoint lets that cancellation win, so the
        # episode ends "cancelled" (re-run by --resume), not failed with a workflow error
        await trio.lowlevel.checkpoint()
        raise
    try:
        yield AgentSession(base_url=proxy.base_url, api_key=session.api_key, session_id=session.session_id,
                           client=client)
    finally:
        for detail in proxy.detach_session(session):  # counted in this episode
            record_drift(detail)

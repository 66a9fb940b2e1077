"""What the GSM8K agents written with asyncio agent frameworks share
(:mod:`workflows.agents_sdk_math`, :mod:`workflows.langgraph_math`).

One sample of an episode::

    async with open_agent_session(engine, tokenizer, gconfig=...) as session:     (engine.openai)
        answer = await run_asyncio(engine, self.run_agent, session.base_url, session.api_key, question)
    reward = reward_fn(prompt, answer, prompt ids, completion ids, **data)    (the last completion's)
    session.set_last_reward(reward); session.apply_reward_discount(turn_discount)
    return session.export_interactions(export_style)

The framework runs in the engine's one asyncio loop (:func:`engine.aio.run_asyncio`) and
talks HTTP to the engine's shared OpenAI-compatible proxy with the session's key; every
model call it makes is an interaction of the episode (token-exact across turns, tool calls
parsed from the model's ``<tool_call>`` blocks).  The answer scored is the text of the
session's last completion.  A run the framework cannot finish (the token budget ends a
turn, too many turns) still scores what the model wrote: the framework's error is logged
at debug level and the episode keeps its interactions.
"""

from __future__ import annotations

import importlib.util
import logging
from typing import Any

from engine.errors import WorkflowError
from engine.workflow import EpisodeEngine

from .base import sample_gconfig
from ._samples import gather_samples
from .math_agent import CalculatorError, MathAgentBase, calculate

__all__ = ["FrameworkMathAgent", "calculator"]

logger = logging.getLogger(f"rollout.{__name__}")


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression with + - * / // % ** and parentheses; returns the number."""
    try:
        return calculate(expression)
    except CalculatorError as exc:
        return f"error: {exc}"


class FrameworkMathAgent(MathAgentBase):
    """GSM8K with a calculator tool, written with an asyncio agent framework.

    Args:
        reward_fn: as :class:`~workflows.math_agent.MathAgentWorkflow` (``rollout run``'s
            ``--reward``, GSM8K by default).
        gconfig: sampling parameters of every model call (``max_new_tokens`` per call);
            ``n_samples`` agents run concurrently and their interactions are merged.
        tokenizer: a transformers tokenizer with a chat template, or a path.
        max_turns: model calls per sample (the framework's turn limit), >= 1.
        turn_discount: in ``[0, 1]``: ``apply_reward_discount``.
        export_style: ``"concat"`` (one row per sample) or ``"individual"``.
        system_prompt: the agent's instructions.
        tool_parser, enable_thinking, chat_template_kwargs: as
            :class:`~engine.openai.EngineOpenAI`.

    Raises:
        ValueError: ``max_turns < 1``, ``turn_discount`` outside ``[0, 1]`` or an
            unknown ``export_style``.
        WorkflowError: the framework is not installed (the ``agents`` extra).
        RewardError: ``reward_fn`` cannot be resolved.
    """

    #: the modules the framework needs (checked at construction: one clear error, not one per episode)
    requires: tuple[str, ...] = ()

    def _check_installed(self) -> None:
        """The framework's modules (:attr:`requires`) can be imported, else one :class:`WorkflowError`."""
        missing = [name for name in self.requires if importlib.util.find_spec(name) is None]
        if missing:
            raise WorkflowError(f"{type(self).__name__} needs the agent frameworks it is written with ({', '.join(missing)} "
                                "not found): pip install 'trio-rollout[agents]'")

    async def run_agent(self, base_url: str, api_key: str, question: str) -> None:
        """The framework's run (asyncio code, in the engine's asyncio loop): the agent
        answers ``question`` with its model at ``base_url`` (an OpenAI base URL) and the
        session's ``api_key``.  Subclasses implement it."""
        raise NotImplementedError

    async def arun_episode(self, engine: EpisodeEngine, data: dict[str, Any]) -> dict[str, Any] | None:
        question = str(self._question_of(data))
        results = await gather_samples(self.gconfig.n_samples, lambda i: self._sample(engine, data, question, i))
        merged = {k: v for r in results for k, v in r.items()}
        return merged or None

    async def _sample(self, engine: EpisodeEngine, data: dict[str, Any], question: str, sample: int) -> dict[str, Any]:
        from engine.aio import run_asyncio
        from engine.openai import open_agent_session

        async with open_agent_session(engine, self.tokenizer, gconfig=sample_gconfig(self.gconfig.new(n_samples=1), sample),
                                      tool_parser=self.tool_parser,
                                      chat_template_kwargs=self.chat_template_kwargs) as session:
            await run_asyncio(engine, self.run_agent, session.base_url, session.api_key, question)
        last = session.cache.last
        if last is None:
            raise RuntimeError(f"{type(self).__name__}: the agent made no model call")
        return await self._scored(engine, session, last.output_message.get("content") or "", data)

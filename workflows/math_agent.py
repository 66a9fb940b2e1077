"""A GSM8K agent with a calculator tool, written against the OpenAI client
(AReaL ``areal/workflow/openai/math_agent.py``), run on the engine.

One sample of an episode::

    messages = [system prompt (how to call the tool, how to answer), the question]
    for turn in 0 .. max_turns - 1:
        c = await client.chat.completions.create(messages=messages, tools=[calculator])
        messages.append(c.choices[0].message)
        if no tool call: break                          (the final answer)
        for each call: messages.append({"role": "tool", "content": calculator(expression)})
    reward = reward_fn(prompt, final content, prompt ids, completion ids, **data)   (the GSM8K reward)
    client.set_last_reward(reward); client.apply_reward_discount(turn_discount)
    return client.export_interactions(export_style)     (dict[id, Interaction])

The client is :class:`engine.openai.EngineOpenAI` (in-process: every call is
``engine.agenerate``, token-exact across turns); the engine turns the returned
dict into trajectory rows (:mod:`engine.openai.interaction`).  With the
default ``export_style="concat"`` a sample is one row: ``loss_mask`` 1 exactly
on the sampled turns; the tool results, the template glue between turns and
the prompt have ``loss_mask`` 0.

The calculator (:func:`calculate`) evaluates arithmetic with :mod:`ast` (no
``eval``): numbers, ``+ - * / // % **`` and parentheses, nothing else, with
bounds on length, exponents and magnitudes.
"""

from __future__ import annotations

import ast
import json
import math
import operator
from collections.abc import Callable, Mapping
from typing import Any

from engine.errors import InvalidRequestError
from engine.imports import resolve_reward_fn
from engine.types import GenerationHyperparameters
from engine.workflow import EpisodeEngine, RolloutWorkflow

from .base import sample_gconfig
from ._samples import check_max_turns, check_turn_discount, gather_samples, load_tokenizer, template_kwargs
from ._text import decode

__all__ = ["CALCULATOR_TOOL", "CalculatorError", "DEFAULT_SYSTEM_PROMPT", "MathAgentWorkflow", "calculate"]

CALCULATOR_TOOL = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression with + - * / // % ** and parentheses; returns the number.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "e.g. '(12 + 7) * 3'"}},
            "required": ["expression"],
        },
    },
}

DEFAULT_SYSTEM_PROMPT = (
    "You solve grade-school math problems step by step. You may use a calculator: to call it, write exactly\n"
    '<tool_call>\n{"name": "calculator", "arguments": {"expression": "12 * (3 + 4)"}}\n</tool_call>\n'
    "and wait for its result. When you know the answer, write it on the last line as '#### <number>'."
)

_MAX_EXPRESSION_CHARS = 200
_MAX_EXPONENT = 64
_MAX_MAGNITUDE = 1e18


class CalculatorError(ValueError):
    """The expression is not plain arithmetic, or is out of bounds."""


_BINARY: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
}
_UNARY: dict[type, Callable[[Any], Any]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}


def _eval(node: ast.AST) -> int | float:
    if isinstance(node, ast.Expression):
        return _eval(node.body)
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow) and (abs(right) > _MAX_EXPONENT or abs(left) > _MAX_MAGNITUDE):
            raise CalculatorError(f"exponent too large: {left} ** {right}")
        try:
            value = _BINARY[type(node.op)](left, right)
        except ZeroDivisionError:
            raise CalculatorError("division by zero") from None
        if isinstance(value, complex):
            raise CalculatorError("the result is not a real number")
        if abs(value) > _MAX_MAGNITUDE:
            raise CalculatorError(f"the result is too large (over {_MAX_MAGNITUDE:g})")
        return value
    raise CalculatorError(f"not allowed in an arithmetic expression: {type(node).__name__}")


def calculate(expression: str) -> str:
    """Evaluate plain arithmetic and return the number as text (``"21"``,
    ``"2.5"``; a float that is a whole number is written without ``.0``).
    ``^``, ``×`` and ``÷`` are read as ``**``, ``*`` and ``/``; thousands
    separators (``1,000``) are removed.

    Raises:
        CalculatorError: not a string, longer than 200 characters, a syntax
            error, anything but numbers, the operators above and parentheses
            (names, calls, attributes, subscripts...), an exponent over 64, a
            magnitude over 1e18, a division by zero.
    """
    if not isinstance(expression, str):
        raise CalculatorError(f"the expression must be a string, got {type(expression).__name__}")
    if len(expression) > _MAX_EXPRESSION_CHARS:
        raise CalculatorError(f"the expression is longer than {_MAX_EXPRESSION_CHARS} characters")
    text = expression.replace("^", "**").replace("×", "*").replace("÷", "/")
    text = "".join(c for i, c in enumerate(text)
                   if not (c == "," and 0 < i < len(text) - 1 and text[i - 1].isdigit() and text[i + 1].isdigit()))
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except SyntaxError as exc:
        raise CalculatorError(f"not an arithmetic expression: {exc.msg}") from None
    value = _eval(tree)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise CalculatorError("the result is not finite")
        if value.is_integer():
            return str(int(value))
        return repr(round(value, 10))
    return str(value)


def _run_tool(name: str, arguments: str) -> str:
    if name != "calculator":
        return f"error: unknown tool {name!r}; the only tool is 'calculator'"
    try:
        args = json.loads(arguments)
    except json.JSONDecodeError as exc:
        return f"error: the arguments are not JSON ({exc.msg})"
    if not isinstance(args, dict) or "expression" not in args:
        return "error: the arguments must be {\"expression\": \"...\"}"
    try:
        return calculate(args["expression"])
    except CalculatorError as exc:
        return f"error: {exc}"


class MathAgentBase(RolloutWorkflow):
    """What the GSM8K calculator agents share (:class:`MathAgentWorkflow`, the framework agents
    of :mod:`workflows._framework_agent`): the constructor's checks and attributes, and the
    question of a dataset item.  The arguments are :class:`MathAgentWorkflow`'s; subclasses
    hook in with :meth:`_check_installed` (first) and :meth:`_tool_parser` (last).

    Raises:
        ValueError: ``max_turns < 1``, ``turn_discount`` outside ``[0, 1]`` or an unknown
            ``export_style``.
        RewardError: ``reward_fn`` cannot be resolved.
        InvalidRequestError: ``gconfig`` is out of range.
    """

    def __init__(self, reward_fn: Callable[..., Any] | str, gconfig: GenerationHyperparameters, tokenizer: Any,
                 max_turns: int = 4, turn_discount: float = 1.0, export_style: str = "concat",
                 system_prompt: str = DEFAULT_SYSTEM_PROMPT, tool_parser: Any = "hermes",
                 enable_thinking: bool | None = None, chat_template_kwargs: Mapping[str, Any] | None = None) -> None:
        from engine.openai.interaction import EXPORT_STYLES

        self._check_installed()
        max_turns, turn_discount = check_max_turns(max_turns), check_turn_discount(turn_discount)
        if export_style not in EXPORT_STYLES:
            raise ValueError(f"export_style must be one of {EXPORT_STYLES}, got {export_style!r}")
        tokenizer = load_tokenizer(tokenizer)
        self.reward_fn = resolve_reward_fn(reward_fn)
        self.tokenizer = tokenizer
        self.gconfig = gconfig.new_with_stop_and_pad_token_ids(tokenizer)
        self.gconfig.validate()
        self.max_turns, self.turn_discount, self.export_style = max_turns, turn_discount, export_style
        self.system_prompt = system_prompt
        self.tool_parser = self._tool_parser(tool_parser)
        self.chat_template_kwargs = template_kwargs(chat_template_kwargs, enable_thinking)

    def _check_installed(self) -> None:
        """Called first by the constructor: raise if what the agent needs is missing."""

    def _tool_parser(self, tool_parser: Any) -> Any:
        """``tool_parser`` as the agent keeps it (as given here)."""
        return tool_parser

    def _question_of(self, data: Mapping[str, Any]) -> Any:
        """``data["question"]`` when it is a string, else the content of the last user message
        of ``data["messages"]``.

        Raises:
            KeyError: the item has neither.
        """
        question = data.get("question")
        if isinstance(question, str):
            return question
        users = [m for m in data.get("messages") or () if m.get("role") == "user"]
        if not users:
            raise KeyError(f"{type(self).__name__}: the dataset item has neither 'question' nor a user message")
        return users[-1]["content"]

    async def _scored(self, engine: EpisodeEngine, client: Any, answer: str, data: dict[str, Any]) -> dict[str, Any]:
        """The sample's interactions, its last completion scored: ``reward_fn(its prompt decoded,
        answer, its prompt ids, its output ids, **data)``, the reward set on it and discounted
        over the earlier turns (``client``: an :class:`~engine.openai.EngineOpenAI` or an
        :class:`~engine.openai.AgentSession`, with a completion)."""
        resp = client.cache.last.response
        scored = await engine.reward_pool.score(self.reward_fn, decode(self.tokenizer, resp.input_tokens, False),
                                                answer, resp.input_tokens, resp.output_tokens, **data)
        client.set_last_reward(scored.reward)
        client.apply_reward_discount(self.turn_discount)
        return client.export_interactions(self.export_style)


class MathAgentWorkflow(MathAgentBase):
    """GSM8K with a calculator tool, through the engine's OpenAI-compatible client.

    Args:
        reward_fn: as :class:`~workflows.rlvr.RLVRWorkflow` (the GSM8K reward by
            default in ``rollout run``); called once per sample with ``prompt`` =
            the last request decoded, ``completions`` = the final answer's text,
            ``prompt_ids`` / ``completion_ids`` = the last request's ids and
            output, and the dataset item as keyword arguments.
        gconfig: sampling parameters; ``max_new_tokens`` is per turn,
            ``max_tokens`` caps a whole conversation (a sample ends when no
            budget is left); ``n_samples`` conversations run concurrently and
            their interactions are merged (use ``group_size`` for GRPO groups:
            reward normalization takes one reward per ``arun_episode``).
        tokenizer: a transformers tokenizer with a chat template, or a path.
        max_turns: completions per sample, >= 1.
        turn_discount: in ``[0, 1]``: ``apply_reward_discount`` (earlier turns
            get ``gamma ** k`` of the final reward).
        export_style: ``"concat"`` (one row per sample) or ``"individual"``
            (one row per completion).
        system_prompt: the system message (says how to call the tool and answer).
        tool_parser: the client's tool-call parser (``"hermes"``: ``<tool_call>`` JSON).
        enable_thinking, chat_template_kwargs: passed to the chat template.

    ``data`` holds ``"question"`` or ``"messages"`` (its last user message is
    the question); every key reaches the reward function.

    Returns from :meth:`arun_episode`: ``dict[completion id, Interaction]``.

    Raises:
        ValueError: ``max_turns < 1``, ``turn_discount`` outside ``[0, 1]`` or
            an unknown ``export_style``.
        RewardError: ``reward_fn`` cannot be resolved.
    """

    def _tool_parser(self, tool_parser: Any) -> Any:
        from engine.openai.tool_calls import resolve_tool_parser

        return resolve_tool_parser(tool_parser)

    def _opening(self, data: Mapping[str, Any]) -> list[dict[str, Any]]:
        system = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        return [*system, {"role": "user", "content": self._question_of(data)}]

    async def arun_episode(self, engine: EpisodeEngine, data: dict[str, Any]) -> dict[str, Any] | None:
        results = await gather_samples(self.gconfig.n_samples, lambda i: self._sample(engine, data, i))
        merged = {k: v for r in results for k, v in r.items()}
        return merged or None

    async def _sample(self, engine: EpisodeEngine, data: dict[str, Any], sample: int) -> dict[str, Any]:
        from engine.openai.client import EngineOpenAI

        client = EngineOpenAI(engine, self.tokenizer, gconfig=sample_gconfig(self.gconfig.new(n_samples=1), sample),
                              tool_parser=self.tool_parser, chat_template_kwargs=self.chat_template_kwargs)
        messages: list[Any] = self._opening(data)
        final = ""
        for turn in range(self.max_turns):
            try:
                completion = await client.chat.completions.create(messages=messages, tools=[CALCULATOR_TOOL])
            except InvalidRequestError:  # no token budget left for another turn: end with what we have
                if turn == 0:
                    raise
                break
            message = completion.choices[0].message
            messages.append(message)
            final = message.content or ""
            if not message.tool_calls:
                break
            for call in message.tool_calls:
                messages.append({"role": "tool", "tool_call_id": call.id,
                                 "content": _run_tool(call.function.name, call.function.arguments)})
        if client.cache.last is None:  # the loop above made at least one completion (turn 0 re-raises)
            raise RuntimeError("MathAgentWorkflow: no completion was recorded")
        return await self._scored(engine, client, final, data)

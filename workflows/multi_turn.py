"""Multi-turn "retry with feedback" (AReaL ``areal/workflow/multi_turn.py``), token-exact.

One sample of an episode::

    ids = chat_template(messages) + generation prompt         (loss_mask 0)
    for turn t in 0 .. max_turns - 1:
        resp = agenerate(ids)                                   sampled: loss_mask 1, turn id t
        reward = reward_fn(...)                                 in the reward pool
        stop when reward > 0, when turns run out, or when the token budget is spent
        ids += resp.output_tokens + delta(feedback message)    delta: loss_mask 0
    final reward = reward * turn_discount ** t

The delta is :func:`engine.chat.message_delta`: the ids of only the new
message (with the end-of-turn token of a turn cut by the budget, and the
template's glue), never a re-tokenization of the history.  When the chat
template renders the history differently from the ids sent, the episode keeps
its exact ids and reports a retokenization drift event (trajectory flag
``retokenization_drift`` and ``EngineStatistics.retokenization_drifts``).

Differences from AReaL: the loop continues while the reward is not positive
(AReaL: while it is exactly 0.0); ``n_samples > 1`` samples run concurrently as
in :class:`~workflows.rlvr.RLVRWorkflow` (AReaL enforces 1); an end-of-turn
token is added only where the template puts one (AReaL always appends the
tokenizer's EOS); the feedback ids are computed per turn from the real
conversation (AReaL: once, from a probe conversation) and checked.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

from engine.chat import TokenConversation
from engine.imports import resolve_reward_fn
from engine.trajectory import Injected, Sampled, build_trajectory
from engine.types import GenerationHyperparameters, ModelRequest
from engine.workflow import EpisodeEngine, RolloutWorkflow

from .base import sample_gconfig
from ._samples import check_max_turns, check_turn_discount, load_tokenizer, sample_rows, template_kwargs
from ._text import decode

__all__ = ["DEFAULT_FEEDBACK", "MultiTurnWorkflow"]

#: AReaL's feedback message.
DEFAULT_FEEDBACK = (
    "Your answer is either wrong or not parsable to the reward function. You may misunderstand the original "
    "question. Please carefully read the original question, check the previous errors, and try to answer it again."
)


class MultiTurnWorkflow(RolloutWorkflow):
    """Answer, get feedback when wrong, try again; one trajectory row per sample.

    Args:
        reward_fn: as :class:`~workflows.rlvr.RLVRWorkflow` (a callable or an
            import string, resolved and checked here).  Called once per turn with
            ``prompt`` = the decoded request (the whole conversation so far),
            ``completions`` = the decoded turn, ``prompt_ids`` / ``completion_ids``
            = the request's ids / the turn's ids, and the dataset item as
            keyword arguments.
        gconfig: sampling parameters (stop/pad ids of ``tokenizer`` merged in);
            ``n_samples`` samples per episode; ``max_new_tokens`` is per turn,
            ``max_tokens`` caps the whole conversation.
        tokenizer: a transformers tokenizer with a chat template, or a path.
        max_turns: attempts per sample, >= 1.
        turn_discount: in ``[0, 1]``; the final reward is multiplied by it once
            per extra turn.
        feedback: the user message appended after a turn whose reward is not
            positive.
        enable_thinking: passed to the chat template when not ``None``.
        chat_template_kwargs: more keyword arguments for the chat template.

    ``data`` must hold ``"messages"`` (the opening chat); every key reaches the
    reward function as a keyword argument.

    Returns from :meth:`arun_episode`: a trajectory of batch ``[n_samples]``
    holding each sample's whole conversation, with the fields of
    :data:`engine.data.TRAJECTORY_SCHEMA` (``loss_mask`` 1 exactly on sampled
    tokens; ``turn_ids`` the turn index on them, -1 elsewhere; ``versions`` -1
    on injected tokens; ``is_truncated``: the last turn stopped on the budget),
    plus ``reward_is_fallback [B] bool`` (some turn's reward was the pool's
    fallback), ``num_turns [B] int32`` and ``retokenization_drift [B] bool``
    (the template rendered the history differently from the ids sent, at least
    once).

    Raises:
        ValueError: ``max_turns`` not an int >= 1, or ``turn_discount`` not a number in ``[0, 1]``.
        RewardError: ``reward_fn`` cannot be resolved or sent to a worker process.
    """

    def __init__(
        self,
        reward_fn: Callable[..., Any] | str,
        gconfig: GenerationHyperparameters,
        tokenizer: Any,
        max_turns: int = 2,
        turn_discount: float = 1.0,
        feedback: str = DEFAULT_FEEDBACK,
        enable_thinking: bool | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        max_turns, turn_discount = check_max_turns(max_turns), check_turn_discount(turn_discount)
        if not isinstance(feedback, str):
            raise ValueError(f"feedback must be a string, got {type(feedback).__name__}")
        tokenizer = load_tokenizer(tokenizer)
        self.reward_fn = resolve_reward_fn(reward_fn)
        self.tokenizer = tokenizer
        self.gconfig = gconfig.new_with_stop_and_pad_token_ids(tokenizer)
        self.max_turns = max_turns
        self.turn_discount = turn_discount
        self.feedback = feedback
        self.chat_template_kwargs = template_kwargs(chat_template_kwargs, enable_thinking)
        self._sample_cfg = self.gconfig.new(n_samples=1)

    async def arun_episode(self, engine: EpisodeEngine, data: dict[str, Any]):
        if "messages" not in data:
            raise KeyError("MultiTurnWorkflow: the dataset item has no 'messages' (a chat to open with)")
        return await sample_rows(self.gconfig.n_samples, functools.partial(self._sample, engine, data))

    async def _sample(self, engine: EpisodeEngine, data: dict[str, Any], sample: int):
        tok, cfg = self.tokenizer, self._sample_cfg
        conv = TokenConversation(tok, data["messages"], chat_template_kwargs=self.chat_template_kwargs,
                                 stop_token_ids=cfg.stop_token_ids)
        segments: list[Any] = [Injected(conv.ids)]
        feedback = [{"role": "user", "content": self.feedback}]
        reward, fallback, discount, turns = 0.0, False, 1.0, 0
        while True:
            turn_cfg = sample_gconfig(cfg, sample, turns)  # samples and turns draw differently (seeded runs)
            resp = await engine.agenerate(ModelRequest(input_ids=conv.ids, gconfig=turn_cfg, tokenizer=tok))
            segments.append(Sampled(resp, turns))
            turns += 1
            scored = await engine.reward_pool.score(
                self.reward_fn, decode(tok, resp.input_tokens, False),
                decode(tok, resp.output_tokens, cfg.skip_special_tokens),
                resp.input_tokens, resp.output_tokens, **data)
            reward, fallback = scored.reward, fallback or scored.is_fallback
            if reward > 0 or turns >= self.max_turns:
                break
            conv.add_response(resp)
            delta = conv.append(feedback)
            if len(conv.ids) >= cfg.max_tokens:  # no budget left for another turn: end with this reward
                break
            segments.append(Injected(delta.ids))
            discount *= self.turn_discount
        return build_trajectory(segments, reward * discount, reward_is_fallback=fallback,
                                extra={"num_turns": turns, "retokenization_drift": conv.drift_events > 0})

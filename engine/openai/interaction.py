"""One completion made through the engine, and interaction dicts as trajectory rows.

An :class:`Interaction` is what AReaL calls ``InteractionWithTokenLogpReward``:
the request's messages, the exact prompt ids the engine sent, the
``ModelResponse`` (sampled ids, logprobs, per-token versions, stop reason),
the ``openai`` object returned to the caller, a reward, and the parent
interaction whose conversation this one continues.

``arun_episode`` may return ``dict[id, Interaction]`` (what
:meth:`engine.openai.InteractionCache.export_interactions` gives); the
executor turns it into trajectory rows with :func:`trajectory_from_interactions`,
one row per interaction (``build_trajectory`` segments):

=============  =============================================================
export style   row
=============  =============================================================
individual     ``[Injected(prompt ids), Sampled(response, turn = depth)]``:
               every earlier turn is part of the prompt (``loss_mask`` 0)
concat         the whole conversation from its root to this leaf:
               ``Injected(root prompt), Sampled(root, 0), Injected(delta 1),
               Sampled(turn 1, 1), ...``: ``loss_mask`` 1 exactly on sampled
               tokens; tool results, user turns and template glue are the
               injected deltas (``loss_mask`` 0)
=============  =============================================================

Per-row fields: those of :data:`engine.data.TRAJECTORY_SCHEMA` (``rewards``:
the interaction's reward, 0.0 when unset, as AReaL), plus ``num_turns [B]
int32`` (sampled turns in the row) and ``retokenization_drift [B] bool`` (a
request on the row's path re-tokenized history: :mod:`engine.chat`).

Reward normalization (``EngineConfig.reward_normalization``) of interaction
dicts follows AReaL's ``GroupedRolloutWorkflow._normalize_group_rewards``
(``areal/infra/remote_inf_engine.py``): each group member (one
``arun_episode`` call) has one episode-level reward, the reward of the *last*
interaction of its dict; those are z-scored across the group (population
std + 1e-8) and every row of a member gets its member's value (raw values are
kept in ``original_rewards``).  A member whose last interaction has no reward
makes the group's normalization impossible: the episode is rejected
(``"missing_reward"``), as AReaL drops such a group.  :func:`episode_reward`
and :func:`group_normalized_rewards` are those two steps.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..types import ModelResponse

__all__ = ["EXPORT_STYLES", "Interaction", "canonical_message", "episode_reward", "group_normalized_rewards",
           "to_plain_message", "trajectory_from_interactions"]

EXPORT_STYLES = ("individual", "concat")


def to_plain_message(message: Any) -> dict[str, Any]:
    """A message as a plain dict: an ``openai`` pydantic object
    (``ChatCompletionMessage``...) is dumped without its ``None`` fields; a
    mapping is copied.

    Raises:
        TypeError: neither a mapping nor a pydantic model.
    """
    if hasattr(message, "model_dump"):
        return message.model_dump(exclude_none=True, mode="json")
    if isinstance(message, Mapping):
        return dict(message)
    raise TypeError(f"a message must be a dict or an openai message object, got {type(message).__name__}")


def _text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, Sequence):  # content parts: the text ones, in order
        return "".join(p.get("text", "") for p in content if isinstance(p, Mapping) and p.get("type") == "text")
    return str(content)


def _arguments(arguments: Any) -> str:
    if isinstance(arguments, str):
        try:
            return json.dumps(json.loads(arguments), sort_keys=True)
        except json.JSONDecodeError:
            return arguments
    return json.dumps(arguments, sort_keys=True, default=str)


def canonical_message(message: Mapping[str, Any]) -> tuple:
    """A hashable key of what a message says, for matching a request's history
    against cached completions: role, text content (``None`` = ``""``, content
    parts joined), tool calls (id, name, arguments as sorted JSON), ``tool_call_id``
    and ``name``.  Fields a client adds on its way back (``refusal: None``,
    ``annotations``, ...) do not count."""
    calls = tuple((c.get("id"), (c.get("function") or {}).get("name"), _arguments((c.get("function") or {}).get("arguments")))
                  for c in (message.get("tool_calls") or ()))
    return (message.get("role"), _text(message.get("content")), calls, message.get("tool_call_id"), message.get("name"))


@dataclass(eq=False)
class Interaction:
    """One completion made through the engine (AReaL ``InteractionWithTokenLogpReward``).

    Attributes:
        id: the completion id (``chatcmpl-...`` / ``cmpl-...``), the key in caches and exports.
        response: the engine's ``ModelResponse``: ``input_tokens`` (the exact
            prompt ids sent), ``output_tokens``, ``output_logprobs``,
            ``output_versions`` (one per output token) and ``stop_reason``
            (``"tool_calls"`` when tool calls were parsed).
        messages: the request's messages as plain dicts (as the caller sent them).
        output_message: the assistant message returned to the caller (plain dict).
        template_messages: the conversation that ``response.input_tokens`` stands
            for, as rendered by the chat template (earlier assistant turns as
            their raw sampled text).
        raw_assistant: the assistant message that stands for this completion
            when a later request continues it (its sampled text, tool-call tags
            included).
        completion: the ``openai`` object returned (``ChatCompletion`` or ``Completion``).
        tools: the request's ``tools`` schema, or ``None``.
        parent: the interaction whose conversation this one continues, or ``None``.
        reward: set by ``InteractionCache.set_reward``; ``None`` until then.
        drift: the request re-tokenized history (a retokenization drift event).
        kind: ``"chat"`` or ``"completion"`` (``/v1/completions``; never a parent).
        export_style: how :meth:`to_trajectory` builds the row (set by an export).
        original_reward: the reward before a group normalization, when one was applied.
    """

    id: str
    response: ModelResponse
    messages: list[dict[str, Any]] = field(default_factory=list)
    output_message: dict[str, Any] = field(default_factory=dict)
    template_messages: list[dict[str, Any]] = field(default_factory=list)
    raw_assistant: dict[str, Any] = field(default_factory=dict)
    completion: Any = None
    tools: list[dict[str, Any]] | None = None
    parent: Interaction | None = None
    reward: float | None = None
    drift: bool = False
    kind: str = "chat"
    export_style: str = "individual"
    original_reward: float | None = None

    @property
    def input_ids(self) -> list[int]:
        return self.response.input_tokens

    @property
    def output_ids(self) -> list[int]:
        return self.response.output_tokens

    @property
    def stop_reason(self) -> str:
        return self.response.stop_reason

    def path(self) -> list[Interaction]:
        """This interaction's conversation: its root first, itself last."""
        chain: list[Interaction] = []
        node: Interaction | None = self
        while node is not None:
            chain.append(node)
            node = node.parent
        return chain[::-1]

    def conversation_key(self) -> tuple:
        """:func:`canonical_message` keys of ``messages + [output_message]``."""
        return (*map(canonical_message, self.messages), canonical_message(self.output_message))

    def to_trajectory(self, style: str | None = None) -> Any:
        """One trajectory row (batch ``[1]``) in ``style`` (default: ``export_style``);
        see the module docstring.

        Raises:
            ValueError: an unknown style, or (concat) a child whose prompt ids do
                not start with its parent's ids (cannot happen for interactions
                made by :class:`engine.openai.EngineOpenAI`).
        """
        from ..trajectory import Injected, Sampled, build_trajectory

        style = style or self.export_style
        if style not in EXPORT_STYLES:
            raise ValueError(f"style must be one of {EXPORT_STYLES}, got {style!r}")
        path = self.path()
        if style == "individual":
            segments: list[Any] = [Injected(self.input_ids), Sampled(self.response, len(path) - 1)]
            turns, drift = 1, self.drift
        else:
            segments, sent = [], 0
            for turn, node in enumerate(path):
                ids = node.input_ids
                if sent > len(ids) or (turn and ids[:sent] != _full_ids(path[turn - 1])):
                    raise ValueError(f"interaction {node.id}: its prompt ids do not extend its parent's "
                                     f"{path[turn - 1].id} ids; export it with style='individual'")
                segments += [Injected(ids[sent:]), Sampled(node.response, turn)]
                sent = len(ids) + node.response.output_len
            turns, drift = len(path), any(node.drift for node in path)
        reward = 0.0 if self.reward is None else float(self.reward)
        return build_trajectory(segments, reward, extra={"num_turns": turns, "retokenization_drift": drift})


def _full_ids(node: Interaction) -> list[int]:
    return node.input_ids + node.output_ids


def episode_reward(interactions: Mapping[str, Interaction]) -> float | None:
    """The episode-level reward of an interaction dict: the reward of its last
    interaction (insertion order), ``None`` when unset (AReaL's rule)."""
    if not interactions:
        return None
    last = interactions[next(reversed(tuple(interactions)))]
    return last.reward


def trajectory_from_interactions(interactions: Mapping[str, Interaction]) -> tuple[Any, float | None]:
    """``(trajectory, episode reward)`` of what ``arun_episode`` returned as a dict.

    Returns:
        The rows of every interaction (:meth:`Interaction.to_trajectory`, in
        the dict's order) padded into one ``TensorDict`` of batch ``[n]``, and
        :func:`episode_reward`; ``(None, None)`` for an empty dict (the episode
        is rejected, like a ``None`` return).

    Raises:
        TypeError: a value is not an :class:`Interaction` (names its key).
        ValueError: see :meth:`Interaction.to_trajectory`.
    """
    from ..data import concat_padded_tensors

    for key, value in interactions.items():
        if not isinstance(value, Interaction):
            raise TypeError(f"arun_episode returned a dict whose value at {key!r} is a {type(value).__name__}; a dict "
                            "must map completion ids to engine.openai.Interaction (export_interactions()), "
                            "else return a TensorDict")
    if not interactions:
        return None, None
    rows = [value.to_trajectory() for value in interactions.values()]
    traj = rows[0] if len(rows) == 1 else concat_padded_tensors(rows)
    return traj, episode_reward(interactions)


def group_normalized_rewards(rows_per_member: Sequence[int], member_rewards: Sequence[float]) -> Any:
    """``rewards [B] float32`` for a group whose member ``k`` has
    ``rows_per_member[k]`` rows and episode-level reward ``member_rewards[k]``:
    the members' rewards z-scored (population std + 1e-8), each repeated over
    its member's rows (AReaL ``_normalize_group_rewards``)."""
    import torch

    raw = torch.tensor([float(r) for r in member_rewards], dtype=torch.float32)  # [members]
    normalized = (raw - raw.mean()) / (raw.std(unbiased=False) + 1e-8)  # [members]
    return torch.repeat_interleave(normalized, torch.tensor(list(rows_per_member)))  # [B]

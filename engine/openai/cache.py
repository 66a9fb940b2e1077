"""The interactions of one episode, their conversation tree and their rewards.

Semantics of AReaL's ``InteractionCache`` (``areal/experimental/openai/cache.py``):

* insertion-ordered ``dict[id, Interaction]``;
* the **parent** of a new chat completion is the longest cached interaction
  whose ``messages + [its output message]`` is a prefix of the new request's
  messages (messages compared by :func:`~engine.openai.interaction.canonical_message`,
  or a ``message_key`` of your own);
* a reward per interaction (:meth:`InteractionCache.set_reward`) or for the
  last one (:meth:`~InteractionCache.set_last_reward`);
* :meth:`~InteractionCache.apply_reward_discount` may run once;
* :meth:`~InteractionCache.export_interactions` in the styles ``"individual"``
  (every interaction) and ``"concat"`` (only leaves, each a whole conversation).

Ours: the discount flows along parent links of the conversation tree: an
interaction's reward becomes ``own + gamma * (discounted reward of its latest
child)``.  On one linear conversation that is exactly AReaL's walk in reverse
creation order; with several conversations or branches in one cache AReaL's
walk would pass a reward between unrelated completions, this does not.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import replace
from typing import Any

from .interaction import EXPORT_STYLES, Interaction, canonical_message

__all__ = ["InteractionCache"]

logger = logging.getLogger(f"rollout.{__name__}")  # the package's one logging namespace


class InteractionCache(Mapping[str, Interaction]):
    """Completions of one episode (a ``Mapping`` of id -> :class:`Interaction`).

    Args:
        message_key: ``(message dict) -> hashable``: what makes two messages
            "the same" when matching a request against cached conversations
            (default :func:`~engine.openai.interaction.canonical_message`).
    """

    def __init__(self, message_key: Callable[[Mapping[str, Any]], Any] = canonical_message) -> None:
        self._items: dict[str, Interaction] = {}
        self._keys: dict[str, tuple] = {}  # id -> message keys of messages + output (chat only)
        self._children: dict[str, list[str]] = {}
        self.message_key = message_key
        self.discounted = False

    # -- Mapping -------------------------------------------------------------------
    def __getitem__(self, interaction_id: str) -> Interaction:
        return self._items[interaction_id]

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __repr__(self) -> str:
        return f"InteractionCache({len(self)} interactions)"

    @property
    def last(self) -> Interaction | None:
        """The newest interaction, or ``None``."""
        return self._items[next(reversed(self._items))] if self._items else None

    def children(self, interaction_id: str) -> list[Interaction]:
        """The interactions whose parent is ``interaction_id``, oldest first."""
        return [self._items[c] for c in self._children.get(interaction_id, ())]

    # -- building --------------------------------------------------------------------
    def find_parent(self, messages: Sequence[Mapping[str, Any]]) -> Interaction | None:
        """The longest chat interaction whose messages + output message is a
        prefix of ``messages`` (the newest among equally long ones), or ``None``."""
        keys = tuple(map(self.message_key, messages))
        best: Interaction | None = None
        best_len = 0
        for iid, conv in self._keys.items():
            n = len(conv)
            if best_len <= n <= len(keys) and keys[:n] == conv:
                best, best_len = self._items[iid], n
        return best

    def add(self, interaction: Interaction) -> None:
        """Insert a finished interaction (its ``parent``, if any, must be cached).

        Raises:
            ValueError: the id is already cached, or the parent is not in this cache.
        """
        if interaction.id in self._items:
            raise ValueError(f"interaction {interaction.id!r} is already cached")
        parent = interaction.parent
        if parent is not None and self._items.get(parent.id) is not parent:
            raise ValueError(f"interaction {interaction.id!r}: its parent {parent.id!r} is not in this cache")
        self._items[interaction.id] = interaction
        if interaction.kind == "chat":
            self._keys[interaction.id] = (*map(self.message_key, interaction.messages),
                                          self.message_key(interaction.output_message))
        if parent is not None:
            self._children.setdefault(parent.id, []).append(interaction.id)

    # -- rewards -----------------------------------------------------------------------
    def set_reward(self, interaction_id: str, reward: float) -> None:
        """Set one interaction's reward.

        Raises:
            KeyError: no such interaction.
            ValueError: ``reward`` is not a finite real number (a bool is refused).
        """
        if interaction_id not in self._items:
            raise KeyError(f"no interaction {interaction_id!r} in this cache ({len(self)} cached)")
        self._items[interaction_id].reward = _check_reward(reward)

    def set_last_reward(self, reward: float) -> None:
        """Set the newest interaction's reward.

        Raises:
            ValueError: the cache is empty, or ``reward`` is not a finite real number.
        """
        last = self.last
        if last is None:
            raise ValueError("set_last_reward: no interaction in this cache")
        last.reward = _check_reward(reward)

    def apply_reward_discount(self, turn_discount: float = 1.0) -> dict[str, float]:
        """Discount rewards back through the conversation tree, once.

        Newest first, each interaction's reward becomes ``own + turn_discount *
        (the discounted reward of its newest child)``; a missing reward counts
        as 0.0 (with a warning when the newest interaction has none).

        Returns:
            id -> discounted reward.

        Raises:
            ValueError: ``turn_discount`` is not in ``[0, 1]``.
            RuntimeError: called a second time.
        """
        if not (isinstance(turn_discount, (int, float)) and not isinstance(turn_discount, bool)
                and 0.0 <= turn_discount <= 1.0):
            raise ValueError(f"turn_discount must be a number in [0, 1], got {turn_discount!r}")
        if self.discounted:
            raise RuntimeError("apply_reward_discount may be called only once per cache")
        self.discounted = True
        last = self.last
        if last is not None and last.reward is None:
            logger.warning("apply_reward_discount: the last interaction %s has no reward; counted as 0.0", last.id)
        newest_child: dict[str, float] = {}  # parent id -> discounted reward of its newest child
        for iid in reversed(self._items):
            node = self._items[iid]
            value = (node.reward or 0.0) + turn_discount * newest_child.get(iid, 0.0)
            node.reward = value
            if node.parent is not None:
                newest_child.setdefault(node.parent.id, value)
        return {iid: node.reward or 0.0 for iid, node in self._items.items()}

    # -- export --------------------------------------------------------------------------
    def export_interactions(self, style: str = "individual", *,
                            drop_retry_orphans: bool = False) -> dict[str, Interaction]:
        """The interactions to train on, as ``dict[id, Interaction]`` (what
        ``arun_episode`` may return), insertion-ordered.

        Args:
            style: ``"individual"``: every interaction, each its own row;
                ``"concat"``: only leaves (no children), each row its whole
                conversation (:meth:`Interaction.to_trajectory`).
            drop_retry_orphans: leave out childless interactions whose request
                messages equal a later interaction's (an SDK that timed out and
                retried sent the same request twice; AReaL #1498).

        The values are copies carrying ``export_style``; the cache is unchanged.

        Raises:
            ValueError: an unknown style.
        """
        if style not in EXPORT_STYLES:
            raise ValueError(f"style must be one of {EXPORT_STYLES}, got {style!r}")
        items = list(self._items.values())
        dropped: set[str] = set()
        if drop_retry_orphans:
            later: set[tuple] = set()
            for node in reversed(items):
                key = (node.kind, tuple(map(self.message_key, node.messages)), tuple(node.input_ids))
                if key in later and not self._children.get(node.id):
                    dropped.add(node.id)
                later.add(key)
        out: dict[str, Interaction] = {}
        for node in items:
            if node.id in dropped or (style == "concat" and self._children.get(node.id)):
                continue
            out[node.id] = replace(node, export_style=style)
        return out


def _check_reward(reward: Any) -> float:
    if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
        raise ValueError(f"reward must be a finite real number, got {reward!r}")
    return float(reward)

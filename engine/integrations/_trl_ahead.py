"""Run-ahead for TRL: which prompts TRL's next generation calls will bring.

TRL pulls prompts from its own dataloader inside the training loop, so a rollout
function sees a call's prompts only when it is called.  To generate the next calls'
completions while TRL trains, :class:`Lookahead` walks a copy of TRL's training sampler
(``GRPOTrainer._get_train_sampler``: a ``RepeatSampler`` with ``args.seed``, so the copy
yields the same index sequence, epoch after epoch) in TRL's call pattern: one dataloader
batch (``generation_batch_size`` indices, each prompt ``num_generations`` times in a row)
per generation call, after which TRL reuses that batch for ``num_iterations *
steps_per_generation`` training steps (that many batches of the sampler are skipped).

A prediction is only a guess: the adapter compares it with the prompts TRL actually
passes and, at the first difference (a resumed run, a custom dataloader, a TRL version
with another call pattern), drops what it prefetched and stops running ahead.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Iterator
from typing import Any

from ..errors import InvalidRequestError
from ._trl_groups import Episodes, Group
from ._trl_rows import episode_data

__all__ = ["Lookahead", "RunAhead"]

logger = logging.getLogger(f"rollout.{__name__}")


class Lookahead:
    """The predicted prompt indices of TRL's generation calls, in order.

    Raises:
        InvalidRequestError: the training dataset is not map-style (an ``IterableDataset``
            cannot be replayed), or the trainer has no train sampler to copy.
    """

    def __init__(self, trainer: Any) -> None:
        dataset = trainer.train_dataset
        if dataset is None or not hasattr(dataset, "__getitem__") or not hasattr(dataset, "__len__"):
            raise InvalidRequestError(
                "rollout_func run-ahead (TRLRolloutConfig(max_staleness>=1)) needs a map-style train_dataset "
                f"(got {type(dataset).__name__}): use max_staleness=0 with an iterable dataset")
        self.dataset = dataset
        args = trainer.args
        self.per_call = int(args.generation_batch_size)  # one process (checked by check_run_ahead)
        self.stride = self.per_call * int(trainer.num_iterations) * int(args.steps_per_generation)
        self._indices = self._forever(trainer._get_train_sampler(dataset))

    @staticmethod
    def _forever(sampler: Any) -> Iterator[int]:
        while True:  # one pass per epoch: the sampler's generator carries on, as TRL's does
            empty = True
            for index in sampler:
                empty = False
                yield int(index)
            if empty:
                return

    def next_call(self) -> list[int] | None:
        """The dataset indices of the next generation call (``per_call`` of them), or None
        when the sampler is empty."""
        taken = [index for _, index in zip(range(self.stride), self._indices)]
        if len(taken) < self.stride:
            return None
        return taken[: self.per_call]

    def rows(self, indices: list[int]) -> list[dict[str, Any]]:
        """The dataset rows at ``indices`` (dicts of every column)."""
        return [dict(self.dataset[i]) for i in indices]


class RunAhead:
    """The calls submitted ahead (at most ``depth``), matched against TRL's actual prompts.

    Attributes:
        hits: training calls served by prefetched episodes.
        misses: predictions that did not match (run-ahead then stops for good).
    """

    def __init__(self, lookahead: Lookahead, depth: int, episodes: Episodes) -> None:
        self.lookahead: Lookahead | None = lookahead
        self.depth = depth
        self.episodes = episodes
        self.ahead: deque[tuple[list[Any], list[Group]]] = deque()
        self.hits = 0
        self.misses = 0
        self._aligned = False

    def take(self, prompts: list[Any]) -> list[Group] | None:
        """The groups prefetched for this training call, or None (then generate them now)."""
        if self.lookahead is None:
            return None
        if not self._aligned:  # the first training call: is it the sampler's first batch?
            self._aligned = True
            indices = self.lookahead.next_call()
            if indices is None or [self.lookahead.dataset[i]["prompt"] for i in indices] != prompts:
                self._stop("the first call's prompts are not the sampler's first batch")
            return None
        if not self.ahead:
            return None
        predicted, groups = self.ahead[0]
        if predicted != prompts:
            self._stop("TRL's prompts differ from the predicted ones")
            return None
        self.ahead.popleft()
        self.hits += 1
        return groups

    def top_up(self, processing_class: Any, group: int) -> None:
        """Submit the next calls' groups until ``depth`` calls are ahead."""
        while self.lookahead is not None and len(self.ahead) < self.depth:
            indices = self.lookahead.next_call()
            if indices is None:
                return
            rows = self.lookahead.rows(indices)
            prompts = [r["prompt"] for r in rows]
            groups = [Group(prompts[s], episode_data(prompts[s], rows[s], processing_class), group)
                      for s in range(0, len(prompts), group)]
            for g in groups:
                self.episodes.submit(g, group)
            self.ahead.append((prompts, groups))

    def discard(self, timeout_s: float) -> None:
        """Wait for every prefetched episode and drop it."""
        while self.ahead:
            self.episodes.drop(self.ahead.popleft()[1], timeout_s)

    def _stop(self, why: str) -> None:
        self.misses += 1
        logger.warning("rollout_func: run-ahead stops: %s (a resumed run or a custom dataloader?)", why)
        self.lookahead = None
        self.discard(600.0)

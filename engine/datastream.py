"""Where :meth:`RolloutEngine.prepare_batch` is in its dataloader: the data position, made explicit.

A :class:`DataStream` wraps the dataloader a trainer hands to ``prepare_batch`` and
hands out one dataset item at a time:

* A yielded ``list`` / ``tuple`` is a batch of items (a ``DataLoader`` with
  ``collate_fn=lambda rows: rows``); its items are handed out one by one.
* A re-iterable source (a list, a ``datasets.Dataset``, a ``DataLoader``) is cycled
  in epochs: ``epoch`` counts completed passes, ``position`` the items taken in the
  current one.
* A one-pass source (a generator or any other iterator) is read once; when it runs
  out the stream is ``exhausted`` (``prepare_batch`` then returns what is left and
  afterwards raises :class:`~engine.errors.DataExhaustedError`).

The engine keeps one stream (``engine.data_stream``) and holds a strong reference
to its source, so a recycled object id can never continue a stale iterator, and a
*different* object passed to ``prepare_batch`` is an error (a fresh list per call
would otherwise restart at item 0 and repeat prompts).  AReaL keeps one iterator per
executor and silently ignores later dataloaders (``WorkflowExecutor.prepare_batch``).

A torch ``DataLoader`` with its default collate turns a batch of rows into one dict
of lists (chat rows become ``{"role": ["user", "user"], ...}``); it is refused when
the stream is created, with the fix in the message, and so is any item that is such
a batch (an iterator over the loader, ``list(loader)``; :mod:`engine._collated`).
"""

from __future__ import annotations

import collections
from collections.abc import Iterable, Iterator
from typing import Any

from ._collated import ROWS_FIX, check_item
from .errors import DatasetError

__all__ = ["DataStream"]

def _check_source(source: Any) -> None:
    """Refuse sources that cannot be a dataloader of rows (``DatasetError``, a ``ValueError``)."""
    if isinstance(source, (str, bytes, dict)) or source is None:
        raise DatasetError(f"prepare_batch: dataloader must be an iterable of dataset items, got "
                           f"{type(source).__name__} (a dict here is usually a collated batch)")
    if not isinstance(source, Iterable):
        raise DatasetError(f"prepare_batch: dataloader must be iterable, got {type(source).__name__}")
    loader_cls = _torch_dataloader_class()
    if loader_cls is not None and isinstance(source, loader_cls):
        from torch.utils.data import default_collate

        loader: Any = source  # a torch DataLoader (checked above)
        if loader.batch_sampler is not None and loader.collate_fn is default_collate:
            raise DatasetError(
                f"prepare_batch: this torch DataLoader (batch_size={loader.batch_size}) uses the default "
                "collate, which turns a batch of rows into one dict of lists (chat roles ['user', 'user'], "
                "answers as lists); pass collate_fn=lambda rows: rows (batches as lists of rows) or "
                "batch_size=None (one row at a time)")


def _torch_dataloader_class() -> type | None:
    import sys

    torch_data = sys.modules.get("torch.utils.data")  # never import torch just for this check
    return getattr(torch_data, "DataLoader", None)


class DataStream:
    """The position of ``prepare_batch`` in one dataloader.

    Args:
        source: an iterable of dataset items, or of lists/tuples of items.

    Attributes:
        source: the dataloader (held, so its id cannot be recycled).
        one_pass: ``True`` for an iterator (read once, never cycled).
        epoch: completed passes over a re-iterable source.
        position: items taken in the current pass.
        items_taken: items taken in all passes.
        exhausted: a one-pass source has run out.

    Raises:
        DatasetError: ``source`` is not an iterable of items, or is a torch
            ``DataLoader`` with the default collate.
    """

    def __init__(self, source: Iterable[Any]) -> None:
        _check_source(source)
        self.source = source
        self.one_pass = isinstance(source, Iterator)
        self.epoch = 0
        self.position = 0
        self.items_taken = 0
        self.exhausted = False
        self._it: Iterator[Any] | None = None
        self._batch: collections.deque[Any] = collections.deque()

    def __repr__(self) -> str:
        kind = "one-pass" if self.one_pass else f"epoch {self.epoch}"
        return f"<DataStream over {type(self.source).__name__}: {kind}, position {self.position}>"

    def take(self) -> tuple[bool, Any]:
        """The next item: ``(True, item)``, or ``(False, None)`` once a one-pass source
        is exhausted.  Errors raised by the source propagate.

        Raises:
            DatasetError: a whole pass yielded no items, or an item is a collated batch.
        """
        while not self._batch:
            if self.exhausted:
                return False, None
            if self._it is None:
                self._it = iter(self.source)
            try:
                element = next(self._it)
            except StopIteration:
                self._it = None
                if self.one_pass:
                    if self.items_taken == 0:
                        raise DatasetError("prepare_batch: the dataloader yielded no items") from None
                    self.exhausted = True
                    return False, None
                if self.position == 0:
                    raise DatasetError("prepare_batch: the dataloader yielded no items (a whole pass)") from None
                self.epoch += 1
                self.position = 0
                continue
            if isinstance(element, (list, tuple)):
                self._batch.extend(element)
            else:
                self._batch.append(element)
        item = self._batch.popleft()
        check_item(item, "prepare_batch: item %d of epoch %d", ROWS_FIX, self.position, self.epoch)
        self.position += 1
        self.items_taken += 1
        return True, item

    def state_dict(self) -> dict[str, Any]:
        """``{"epoch", "position", "items_taken", "exhausted"}``: plain ints/bools."""
        return {"epoch": self.epoch, "position": self.position, "items_taken": self.items_taken,
                "exhausted": self.exhausted}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue at a saved position: skips ``position`` items of a fresh pass.

        Only meaningful when the source yields the same order in that epoch (a
        shuffling ``DataLoader`` needs its sampler's generator seeded per epoch).
        For a one-pass source the skipped items are read and dropped.

        Raises:
            DatasetError: the source has fewer items than ``position``.
        """
        self.epoch, self.items_taken = int(state["epoch"]), int(state["items_taken"])
        self.exhausted = bool(state.get("exhausted", False))
        self._it, self._batch, self.position = None, collections.deque(), 0
        target = int(state["position"])
        while self.position < target:
            ok, _ = self.take()
            if not ok:
                raise DatasetError(f"DataStream.load_state_dict: the source ended at item {self.position}, "
                                   f"before the saved position {target}")
        self.items_taken = int(state["items_taken"])

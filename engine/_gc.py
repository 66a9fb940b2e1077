"""Garbage-collector settings while rollout engines are open (opt-in).

An episode allocates and frees many short-lived containers (request, response,
token lists, tensors, trio tasks), and a process that has imported torch and
transformers and loaded a tokenizer holds hundreds of thousands of long-lived
objects.  With CPython's default thresholds (700 allocations for the youngest
generation) the collector ran about one young collection per 15 episodes and a
full collection every few seconds that scanned every long-lived object
(0.1-0.3 s pauses on 2 cores with 256 episodes in flight).  Measured with
``rollout bench`` (3000 episodes, 256 in flight, 2-core box): CPU per episode
1.97 -> 1.57 ms at zero latency, efficiency 0.885 -> 0.936 at 50 ms + 2 ms/token.

The GC is process-wide, so a library must not change it behind its host's back:
tuning is off by default (``EngineConfig.gc_tuning=False``); ``rollout run`` and
the benchmarks opt in.  While at least one engine with ``gc_tuning=True`` is open:

* if nothing is frozen yet, the objects alive when the first engine opens go to
  the permanent generation (:func:`gc.freeze`), so full collections scan only
  what the run allocates; if the host already froze objects itself, nothing more
  is frozen (the permanent generation is the host's);
* the youngest generation's threshold is raised to :data:`GEN0_THRESHOLD`.

When the last such engine closes, the previous state comes back exactly:

* the thresholds are restored, unless the host set its own meanwhile (kept);
* the objects *we* froze are returned to the oldest generation
  (:func:`gc.unfreeze`), unless the host called :func:`gc.freeze` meanwhile (a
  sentinel object created after our freeze tells: then everything stays frozen,
  since unfreezing would release the host's objects too).  Objects the host froze
  before are never unfrozen.

Nested or concurrent engines share the settings (reference counted).
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

__all__ = ["GEN0_THRESHOLD", "gc_tuned"]

GEN0_THRESHOLD = 10_000  # allocations between young collections (CPython default: 700)


class _Sentinel:
    """Created right after our freeze: frozen later only if the host froze again."""


@dataclass
class _Saved:
    threshold: tuple[int, ...]
    tuned: tuple[int, ...]
    sentinel: _Sentinel | None  # None: we froze nothing


_lock = threading.Lock()
_depth = 0
_saved: _Saved | None = None


def _is_frozen(obj: object) -> bool:
    """Whether ``obj`` (a GC-tracked object) is in the permanent generation:
    :func:`gc.get_objects` lists every generation but that one (one pass, ~20 ms
    for 200k objects; once per close)."""
    return not any(o is obj for o in gc.get_objects())


def _enter() -> None:
    global _saved
    threshold = gc.get_threshold()
    sentinel = None
    if gc.get_freeze_count() == 0:  # the host froze nothing: the permanent generation is ours to use
        gc.freeze()
        sentinel = _Sentinel()
    tuned = (max(threshold[0], GEN0_THRESHOLD), *threshold[1:])
    gc.set_threshold(*tuned)
    _saved = _Saved(threshold, tuned, sentinel)


def _exit() -> None:
    global _saved
    saved, _saved = _saved, None
    if saved is None:
        return
    if gc.get_threshold() == saved.tuned:  # else the host set its own: keep it
        gc.set_threshold(*saved.threshold)
    if saved.sentinel is not None and not _is_frozen(saved.sentinel):
        gc.unfreeze()  # only what we froze is frozen: give it back


@contextmanager
def gc_tuned(enabled: bool = True) -> Iterator[None]:
    """Apply the engine's GC settings for the duration of the block (no-op when
    ``enabled`` is false).  Re-entrant and thread-safe; see the module docstring
    for what is restored on exit."""
    global _depth
    if not enabled:
        yield
        return
    with _lock:
        if _depth == 0:
            _enter()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                _exit()

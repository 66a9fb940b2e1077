"""Weight updates across engine shards (``ShardedRolloutEngine.update_weights``).

Two cases, told apart by each shard's backend (reported in its ``ready`` message):

* the model lives in each shard's process (``sim``, ``hf``; the default): every shard
  runs its own engine's ``update_weights`` (pause, load, set the version, resume), all
  at once;
* the weights live in servers outside the shards, which every shard's client talks to
  (the remote ``sglang`` / ``vllm`` clients:
  ``InferenceBackend.weights_shared_across_clients`` is True there, False by default):
  the servers must load once, not once per shard.  Every live shard
  pauses its backend (``mode``: abort or in place); when all have, ONE shard (the
  first live one) performs the backend's ``update_weights``; then every shard sets the
  version and resumes its backend.  A shard that dies meanwhile is left out (its
  episodes run again elsewhere); if the loading shard dies, the next live one loads.

Shard calls (:mod:`engine.shards._shard_main`): ``weights_pause(mode)``,
``weights_load(source, version, mode)``, ``weights_resume(version | None)`` (None:
resume without a new version, after a failure).
"""

from __future__ import annotations

from typing import Any

from ..errors import BackendError
from ..executor import RolloutEngine

__all__ = ["update_shared_weights", "weights_error"]


def weights_error(failed: list[tuple[int, BaseException]], step: str = "") -> BackendError:
    """The error of a failed update: names the first shard that failed (and how many more)."""
    failed = sorted(failed, key=lambda f: f[0])
    i, exc = failed[0]
    return BackendError(f"update_weights failed on engine shard {i}{f' ({step})' if step else ''}"
                        f"{f' (and {len(failed) - 1} more)' if len(failed) > 1 else ''}: "
                        f"{type(exc).__name__}: {exc}")


def _raise_failures(engine: Any, outcomes: dict[int, tuple[bool, Any]], step: str) -> None:
    """Raise for the shards that failed ``step`` and are still alive (a dead one is left out)."""
    failed = [(i, value) for i, (ok, value) in outcomes.items() if not ok and engine._shards[i].alive]
    if failed:
        raise weights_error(failed, step) from failed[0][1]


async def update_shared_weights(engine: Any, source: Any, version: int, mode: str) -> None:
    """Pause every shard's backend, load once (the first live shard), then set the
    version and resume on every shard (see the module docstring).  Call it with the
    coordinator paused.

    Raises:
        BackendError: a shard failed to pause, the load failed (the old weights and
            version stay; every shard resumes), a shard failed to resume (the version
            is already the new one, as with one engine), or no shard is alive.
    """
    try:
        _raise_failures(engine, await engine._call_all("weights_pause", (mode,)), "pause")
        await _load_once(engine, source, version, mode)
    except Exception:
        await engine._call_all("weights_resume", (None,))  # (errors here would hide the first one)
        raise
    RolloutEngine.set_version(engine, version)  # (not the coordinator's: the shards set theirs below)
    _raise_failures(engine, await engine._call_all("weights_resume", (version,)), "resume")


async def _load_once(engine: Any, source: Any, version: int, mode: str) -> None:
    for shard in list(engine._live):
        ok, value = await engine._call(shard, "weights_load", (source, version, mode))
        if ok:
            return
        if shard.alive:
            raise weights_error([(shard.index, value)], "load") from value
    raise BackendError("update_weights: no engine shard is alive to load the weights")

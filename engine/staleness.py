"""Admission control: how many more episodes may start now.

The capacity formula is AReaL's (``areal/infra/staleness_manager.py``)::

    capacity = min(C - running, (eta + v + 1) * B - (accepted + running))

with ``C = max_concurrent_rollouts``, ``B = consumer_batch_size``,
``eta = max_head_offpolicyness``, ``v`` the current policy version, ``running``
the episodes started and not yet ended, and ``accepted`` the episodes accepted so
far.  Rejected (and failed) episodes do not count, so heavy filtering does not
throttle generation.  The second term bounds how far generation may run ahead of
training: with ``eta = 0`` the engine produces exactly the next batch for version
``v``.  ``eta = None`` disables the staleness bound (capacity is ``C - running``).
After a restore at version ``r`` the count of accepted episodes is reset to
``r * B`` (AReaL issue #1388: without it staleness runs away).

Ours: a scheduling policy that over-provisions (``EngineConfig.scheduling``
``"overprovision"`` / ``"tail_batching"``: each step runs ``E = ceil((1 + r) * B)``
groups to hand out ``B``) adds its ``E - B`` extra episodes to the second term
(``extra``); the bound on what is trained on is unchanged, since every result is
checked against ``eta`` when it ends and at each version change
(:mod:`engine._admission`).

Units: episodes (one ``submit`` call, whatever its group size).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["StalenessManager", "staleness_capacity"]


def staleness_capacity(*, max_concurrent: int, consumer_batch_size: int, max_head_offpolicyness: int | None,
                       version: int, running: int, accepted: int, extra: int = 0) -> int:
    """The formula in the module docstring; may be negative (no room)."""
    room = max_concurrent - running
    if max_head_offpolicyness is None:
        return room
    ahead = (max_head_offpolicyness + version + 1) * consumer_batch_size + extra - (accepted + running)
    return min(room, ahead)


@dataclass
class StalenessManager:
    """Counters behind the capacity formula (sync; the executor calls it).

    ``accepted`` here is the staleness counter (reset by :meth:`restore`), not the
    lifetime count reported by ``RolloutEngine.statistics``.  The version is not
    stored here: the backend owns it, and callers pass it in.
    """

    max_concurrent: int
    consumer_batch_size: int
    max_head_offpolicyness: int | None
    running: int = 0
    accepted: int = 0
    extra: int = 0  #: over-provisioned episodes allowed beyond the bound (see the module docstring)

    def capacity(self, version: int) -> int:
        return staleness_capacity(
            max_concurrent=self.max_concurrent, consumer_batch_size=self.consumer_batch_size,
            max_head_offpolicyness=self.max_head_offpolicyness, version=version,
            running=self.running, accepted=self.accepted, extra=self.extra,
        )

    def restore(self, version: int) -> None:
        """Resume from a checkpoint taken at ``version``: ``accepted = version * B``."""
        self.accepted = version * self.consumer_batch_size

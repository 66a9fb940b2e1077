"""Helpers for writing workflows: :func:`sample_gconfig` (a request's sampling config
inside ``arun_episode``).  The contract itself is :class:`engine.workflow.RolloutWorkflow`
(also ``workflows.RolloutWorkflow``)."""

from __future__ import annotations

from typing import Any

__all__ = ["sample_gconfig"]


def sample_gconfig(gconfig: Any, sample: int, *extra: int) -> Any:
    """The sampling config of one request of the running episode.

    With ``gconfig.seed`` set (the run seed), a copy whose seed is
    ``derive_seed(run_seed, task_id, group_sample, sample, *extra)``, so the samples of
    a prompt (and the turns of a sample: pass the turn as ``extra``) differ while a
    seeded run repeats; without a seed, ``gconfig`` itself.  Call it inside
    ``arun_episode`` (it reads the episode's task id and group sample index).
    """
    if gconfig.seed is None:
        return gconfig
    from engine.context import episode_id, sample_index
    from engine.types import derive_seed

    return gconfig.new(seed=derive_seed(gconfig.seed, episode_id.get(), sample_index.get(), sample, *extra))

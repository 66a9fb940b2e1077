"""What a workflow can read about the episode it runs in (trio-task-local context variables,
set by the engine before ``arun_episode`` is called)."""

from __future__ import annotations

import contextvars

__all__ = ["episode_id", "sample_index"]

#: Inside ``arun_episode``: this member's sample index within its group (0 for
#: ``group_size=1``).  Workflows may read it, e.g. to vary a per-sample seed.
sample_index: contextvars.ContextVar[int] = contextvars.ContextVar("sample_index", default=0)
#: Inside an episode: its task id (remote backends route every request of an
#: episode to the same server, to reuse its prefix cache).
episode_id: contextvars.ContextVar[int | None] = contextvars.ContextVar("episode_id", default=None)

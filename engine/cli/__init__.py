"""The ``rollout`` application (console script ``rollout = engine.cli:main``).

- :mod:`engine.cli._main`: :func:`main`, the exit statuses and the one-line messages;
- :mod:`engine.cli._parser`: the argument parser and the option types;
  :mod:`engine.cli._options`, :mod:`engine.cli._workflow`: the user-run options and the
  ``--workflow``/``--reward`` plan; :mod:`engine.cli._config_file`: ``--config`` TOML files;
- :mod:`engine.cli._run`: one run; :mod:`engine.cli._backend`: the backend and the engine
  it opens; :mod:`engine.cli._signals`: SIGINT/SIGTERM;
- :mod:`engine.cli._journal`: the run folder and ``--resume``; :mod:`engine.cli.outputs`:
  the outputs and their loaders (:func:`load_trajectories`, :func:`load_rollouts`);
- :mod:`engine.cli._monitor`, :mod:`engine.cli._live`, :mod:`engine.cli._metrics`: the
  run's snapshot, live view and Prometheus endpoint; :mod:`engine.cli._report`:
  ``rollout report``.

A run folder is loaded from here: ``from engine.cli import load_trajectories``.

May import: anything in ``engine``, ``workflows`` and ``rewards``; the ``benchmarks``
package only inside ``rollout bench``'s function (it is an application of the engine,
installed beside it).  Nothing below imports this package.  Names resolve on first
access, so ``import engine.cli`` is cheap."""

from __future__ import annotations

from typing import TYPE_CHECKING

__all__ = [
    "load_rollouts",
    "load_trajectories",
    "main",
]

_LAZY = {
    "load_rollouts": "engine.cli.outputs",
    "load_trajectories": "engine.cli.outputs",
    "main": "engine.cli._main",
}

if TYPE_CHECKING:
    from ._main import main
    from .outputs import load_rollouts, load_trajectories

from engine.lazy import lazy_exports  # noqa: E402

__getattr__, __dir__ = lazy_exports(globals(), _LAZY)

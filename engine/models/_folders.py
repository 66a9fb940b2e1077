"""Atomic, locked folder builds: the model cache (:mod:`engine.models`) and the tiny test
models (:mod:`engine.testing`) both write model folders this way.

:func:`atomic_build` writes a folder into a temporary sibling, adds a marker file, and
renames it into place while holding an ``flock`` on the parent folder, so an interrupted
build never leaves a half folder and two processes never build the same folder twice.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from engine.errors import InvalidRequestError

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows: no lock, the atomic rename still holds
    fcntl = None  # type: ignore[assignment]

__all__ = ["MARKER_NAME", "atomic_build", "dir_lock", "is_complete"]

logger = logging.getLogger(f"rollout.{__name__}")  # the package's one logging namespace

#: Written last into every folder built here; its presence means "complete".
MARKER_NAME = ".trio-rollout-complete"


def is_complete(dest: Path) -> bool:
    """True when ``dest`` was fully built (its marker file exists)."""
    return (dest / MARKER_NAME).is_file()


def atomic_build(
    dest: str | os.PathLike[str],
    build: Callable[[Path], dict | None],
    *,
    owned: bool = False,
) -> Path:
    """Build folder ``dest`` once, atomically, and return it.

    ``build(tmp)`` fills the empty folder ``tmp`` (a sibling of ``dest``) and may return a
    JSON-able dict stored in the marker. Then the marker is written and ``tmp`` renamed to
    ``dest``. If ``dest`` is complete already (before or after taking the lock) nothing is
    built. An existing incomplete ``dest`` is removed when ``owned`` (a cache folder this
    package owns); otherwise it must be empty, else :class:`InvalidRequestError`.
    """
    dest = Path(dest).expanduser()
    if is_complete(dest):
        return dest
    parent = dest.parent
    parent.mkdir(parents=True, exist_ok=True)
    with dir_lock(parent):
        if is_complete(dest):
            return dest
        if dest.exists():
            if owned:
                logger.warning("removing incomplete folder %s", dest)
                shutil.rmtree(dest)
            elif not dest.is_dir() or any(dest.iterdir()):
                raise InvalidRequestError(
                    f"path: {str(dest)!r} exists and is not a complete trio-rollout build; "
                    "remove it or choose an empty path"
                )
        tmp_prefix = f".{dest.name}.tmp-"
        for stale in parent.glob(tmp_prefix + "*"):  # left by a killed build; we hold the lock
            shutil.rmtree(stale, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=tmp_prefix, dir=parent))
        try:
            info = build(tmp) or {}
            marker = {"built_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), **info}
            (tmp / MARKER_NAME).write_text(json.dumps(marker, indent=1, sort_keys=True) + "\n")
            os.chmod(tmp, 0o755)  # mkdtemp made it 0700
            for file in tmp.iterdir():
                if file.is_file():
                    os.chmod(file, 0o644)  # safetensors writes 0600
            os.replace(tmp, dest)  # dest is absent or an empty directory here
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return dest


@contextlib.contextmanager
def dir_lock(directory: Path) -> Iterator[None]:
    """Exclusive ``flock`` on ``directory`` itself (no lock file left behind)."""
    if fcntl is None:  # pragma: no cover
        yield
        return
    fd = os.open(directory, os.O_RDONLY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.info("waiting for another process building in %s", directory)
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock

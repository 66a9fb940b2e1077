"""``rollout run``'s deadlines (issue 24): how long a run waits with no healthy server, for
one generation attempt and for a whole episode; and what a run that ran out of servers
says and returns.

The values go to the settings objects of the components that own them:
``--no-server-timeout`` and ``--attempt-timeout`` to the remote backend's
:class:`~engine.backends.remote.RemoteTimeouts` (``no_server_timeout_s``,
``attempt_timeout_s``; ``--request-timeout`` and ``--startup-timeout`` are its
``request_timeout_s`` and ``startup_timeout_s``), ``--episode-timeout`` to
:class:`~engine.executor.EngineConfig` (``episode_timeout_s``).  Each is validated
there too (a negative or NaN value: a ``ValueError`` naming the field).
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Any

__all__ = ["EXIT_BACKEND_UNAVAILABLE", "add_deadline_arguments", "remote_deadlines", "unavailable_line"]

#: ``rollout run``'s exit status when episodes failed for want of a server (sysexits.h's
#: EX_TEMPFAIL: a temporary failure, try again later: ``rollout run --resume OUT``).
EXIT_BACKEND_UNAVAILABLE = 75


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds > 0, got {text}")
    return value


def add_deadline_arguments(run: argparse.ArgumentParser) -> None:
    """Add ``--no-server-timeout``, ``--attempt-timeout`` and ``--episode-timeout``."""
    group = run.add_argument_group(
        "deadlines (seconds; with --request-timeout and --startup-timeout: no wait is unbounded)")
    group.add_argument("--no-server-timeout", type=_seconds, default=300.0, metavar="SECONDS",
                       help="--backend sglang|vllm: how long requests wait while no server is healthy (every "
                            "one down), from the moment the last one was lost; a server back meanwhile is used "
                            "again; a warning every 30 s names each down server and its last error. Then the "
                            "episodes in flight and queued fail backend_unavailable and the run ends with exit "
                            f"status {EXIT_BACKEND_UNAVAILABLE} and one line; what completed is kept and "
                            "--resume runs the rest (default 300)")
    group.add_argument("--attempt-timeout", type=_seconds, default=1800.0, metavar="SECONDS",
                       help="--backend sglang|vllm: one whole generation attempt on one server (a server that "
                            "accepts the request and never answers): it is aborted and retried, on another healthy "
                            "server at once if there is one; a request whose last attempt timed out fails "
                            "backend_timeout (--resume runs it again). It caps the whole generation, not the "
                            "first token: keep it above the longest legitimate generation on a loaded server "
                            "(default 1800)")
    group.add_argument("--episode-timeout", type=_seconds, default=None, metavar="SECONDS",
                       help="a whole episode's deadline: past it the episode is cancelled and fails "
                            "episode_timeout (default: none; every wait inside an episode has its own deadline)")


def remote_deadlines(args: argparse.Namespace) -> dict[str, Any]:
    """The :class:`~engine.backends.remote.RemoteTimeouts` fields these options set (for
    ``make_remote_backend``; an option a caller's namespace lacks keeps the default)."""
    return {"no_server_timeout_s": getattr(args, "no_server_timeout", None),
            "attempt_timeout_s": getattr(args, "attempt_timeout", None)}


def unavailable_line(summary: dict[str, Any], out: Path) -> str:
    """The one line of a run whose episodes failed ``backend_unavailable``: the servers and
    their last errors (from the last such failure), items done and left, how to go on."""
    failures = [f for f in summary.get("failures") or () if f.get("reason") == "backend_unavailable"]
    why = " ".join(str(failures[-1]["error_message"]).split()) if failures else "no healthy server"
    done, items = summary["items_done"], summary["items"]
    return (f"{why}; {done}/{items} items done, {items - done} left; continue with: rollout run --resume {out} "
            "--server URL (--no-server-timeout: how long to wait for a server)")

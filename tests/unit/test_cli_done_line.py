"""The line ``rollout run`` prints at the end (``engine.cli._main._done_line``).

Regression (new-user trial): after ``--resume`` of a ``--group-size 2`` run the line read
"32/48 episodes accepted": users read 48 as dataset items (the run had 32); it counts the
run's items now, and names the episodes submitted only when some were submitted again.

Regression: after ``kill -9`` and ``--resume``, the line read "32/48 episodes
accepted" for a run whose 32 items all ended accepted: the 16 episodes the killed
segment had not committed (``lost``, run again) looked like 16 failures; the same
for the episodes a SIGINT cancelled (``cancelled``).  Regression (new-user trial):
the note said "interrupted and run again", but ``cancelled`` also counts episodes
that were still queued (never started): it now says what is true of all of them.
"""

from __future__ import annotations

from engine.cli._main import _done_line

BASE = {"accepted": 32, "submitted": 48, "items": 32, "items_done": 32, "trajectories": 64, "reward_mean": 0.5, "generated_tokens": 1090,
        "wall_seconds": 2.7, "generated_tokens_per_second": 408.0}


def test_lost_episodes_are_named() -> None:
    line = _done_line({**BASE, "lost": 16, "cancelled": 0})
    assert line.startswith("32/32 items accepted (48 episodes submitted, 16 again after an interruption), "
                           "64 trajectories")


def test_cancelled_episodes_of_an_interrupted_segment_are_named() -> None:  # SIGINT, then --resume
    line = _done_line({**BASE, "submitted": 57, "lost": 0, "cancelled": 25})
    assert line.startswith("32/32 items accepted (57 episodes submitted, 25 again after an interruption), "
                           "64 trajectories")


def test_no_lost_no_note() -> None:
    line = _done_line({**BASE, "submitted": 32, "lost": 0, "cancelled": 0})
    assert line == ("32/32 items accepted, 64 trajectories, reward mean 0.500, 1090 tokens in 2.7 s "
                    "(408.0 tok/s)")


def test_episodes_that_failed_for_want_of_a_server_count_as_submitted_again() -> None:
    line = _done_line({**BASE, "submitted": 36, "lost": 0, "cancelled": 0,
                       "failed_by_reason": {"backend_unavailable": 3, "backend_timeout": 1}})
    assert line.startswith("32/32 items accepted (36 episodes submitted, 4 again after an interruption), ")


def test_items_not_episodes_are_counted_when_some_were_not_accepted() -> None:
    line = _done_line({**BASE, "accepted": 29, "submitted": 40, "lost": 8, "cancelled": 0})  # 3 failed
    assert line.startswith("29/32 items accepted (40 episodes submitted, 8 again after an interruption), ")


def test_the_note_does_not_say_interrupted_of_episodes_that_never_started() -> None:
    line = _done_line({**BASE, "submitted": 40, "lost": 0, "cancelled": 8})  # queued when SIGINT came
    assert "interrupted and run again" not in line and "(40 episodes submitted, 8 again after an interruption)" in line


def test_the_interrupt_line_counts_the_items_left_not_the_episodes_cancelled_over_segments() -> None:
    """Regression (new-user trial): after a second Ctrl-C of an 80-item run the line read
    "31/80 items done, 106 episodes cancelled or not started": ``cancelled`` adds up every
    interrupted segment's episodes, while 49 items were left for ``--resume``."""
    from pathlib import Path

    from engine.cli._main import _interrupted_line

    summary = {"exit": "SIGINT", "items": 80, "items_done": 31, "submitted": 136, "cancelled": 106, "lost": 0}
    line = _interrupted_line(summary, Path("h2"))
    assert line == ("rollout: interrupted by SIGINT: 31/80 items done, 49 left (cancelled or not started); "
                    "continue with: rollout run --resume h2")


def test_the_resume_hint_of_a_remote_run_names_the_server_option() -> None:
    """Regression (new-user trial): after SIGINT or exit 75 of a ``--backend sglang`` run the
    printed ``rollout run --resume OUT`` failed with exit 2 ("pass its --server URL(s) again"):
    server URLs are not saved, so the hint must say to pass them."""
    from pathlib import Path

    from engine.cli._deadlines import unavailable_line
    from engine.cli._main import _interrupted_line

    summary = {"exit": "SIGINT", "items": 8, "items_done": 3, "failures": []}
    assert _interrupted_line(summary, Path("r"), "sglang").endswith("continue with: rollout run --resume r --server URL")
    assert _interrupted_line(summary, Path("r"), "hf").endswith("continue with: rollout run --resume r")
    line = unavailable_line({**summary, "exit": "backend_unavailable"}, Path("r"))
    assert "continue with: rollout run --resume r --server URL " in line


def test_backend_timeout_failures_run_again_on_resume() -> None:
    """Regression (new-user trial): items that failed ``backend_timeout`` (a server that
    accepted and never answered) were done, so a hung-server run could not be finished with
    ``--resume`` ("nothing to resume"); like ``backend_unavailable`` they are infrastructure."""
    from engine.cli._journal import RERUN_REASONS

    assert {"backend_unavailable", "backend_timeout"} <= set(RERUN_REASONS)

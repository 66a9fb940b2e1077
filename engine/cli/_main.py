"""``rollout``: the command line.

``rollout run`` turns a dataset into trajectories with a workflow (``--workflow``,
default RLVR; see ``rollout run --help`` for the built-ins) and writes, into
``--out``, as episodes end (layout and loaders: :mod:`engine.cli.outputs`):

- ``trajectories/shard-NNNNNN/``: accepted trajectories in shards, each saved with
  TensorDict's own persistence (``TensorDict.load(shard)``);
  ``engine.cli.load_trajectories(OUT)`` reads them all as one padded batch;
- ``rollouts.jsonl``: one line per trajectory (prompt, completion, reward,
  stop_reason, token counts), appended as each episode ends;
- ``summary.json`` (plain JSON): accounting, reward mean, truncation rate,
  throughput, what was used (backend, model, tokenizer, servers and the model
  each server reported, seed), ``startup_seconds`` (loading the model, waiting
  for servers) apart from ``wall_seconds`` (the rollout itself); rewritten at
  every commit and at exit; with ``--shards N`` also ``shards``, one record per
  engine shard (``engine.shards.ShardStatistics.summary``: ``shard``, ``pid``,
  ``admitted``, ``ended``, ``reruns``, ``exit``, its ``reward_statistics`` ...),
  and ``reward_statistics`` is the list of the shards' reward pools;
- ``run.json``, ``progress.jsonl``: the run's options and journal, for ``--resume``;
- ``config.toml``: every option of the run (``rollout run --config OUT/config.toml``
  repeats it; :mod:`engine.cli._config_file`);
- ``metrics.jsonl`` (a sample per second) and ``episodes.jsonl`` (one line per
  ended episode), which ``rollout report OUT`` plots (:mod:`engine.cli._report`).

The dataset is read with Hugging Face ``datasets`` (files, ``save_to_disk``
folders, hub ids) and its columns mapped to chats (:mod:`engine.datasets._hf`);
``--reward`` names a built-in (gsm8k, math, exact_match) or an import string.
While it runs, a live view on stderr (:mod:`engine.cli._live`: a rich panel on a
terminal, a progress line every ``--progress-interval`` seconds elsewhere) and,
with ``--metrics-port``, a Prometheus endpoint (:mod:`engine.cli._metrics`).

SIGINT / SIGTERM stop the run: admission stops, episodes in flight are cancelled
(``cancelled`` in the summary), what completed is written, and the exit status is
130 / 143 with one line on stderr; a second signal exits at once.  ``rollout run
--resume OUT`` continues an interrupted run, skipping the items already done.
A run that accepts no episode exits 1 with one line.

No wait is unbounded (:mod:`engine.cli._deadlines`): a remote run whose servers are all
down waits ``--no-server-timeout`` seconds (default 300) for one to come back; then its
episodes in flight and queued fail ``backend_unavailable``, what completed is written, and
the exit status is 75 (EX_TEMPFAIL) with one line naming the servers and their last errors;
``rollout run --resume OUT`` runs those items again.

A remote run (``--backend sglang|vllm``) takes its tokenizer from ``--model`` or
from the model the servers report, and refuses a mismatch at start-up
(:mod:`engine.backends.remote._startup`).  ``--seed`` is the run seed: every request's sampling
seed derives from it, the item and the sample.

Bad input ends with one line ``rollout run: error: ...`` on stderr (the prefix
argparse's own errors have) and exit status 2, before any work; a run that accepted
no episode ends with one such line and exit status 1 (its outputs are still written).
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any

import trio

from ._deadlines import EXIT_BACKEND_UNAVAILABLE, unavailable_line
from ..errors import RolloutError

if sys.version_info < (3, 11):  # pragma: no cover
    from exceptiongroup import BaseExceptionGroup

from ._parser import _RUN_ERROR, _explicit_options, build_parser
from ._run import _run

__all__ = ["main"]

logger = logging.getLogger(f"rollout.{__name__}")


def main(argv: list[str] | None = None) -> int:
    from ._options import configure_logging

    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["bench"]:  # the harness lives in benchmarks/ (an application of the engine): imported on use
        configure_logging("warning")
        try:
            from benchmarks.harness.cli import main as bench_main
        except ModuleNotFoundError as exc:
            if not (exc.name or "").startswith("benchmarks"):
                raise
            print("rollout bench: error: the benchmark harness (the benchmarks package of trio-rollout's source "
                  "tree) is not installed here; run it from a checkout (pip install -e .)", file=sys.stderr)
            return 2
        return bench_main(argv[1:])
    args = build_parser().parse_args(argv)
    configure_logging(getattr(args, "log_level", "warning"))
    if args.command in ("serve", "report"):
        return args.handler(args)
    if args.backend in ("sglang", "vllm") and not args.server:
        print(f"{_RUN_ERROR} --backend {args.backend} needs at least one --server URL", file=sys.stderr)
        return 2
    explicit = _explicit_options(argv) if args.resume is not None else set()
    try:
        from ._config_file import config_dict, dump_config, merge_config_file

        args = merge_config_file(build_parser, argv, args)  # --config FILE: flags override it
        configure_logging(args.log_level)
        if args.resume is not None:  # the run's own options, before the workflow and reward are resolved
            from ._journal import resolve_resume_options

            resolve_resume_options(args, explicit)
        if args.print_config:  # (with --resume: what the resume would run)
            print(dump_config(config_dict(build_parser, args)), end="")
            return 0
        _check_out(args.out)
        from ._workflow import plan_workflow

        args.workflow_plan = plan_workflow(args)  # before the model loads: a typo fails at once
        summary = trio.run(_run, args, explicit)
    except (RolloutError, ValueError, OSError) as exc:
        print(f"{_RUN_ERROR} {_one_line(exc)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # before the signal receiver was installed
        print("rollout: interrupted", file=sys.stderr)
        return 130
    except BaseExceptionGroup as group:
        if group.split(KeyboardInterrupt)[1] is not None:  # anything but KeyboardInterrupt inside
            raise
        print("rollout: interrupted", file=sys.stderr)
        return 130
    out = Path(args.out)
    if summary["exit"] in ("SIGINT", "SIGTERM"):
        print(_interrupted_line(summary, out, args.backend), file=sys.stderr)
        return 130 if summary["exit"] == "SIGINT" else 143
    if summary["exit"] == "backend_unavailable":  # no server for the window: the rest runs on --resume
        print(f"{_RUN_ERROR} {unavailable_line(summary, out)}", file=sys.stderr)
        return EXIT_BACKEND_UNAVAILABLE
    if summary["accepted"] == 0:  # nothing to train on: a failed run, whatever the cause
        print(f"{_RUN_ERROR} {_nothing_accepted(summary)}; outputs in {out}", file=sys.stderr)
        return 1
    print(_done_line(summary))
    print(f"wrote {out / 'trajectories'}/ , {out / 'rollouts.jsonl'} , {out / 'summary.json'}")
    fallbacks, rows = summary.get("reward_fallbacks", 0), summary["trajectories"]
    if fallbacks and fallbacks >= rows:  # every reward is the timeout fallback: nothing real to train on
        print(f"{_RUN_ERROR} every reward timed out ({fallbacks} fallback rewards of 0.0 for {rows} "
              "trajectories); raise --reward-timeout or fix the reward", file=sys.stderr)
        return 1
    if fallbacks:
        print(f"rollout: warning: {fallbacks} of {rows} rewards are the timeout fallback (0.0, flagged "
              "reward_is_fallback)", file=sys.stderr)
    return 0


def _interrupted_line(summary: dict[str, Any], out: Path, backend: str | None = None) -> str:
    """The line an interrupted run prints: items done and left, over all its segments
    (not ``cancelled``, which adds up the episodes every interrupted segment cancelled), and
    the resume command (a remote run's server URLs are not saved: they are passed again)."""
    done, items = summary["items_done"], summary["items"]
    server = " --server URL" if backend in ("sglang", "vllm") else ""
    return (f"rollout: interrupted by {summary['exit']}: {done}/{items} items done, {items - done} left "
            f"(cancelled or not started); continue with: rollout run --resume {out}{server}")


def _done_line(summary: dict[str, Any]) -> str:
    """The line a finished run prints: items accepted of the run's items (one episode of
    ``--group-size`` samples each, over all segments), then the episodes submitted when an
    interrupted segment's were submitted again (cancelled, lost or never started: said, so
    that they do not read as failures; not all of them had started, so not "interrupted").
    Episodes are not counted as items: with ``--group-size 2`` "32/48 episodes" read as 48
    items of a 32-item run (a new-user trial)."""
    from ._journal import RERUN_REASONS  # failed for want of a server: run again like the cancelled

    failed = summary.get("failed_by_reason") or {}
    again_n = ((summary.get("lost") or 0) + (summary.get("cancelled") or 0)
               + sum(failed.get(reason, 0) for reason in RERUN_REASONS))
    again = f" ({summary['submitted']} episodes submitted, {again_n} again after an interruption)" if again_n else ""
    return (
        f"{summary['accepted']}/{summary['items']} items accepted{again}, {summary['trajectories']} "
        f"trajectories, reward mean {summary['reward_mean']:.3f}, {summary['generated_tokens']} tokens in "
        f"{summary['wall_seconds']:.1f} s ({summary['generated_tokens_per_second']:.1f} tok/s)"
    )


def _one_line(exc: BaseException | str) -> str:
    """An error message on one line (transformers' messages span several)."""
    return " ".join(str(exc).split()) or type(exc).__name__


def _check_out(out: Path) -> None:
    """Refuse an ``--out`` that cannot be the output folder, before any work."""
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out}: is a file, not a folder")
    parent = next((p for p in (out, *out.parents) if p.exists()), None)
    if parent is not None and not parent.is_dir():
        raise ValueError(f"--out {out}: {parent} is a file, not a folder")


def _nothing_accepted(summary: dict[str, Any]) -> str:
    """One line on a run that accepted no episode: counts by reason, the first error."""
    reasons = {**summary.get("failed_by_reason", {}), **summary.get("rejected_by_reason", {})}
    why = ", ".join(f"{k} x{v}" for k, v in sorted(reasons.items())) or "none ended"
    first = next(iter(summary.get("failures") or []), None)
    detail = f"; first: {first['error_type']}: {first['error_message']}" if first else ""
    return _one_line(f"0 of {summary['submitted']} episodes accepted ({why}){detail}")

"""``rollout``: the command line.

``rollout run`` turns a dataset into trajectories with a workflow (``--workflow``,
default RLVR; see ``rollout run --help`` for the built-ins) and writes, into
``--out``, as episodes end (layout and loaders: :mod:`engine.outputs`):

- ``trajectories/shard-NNNNNN/``: accepted trajectories in shards, each saved with
  TensorDict's own persistence (``TensorDict.load(shard)``);
  ``engine.outputs.load_trajectories(OUT)`` reads them all as one padded batch;
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
  repeats it; :mod:`engine.config_file`);
- ``metrics.jsonl`` (a sample per second) and ``episodes.jsonl`` (one line per
  ended episode), which ``rollout report OUT`` plots (:mod:`engine.report`).

The dataset is read with Hugging Face ``datasets`` (files, ``save_to_disk``
folders, hub ids) and its columns mapped to chats (:mod:`engine.hf_datasets`);
``--reward`` names a built-in (gsm8k, math, exact_match) or an import string.
While it runs, a live view on stderr (:mod:`engine.live`: a rich panel on a
terminal, a progress line every ``--progress-interval`` seconds elsewhere) and,
with ``--metrics-port``, a Prometheus endpoint (:mod:`engine.metrics`).

SIGINT / SIGTERM stop the run: admission stops, episodes in flight are cancelled
(``cancelled`` in the summary), what completed is written, and the exit status is
130 / 143 with one line on stderr; a second signal exits at once.  ``rollout run
--resume OUT`` continues an interrupted run, skipping the items already done.
A run that accepts no episode exits 1 with one line.

No wait is unbounded (:mod:`engine._cli_deadlines`): a remote run whose servers are all
down waits ``--no-server-timeout`` seconds (default 300) for one to come back; then its
episodes in flight and queued fail ``backend_unavailable``, what completed is written, and
the exit status is 75 (EX_TEMPFAIL) with one line naming the servers and their last errors;
``rollout run --resume OUT`` runs those items again.

A remote run (``--backend sglang|vllm``) takes its tokenizer from ``--model`` or
from the model the servers report, and refuses a mismatch at start-up
(:mod:`engine._served`).  ``--seed`` is the run seed: every request's sampling
seed derives from it, the item and the sample.

Bad input ends with one line ``rollout run: error: ...`` on stderr (the prefix
argparse's own errors have) and exit status 2, before any work; a run that accepted
no episode ends with one such line and exit status 1 (its outputs are still written).
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import sys
import time
from pathlib import Path
from collections.abc import Mapping, Set as AbstractSet
from typing import Any, NoReturn

import trio

from ._cli_backend import SHARD_STATS_INTERVAL_S as _SHARD_STATS_INTERVAL_S
from ._cli_backend import open_engine, setup_backend
from ._cli_deadlines import EXIT_BACKEND_UNAVAILABLE, add_deadline_arguments, unavailable_line
from .errors import RolloutError

if sys.version_info < (3, 11):  # pragma: no cover
    from exceptiongroup import BaseExceptionGroup

__all__ = ["main"]

logger = logging.getLogger(f"rollout.{__name__}")


class _Parser(argparse.ArgumentParser):
    run_parser: argparse.ArgumentParser  # the `run` subcommand's (for _explicit_options)
    commands: Mapping[str, argparse.ArgumentParser]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)  # --out is not --out-len-median: whole option names only
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:  # one line, no usage dump
        self.exit(2, f"{self.prog}: error: {message}\n")

    def parse_args(self, args: Any = None, namespace: Any = None) -> Any:
        """As argparse's, but an unknown option is the subcommand's error (``rollout run:
        error: unrecognized arguments: ...``, as its other errors), not ``rollout``'s."""
        parsed, extra = self.parse_known_args(args, namespace)
        if extra:
            commands = getattr(self, "commands", {})
            commands.get(getattr(parsed, "command", None), self).error(f"unrecognized arguments: {' '.join(extra)}")
        return parsed


def _int_at_least(minimum: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value

    return parse


_positive_int, _non_negative_int = _int_at_least(1), _int_at_least(0)


def _positive_float(text: str) -> float:
    value = _non_negative_float(text)
    if value == 0:
        raise argparse.ArgumentTypeError("must be > 0")
    return value


def _non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return value


_RUN_ERROR = "rollout run: error:"  # argparse's prefix for `rollout run`: every error line of the run has it


def _shard_timeout(text: str) -> float:
    """``--shard-timeout``: one message for every bad value (argparse, and ``--config``'s key)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > _SHARD_STATS_INTERVAL_S):
        raise argparse.ArgumentTypeError(
            f"must be a number of seconds above the shards' statistics interval, {_SHARD_STATS_INTERVAL_S} s "
            f"(a live shard reports every {_SHARD_STATS_INTERVAL_S} s), got {text}")
    return value


_BENCH_HELP = ("throughput benchmark (benchmarks.harness): on the simulated server side by side with AReaL's "
               "executor and a naive loop (--backend sim), or asynchronous vs synchronous batched rollout on a "
               "real backend (--backend hf|sglang|vllm); `rollout bench --help` for its options")


def build_parser() -> _Parser:
    parser = _Parser(prog="rollout", description="trio-rollout: a trio-native rollout engine for LLM RL.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    parser.commands = sub.choices  # name -> subcommand parser (for parse_args' errors)
    from ._cli_workflow import add_workflow_arguments, workflows_epilog

    run = sub.add_parser("run", help="run a workflow (default RLVR) over a dataset and write trajectories",
                         description="Run a workflow (default RLVR: chat template -> generate -> reward in worker "
                                     "processes) over a dataset; write trajectories/, rollouts.jsonl, summary.json.",
                         epilog=workflows_epilog(), formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workflow_arguments(run)
    run.add_argument("--model", default=None,
                     help="HF model folder or hub id (default: the built-in SmolLM2-135M-Instruct; "
                          "builtin:tiny-vlm is a tiny random vision-language model, for --workflow vision_rlvr)")
    run.add_argument("--dataset", default="builtin:arith",
                     help="a jsonl/json/parquet/csv/arrow file, a save_to_disk folder or a hub id (columns mapped "
                          "by the dataset options below), builtin:arith[:N] (default: GSM8K-style word problems), or "
                          "builtin:shapes[:N] (images: how many red shapes?, for --workflow vision_rlvr)")
    run.add_argument("--backend", default="hf", choices=("hf", "sim", "sglang", "vllm"),
                     help="inference backend (default hf: the model in this process)")
    run.add_argument("--server", action="append", default=[], metavar="URL",
                     help="server URL for --backend sglang|vllm (repeat for several; requests are routed "
                          "to the least loaded)")
    run.add_argument("--request-timeout", type=_positive_float, default=3600.0,
                     help="seconds a remote request may take in all, retries and failover included (default 3600)")
    run.add_argument("--startup-timeout", type=_positive_float, default=300.0,
                     help="seconds to wait for a remote server to answer its health route at start-up "
                          "(default 300; a server refusing access fails at once)")
    run.add_argument("--n-samples", type=_positive_int, default=2, help="samples per prompt (default 2)")
    run.add_argument("--max-new-tokens", type=_positive_int, default=128, help="new-token budget (default 128)")
    run.add_argument("--temperature", type=_non_negative_float, default=1.0, help="sampling temperature (default 1.0)")
    run.add_argument("--concurrency", type=_positive_int, default=64, help="episodes in flight (default 64)")
    run.add_argument("--limit", type=_positive_int, default=None,
                     help="use the first N rows of the dataset (after --shuffle; per epoch)")
    run.add_argument("--seed", type=int, default=0,
                     help="run seed: each request's sampling seed derives from it, the item and the sample, so "
                          "a run repeats with the same seed (default 0)")
    run.add_argument("--out", type=Path, default=Path("rollout-out"), help="output folder (default ./rollout-out)")
    run.add_argument("--group-size", type=_positive_int, default=1,
                     help="episodes per prompt run concurrently as one group (default 1)")
    run.add_argument("--consumer-batch-size", type=_positive_int, default=None,
                     help="episodes per (simulated) training step: after each B accepted episodes are taken, "
                          "the policy version is bumped, as a trainer would")
    run.add_argument("--max-head-offpolicyness", type=_non_negative_int, default=None,
                     help="how many versions generation may run ahead (needs --consumer-batch-size)")
    run.add_argument("--dump-dir", type=Path, default=None,
                     help="also write one JSONL record per trajectory under DIR/<version>/")
    run.add_argument("--reward-timeout", type=_positive_float, default=15.0,
                     help="seconds per reward attempt before its worker is killed (default 15)")
    run.add_argument("--reward-backend", choices=("local", "ray"), default="local",
                     help="where sync rewards run: local worker processes, or Ray actors (pip install "
                          "'trio-rollout[ray]'; default local)")
    run.add_argument("--ray-address", default=None, metavar="ADDR",
                     help="Ray cluster for --reward-backend ray and --shard-backend ray (default: start a local Ray)")
    run.add_argument("--shards", type=_positive_int, default=None, metavar="N",
                     help="run N engine shards (processes, each with its own event loop, backend client and "
                          "reward pool) behind one coordinator (engine.shards; with --backend hf each shard "
                          "loads its own copy of the model, on its own GPU when there are several)")
    run.add_argument("--shard-backend", choices=("process", "ray"), default="process",
                     help="--shards as local processes (default) or Ray actors (on --ray-address)")
    run.add_argument("--shard-timeout", type=_shard_timeout, default=None, metavar="SECONDS",
                     help="with --shards: a shard that sends nothing for this many seconds (stopped, deadlocked, "
                          "its loop blocked; a live one reports every 0.5 s) is killed and its episodes run again "
                          "on the other shards (default: never)")
    run.add_argument("--torch-threads", type=_positive_int, default=None,
                     help="torch intra-op threads (with --shards: in each shard process; default there 1)")
    run.add_argument("--quiet", action="store_true", help="no live view, no progress lines")
    run.add_argument("--resume", type=Path, default=None, metavar="DIR",
                     help="continue the interrupted run in DIR: its options are reused (a different --dataset, "
                          "--n-samples, ... is refused), items already done are skipped; --concurrency, --shards, "
                          "--shard-backend, --shard-timeout, --reward-backend given again replace the run's, for "
                          "this and every later resume")
    run.add_argument("--shard-episodes", type=_positive_int, default=64,
                     help="accepted episodes per trajectory shard, written atomically (default 64)")
    run.add_argument("--commit-interval", type=_positive_float, default=10.0,
                     help="seconds a finished episode waits at most before it is committed (default 10)")
    parser.run_parser = run  # for _explicit_options
    from ._cli_options import add_user_run_arguments
    from .report import add_report_parser
    from .serve import add_serve_parser

    add_user_run_arguments(run)  # dataset mapping, --sim-*, live view, metrics, logging, --config
    add_deadline_arguments(run)  # --no-server-timeout, --attempt-timeout, --episode-timeout
    add_serve_parser(sub)
    sub.add_parser("bench", add_help=False, help=_BENCH_HELP)  # listed here; main() hands its options over
    add_report_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    from ._cli_options import configure_logging

    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["bench"]:  # the harness lives in benchmarks/ (an application of the engine): imported on use
        configure_logging("warning")
        from benchmarks.harness.cli import main as bench_main

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
        from .config_file import config_dict, dump_config, merge_config_file

        args = merge_config_file(build_parser, argv, args)  # --config FILE: flags override it
        configure_logging(args.log_level)
        if args.resume is not None:  # the run's own options, before the workflow and reward are resolved
            from ._journal import resolve_resume_options

            resolve_resume_options(args, explicit)
        if args.print_config:  # (with --resume: what the resume would run)
            print(dump_config(config_dict(build_parser, args)), end="")
            return 0
        _check_out(args.out)
        from ._cli_workflow import plan_workflow

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
        print(_interrupted_line(summary, out), file=sys.stderr)
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


def _interrupted_line(summary: dict[str, Any], out: Path) -> str:
    """The line an interrupted run prints: items done and left, over all its segments
    (not ``cancelled``, which adds up the episodes every interrupted segment cancelled)."""
    done, items = summary["items_done"], summary["items"]
    return (f"rollout: interrupted by {summary['exit']}: {done}/{items} items done, {items - done} left "
            f"(cancelled or not started); continue with: rollout run --resume {out}")


def _done_line(summary: dict[str, Any]) -> str:
    """The line a finished run prints: accepted of submitted (episodes an interrupted
    segment cancelled, lost or never started were submitted again: said, so that they
    do not read as failures; not all of them had started, so not "interrupted")."""
    again_n = ((summary.get("lost") or 0) + (summary.get("cancelled") or 0)
               + (summary.get("failed_by_reason") or {}).get("backend_unavailable", 0))
    again = f" ({again_n} submitted again after an interruption)" if again_n else ""
    return (
        f"{summary['accepted']}/{summary['submitted']} episodes accepted{again}, {summary['trajectories']} "
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


_UNSET = object()


def _explicit_options(argv: list[str] | None) -> set[str]:
    """The ``rollout run`` options given on the command line (not defaulted)."""
    parser = build_parser()
    run = parser.run_parser
    appended = {a.dest for a in run._actions if isinstance(a, argparse._AppendAction)}  # (--server: appends to
    run.set_defaults(**{a.dest: None if a.dest in appended else _UNSET  # its default, so not a marker object)
                        for a in run._actions if a.dest != "help"})
    return {k for k, v in vars(parser.parse_args(argv)).items() if v is not _UNSET and not (k in appended and v is None)}


def _load_items(args: argparse.Namespace) -> Any:
    """The run's items (:func:`engine.hf_datasets.load_items`), with the reward's data
    keys required and its answer-format hint appended to column prompts."""
    from ._cli_options import data_spec
    from ._cli_workflow import reward_data_keys, reward_prompt_hint
    from .hf_datasets import load_items

    if not args.dataset.startswith("builtin:"):
        import datasets

        datasets.disable_progress_bars()  # ours is the only progress display
        datasets.utils.logging.set_verbosity(logging.CRITICAL)  # its errors reach the user as ours, in one line
    required = reward_data_keys(args.reward, args.workflow_plan.reward_fn)
    return load_items(data_spec(args, required=required, prompt_suffix=reward_prompt_hint(args.reward)))


def _load_processor(args: argparse.Namespace) -> Any:
    """The multimodal processor of ``--model`` (for workflows that take ``processor=``)."""
    from workflows.vision_rlvr import load_vision_processor

    return load_vision_processor(args.model, flag=f"--workflow {args.workflow}")


async def _run(args: argparse.Namespace, explicit: AbstractSet[str] = frozenset()) -> dict[str, Any]:
    """The run under a SIGINT/SIGTERM receiver; returns the summary (``exit``
    says how it ended).  Errors are raised as themselves, not in a group."""
    from ._signals import Interrupt, watch_signals

    interrupt, stop = Interrupt(), trio.CancelScope()
    outcome: Any = None
    async with trio.open_nursery() as guard:
        await guard.start(watch_signals, interrupt, stop)
        try:
            outcome = await _run_segment(args, explicit, stop, interrupt)
        except Exception as exc:  # re-raised below, outside the nursery
            outcome = exc
        guard.cancel_scope.cancel()
    if isinstance(outcome, BaseException):
        while isinstance(outcome, BaseExceptionGroup) and len(outcome.exceptions) == 1:
            outcome = outcome.exceptions[0]
        raise outcome
    return outcome


async def _run_segment(args: argparse.Namespace, explicit: AbstractSet[str], stop: trio.CancelScope,
                       interrupt: Any) -> dict[str, Any]:
    """One segment of a run (the whole run unless interrupted): open the run
    folder, run the items not done yet, write outputs as they end."""
    from ._journal import KEPT_OPTIONS, locked_options, open_run_dir
    from .config_file import config_dict, dump_config
    from .live import view_mode
    from .metrics import observe_run
    from .outputs import RunWriter

    if args.resume is not None:  # (its options were resolved in main)
        if args.backend in ("sglang", "vllm") and not args.server:
            raise ValueError(f"--resume: the run uses --backend {args.backend}; pass its --server URL(s) again")
    if args.shard_timeout is not None and not args.shards:
        raise ValueError("--shard-timeout applies to --shards N (a shard that falls silent is killed)")
    if args.max_head_offpolicyness is not None and args.consumer_batch_size is None:
        raise ValueError("--max-head-offpolicyness needs --consumer-batch-size (the batch a version consumes)")
    loaded = await trio.to_thread.run_sync(_load_items, args)  # a bad dataset fails before any work
    items = loaded.items
    options = {name: getattr(args, name) for name in (*locked_options(args), *KEPT_OPTIONS) if hasattr(args, name)}
    state = await trio.to_thread.run_sync(
        lambda: open_run_dir(Path(args.out), options, items, resume=args.resume is not None))
    await trio.Path(args.out, "config.toml").write_text(dump_config(config_dict(build_parser, args)),
                                                         encoding="utf-8")
    engine: Any = None
    static = {"backend": args.backend,
              "model": args.model or ("builtin:smollm2" if args.backend == "hf" else "builtin:tiny-tokenizer"),
              "dataset": args.dataset, "n_samples": args.n_samples, "group_size": args.group_size,
              "max_new_tokens": args.max_new_tokens, "temperature": args.temperature, "final_version": state.version,
              "workflow": args.workflow, "seed": args.seed, "reward": args.reward,
              "dataset_rows": loaded.rows, "dataset_rows_skipped": len(loaded.skipped), "epochs": args.epochs}

    def summary_fields() -> dict[str, Any]:
        fields = dict(static)
        if engine is not None:
            s = engine.statistics()
            fields.update(final_version=s.version, reward_fallbacks=s.reward_fallbacks,
                          retokenization_drifts=s.retokenization_drifts,
                          reward_statistics=_plain(s.rewards), backend_statistics=_plain(s.backend))
            if args.shards:  # per shard: what it ran, how it ended, its reward pool and backend client
                fields["shards"] = [_plain(r.summary()) for r in engine.shard_statistics()]
        return fields

    writer = RunWriter(state, None, shard_episodes=args.shard_episodes, commit_interval_s=args.commit_interval,
                       summary_fields=summary_fields)
    todo = [i for i in range(len(items)) if i not in state.done]
    if not todo:
        print(f"nothing to resume: all {len(items)} items in {args.out} are done")
    exit, error = "error", None
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(writer.run)
            try:
                if todo:
                    with stop:
                        start = time.perf_counter()
                        tokenizer, backend, used = await setup_backend(args)
                        writer.tokenizer = tokenizer
                        static.update(used, logprob_semantics=backend.logprob_semantics)
                        workflow, config = await _workflow_and_config(args, tokenizer)
                        async with open_engine(args, backend, config, tokenizer) as engine:
                            static["startup_seconds"] = time.perf_counter() - start  # model load, servers
                            if engine.reward_pool is not None:  # (shards: each has its own pool)
                                await engine.reward_pool.check_reward_fn(args.workflow_plan.reward_fn,
                                                                         items[todo[0]])
                            if state.version:
                                engine.restore(state.version)
                            async with observe_run(engine, total=len(todo), out=Path(args.out),
                                                   append=args.resume is not None, view=view_mode(quiet=args.quiet),
                                                   consumer=args.consumer_batch_size is not None,
                                                   interval_s=args.progress_interval,
                                                   metrics_port=args.metrics_port,
                                                   metrics_host=args.metrics_host) as monitor:
                                if args.metrics_port is not None:  # (port 0: the one the OS chose)
                                    print(f"rollout: metrics at {monitor.metrics_url}", file=sys.stderr, flush=True)
                                # episode starts and tokens, for the view (in-process only: shards run elsewhere)
                                # (shards time their own episodes: open_sharded_engine(track_episodes=))
                                tracked = workflow if args.shards else monitor.track(workflow)
                                for i in todo:
                                    engine.submit(items[i], tracked, group_size=args.group_size, task_id=i)
                                writer.begin(len(todo))
                                await _collect(engine, writer, len(todo), step_every=args.consumer_batch_size,
                                               on_results=monitor.on_results)
                    if engine is not None and stop.cancelled_caught:  # what ended before the close is kept
                        for result in await engine.wait_results(engine.statistics().results_waiting):
                            writer.record(result)
                exit = interrupt.name or ("backend_unavailable" if writer.rerun else "completed")
            except Exception as exc:  # the writer still commits what ended; re-raised below
                error = exc
            writer.end(exit)
    finally:
        if state.lock_fd is not None:
            os.close(state.lock_fd)
    if error is not None:
        raise error
    return writer.summary


async def _workflow_and_config(args: argparse.Namespace, tokenizer: Any) -> tuple[Any, Any]:
    from ._cli_workflow import build_workflow
    from .types import GenerationHyperparameters

    gconfig = GenerationHyperparameters(n_samples=args.n_samples, max_new_tokens=args.max_new_tokens,
                                        temperature=args.temperature, greedy=args.temperature == 0, seed=args.seed)
    plan = args.workflow_plan
    processor = await trio.to_thread.run_sync(_load_processor, args) if plan.needs_processor else None
    return build_workflow(plan, gconfig=gconfig, tokenizer=tokenizer, processor=processor), _engine_config(args)


def _engine_config(args: argparse.Namespace) -> Any:
    """The engine settings of ``rollout run`` (a command owns its process: GC tuning on)."""
    from .executor import EngineConfig

    return EngineConfig(max_concurrent_rollouts=args.concurrency, reward_timeout_seconds=args.reward_timeout,
                        consumer_batch_size=args.consumer_batch_size or 1,
                        max_head_offpolicyness=args.max_head_offpolicyness,
                        dump_dir=str(args.dump_dir) if args.dump_dir else None, gc_tuning=True,
                        reward_backend=getattr(args, "reward_backend", "local"),
                        reward_ray_address=getattr(args, "ray_address", None),
                        episode_timeout_s=getattr(args, "episode_timeout", None))


async def _collect(engine: Any, writer: Any, total: int, *, step_every: int | None,
                   on_results: Any = None) -> None:
    """Hand every result to ``writer`` as it ends, and each batch taken to
    ``on_results`` (the live view's per-episode callback).  With ``step_every = B``,
    bump the policy version after each B accepted results, as a trainer consuming
    batches would."""
    taken = since_step = 0
    while taken < total:
        got = await engine.wait_results(1)
        taken += len(got)
        for result in got:
            writer.record(result)
        if on_results is not None:
            on_results(got)  # consumed at the current version
        since_step += sum(r.status == "accepted" for r in got)
        if step_every and since_step >= step_every:
            since_step -= step_every
            engine.set_version(engine.version + 1)


def _plain(obj: Any) -> Any:
    """``obj`` as plain JSON values: dataclasses and dicts as objects, lists and
    tuples as arrays, a non-finite float as null; anything else as its repr."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if obj is None or isinstance(obj, (int, float, str, bool)):
        return obj
    if isinstance(obj, dict):
        return {str(k): _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    if hasattr(obj, "__dataclass_fields__"):
        return {k: _plain(getattr(obj, k)) for k in obj.__dataclass_fields__}
    return repr(obj)


if __name__ == "__main__":
    sys.exit(main())

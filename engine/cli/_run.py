"""One ``rollout run``: load the items, open the run folder, set up the backend and the
engine, submit every item not done yet, and write the outputs as episodes end, under a
SIGINT/SIGTERM receiver (:mod:`engine.cli._signals`)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path
from collections.abc import Set as AbstractSet
from typing import Any

import trio

from .._jsonable import plain
from ..errors import unwrap_single
from ._backend import open_engine, setup_backend
from ._parser import build_parser


def _load_items(args: argparse.Namespace) -> Any:
    """The run's items (:func:`engine.datasets.load_items`), with the reward's data
    keys required and its answer-format hint appended to column prompts."""
    from ._options import data_spec
    from ._workflow import reward_data_keys, reward_prompt_hint
    from ..datasets import load_items

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
        raise unwrap_single(outcome)
    return outcome


async def _run_segment(args: argparse.Namespace, explicit: AbstractSet[str], stop: trio.CancelScope,
                       interrupt: Any) -> dict[str, Any]:
    """One segment of a run (the whole run unless interrupted): open the run
    folder, run the items not done yet, write outputs as they end."""
    from ._journal import KEPT_OPTIONS, locked_options, open_run_dir
    from ._config_file import config_dict, dump_config
    from ._live import view_mode
    from ._metrics import observe_run
    from .outputs import RunWriter

    if args.resume is not None:  # (its options were resolved in main)
        if args.backend in ("sglang", "vllm") and not args.server:
            raise ValueError(f"--resume: the run uses --backend {args.backend}; pass its --server URL(s) again")
    if args.shard_timeout is not None and not args.shards:
        raise ValueError("--shard-timeout applies to --shards N (a shard that falls silent is killed)")
    if args.scheduling == "length_aware" and args.group_size < 2:
        raise ValueError("--scheduling length_aware needs --group-size > 1 (a group's first sample estimates "
                         "its siblings' lengths)")
    if args.shards and (args.scheduling != "fcfs" or args.scheduling_max_segments is not None):
        raise ValueError("--scheduling / --scheduling-max-segments: a sharded run (--shards) runs fcfs only")
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
                          reward_statistics=plain(s.rewards), backend_statistics=plain(s.backend),
                          scheduling=plain(s.scheduling))
            if args.shards:  # per shard: what it ran, how it ended, its reward pool and backend client
                fields["shards"] = [plain(r.summary()) for r in engine.shard_statistics()]
        return fields

    writer = RunWriter(state, None, shard_episodes=args.shard_episodes, commit_interval_s=args.commit_interval,
                       summary_fields=summary_fields)
    todo = [i for i in range(len(items)) if i not in state.done]
    if not todo:
        print(f"nothing to resume: all {len(items)} items in {args.out} are done")
        # no engine runs: keep what the last run's engine reported (backend, rewards, scheduling)
        previous = await trio.to_thread.run_sync(_previous_summary, Path(args.out))
        static.update({k: v for k, v in previous.items() if k not in static})
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
                exit = interrupt.name or ("backend_unavailable" if writer.unavailable else "completed")
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
    from ._workflow import build_workflow
    from ..types import GenerationHyperparameters

    gconfig = GenerationHyperparameters(n_samples=args.n_samples, max_new_tokens=args.max_new_tokens,
                                        temperature=args.temperature, greedy=args.temperature == 0, seed=args.seed)
    plan = args.workflow_plan
    processor = await trio.to_thread.run_sync(_load_processor, args) if plan.needs_processor else None
    return build_workflow(plan, gconfig=gconfig, tokenizer=tokenizer, processor=processor), _engine_config(args)


def _previous_summary(out: Path) -> dict[str, Any]:
    """The run folder's ``summary.json`` ({} when missing or unreadable)."""
    try:
        value = json.loads((out / "summary.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def _engine_config(args: argparse.Namespace) -> Any:
    """The engine settings of ``rollout run`` (a command owns its process: GC tuning on)."""
    from ..executor import EngineConfig

    return EngineConfig(max_concurrent_rollouts=args.concurrency, reward_timeout_seconds=args.reward_timeout,
                        consumer_batch_size=args.consumer_batch_size or 1,
                        max_head_offpolicyness=args.max_head_offpolicyness,
                        dump_dir=str(args.dump_dir) if args.dump_dir else None, gc_tuning=True,
                        reward_backend=getattr(args, "reward_backend", "local"),
                        reward_ray_address=getattr(args, "ray_address", None),
                        episode_timeout_s=getattr(args, "episode_timeout", None),
                        scheduling=getattr(args, "scheduling", "fcfs"),
                        scheduling_max_segments=getattr(args, "scheduling_max_segments", None))


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

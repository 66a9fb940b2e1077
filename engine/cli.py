"""``rollout``: the command line.

``rollout run`` turns a dataset into trajectories with a workflow (``--workflow``,
default RLVR; see ``rollout run --help`` for the built-ins) and
writes, into ``--out``:

- ``trajectories/``: the padded batch, saved with TensorDict's own persistence
  (``TensorDict.load(DIR/"trajectories")`` or ``load_memmap`` reads it);
- ``rollouts.jsonl``: one line per trajectory (prompt, completion, reward,
  stop_reason, token counts);
- ``config.toml``: every option of the run (``rollout run --config OUT/config.toml``
  repeats it; :mod:`engine.config_file`);
- ``metrics.jsonl`` (a sample per second) and ``episodes.jsonl`` (one line per
  ended episode), which ``rollout report OUT`` plots (:mod:`engine.report`);
- ``summary.json`` (plain JSON): accounting, reward mean, truncation rate,
  throughput, what was used (backend, model, tokenizer, servers and the model
  each server reported, seed), ``startup_seconds`` (loading the model, waiting
  for servers) apart from ``wall_seconds`` (the rollout itself).

The dataset is read with Hugging Face ``datasets`` (files, ``save_to_disk``
folders, hub ids) and its columns mapped to chats (:mod:`engine.hf_datasets`);
``--reward`` names a built-in (gsm8k, math, exact_match) or an import string.
While it runs, a live view on stderr (:mod:`engine.live`: a rich panel on a
terminal, a progress line every ``--progress-interval`` seconds elsewhere) and,
with ``--metrics-port``, a Prometheus endpoint (:mod:`engine.metrics`).

A remote run (``--backend sglang|vllm``) takes its tokenizer from ``--model`` or
from the model the servers report, and refuses a mismatch at start-up
(:mod:`engine._served`).  ``--seed`` is the run seed: every request's sampling
seed derives from it, the item and the sample.

Bad input ends with one line ``rollout: error: ...`` on stderr and exit status 2,
before any work; a run that accepted no episode ends with one line and exit
status 1 (its outputs are still written).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import shutil
import sys
import time
from pathlib import Path
from typing import Any, NoReturn

import trio

from .errors import RolloutError

__all__ = ["main"]

logger = logging.getLogger(f"rollout.{__name__}")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, no usage dump
        self.exit(2, f"{self.prog}: error: {message}\n")


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


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="rollout", description="trio-rollout: a trio-native rollout engine for LLM RL.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
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
    run.add_argument("--torch-threads", type=_positive_int, default=None, help="torch intra-op threads")
    run.add_argument("--quiet", action="store_true", help="no live view, no progress lines")
    from ._cli_options import add_user_run_arguments
    from .bench import add_bench_parser
    from .report import add_report_parser
    from .serve import add_serve_parser

    add_user_run_arguments(run)
    add_serve_parser(sub)
    add_bench_parser(sub)
    add_report_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    from ._cli_options import configure_logging

    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    configure_logging(getattr(args, "log_level", "warning"))
    if args.command in ("serve", "report"):
        return args.handler(args)
    if args.command == "bench":
        from .bench import run_bench

        return run_bench(args)
    if args.backend in ("sglang", "vllm") and not args.server:
        print(f"rollout: error: --backend {args.backend} needs at least one --server URL", file=sys.stderr)
        return 2
    try:
        from .config_file import config_dict, dump_config, merge_config_file

        args = merge_config_file(build_parser, argv, args)  # --config FILE: flags override it
        configure_logging(args.log_level)
        config_text = dump_config(config_dict(build_parser, args))
        if args.print_config:
            print(config_text, end="")
            return 0
        _check_out(args.out)
        from ._cli_workflow import plan_workflow

        args.workflow_plan = plan_workflow(args)  # before the model loads: a typo fails at once
        args.loaded = _load_items(args)  # likewise: a bad dataset fails before any work
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "config.toml").write_text(config_text, encoding="utf-8")
        summary = trio.run(_run, args)
    except (RolloutError, ValueError, OSError) as exc:
        print(f"rollout: error: {_one_line(exc)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("rollout: interrupted", file=sys.stderr)
        return 130
    out = args.out
    if summary["accepted"] == 0:  # nothing to train on: a failed run, whatever the cause
        print(f"rollout: error: {_nothing_accepted(summary)}; outputs in {out}", file=sys.stderr)
        return 1
    print(
        f"{summary['accepted']}/{summary['submitted']} episodes accepted, {summary['trajectories']} trajectories, "
        f"reward mean {summary['reward_mean']:.3f}, {summary['generated_tokens']} tokens in "
        f"{summary['wall_seconds']:.1f} s ({summary['generated_tokens_per_second']:.1f} tok/s)"
    )
    print(f"wrote {out / 'trajectories'}/ , {out / 'rollouts.jsonl'} , {out / 'summary.json'}")
    return 0


def _one_line(exc: BaseException) -> str:
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


def _tokenizer_and_backend(args: argparse.Namespace) -> tuple[Any, Any]:
    """Load the tokenizer and build the backend named by ``--backend``."""
    import torch
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    from .models import resolve_model

    hf_logging.disable_progress_bar()  # ours is the only progress bar

    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    torch.manual_seed(args.seed)
    if args.backend == "hf":
        from .backends.hf import HFBackend

        path = resolve_model(args.model)
        tokenizer = AutoTokenizer.from_pretrained(path)
        return tokenizer, HFBackend(path, tokenizer, max_batch_size=args.concurrency)
    if args.model is None:
        from .testing import build_tiny_tokenizer

        tokenizer = build_tiny_tokenizer()
    else:
        tokenizer = AutoTokenizer.from_pretrained(resolve_model(args.model))
    from ._cli_options import sim_backend

    return tokenizer, sim_backend(args, tokenizer)


async def _setup_backend(args: argparse.Namespace) -> tuple[Any, Any, dict[str, Any]]:
    """``(tokenizer, backend, used)``: ``used`` names the model, tokenizer and servers."""
    if args.backend in ("sglang", "vllm"):  # waits for the servers, asks them for their model
        from ._served import open_remote_backend

        return await open_remote_backend(args)
    tokenizer, backend = await trio.to_thread.run_sync(_tokenizer_and_backend, args)
    model = args.model or ("builtin:smollm2" if args.backend == "hf" else None)
    name = getattr(tokenizer, "name_or_path", None)
    return tokenizer, backend, {"model": model, "tokenizer": str(name) if name else "builtin:tiny-tokenizer",
                                "servers": []}


def _load_processor(args: argparse.Namespace) -> Any:
    """The multimodal processor of ``--model`` (for workflows that take ``processor=``)."""
    from workflows.vision_rlvr import load_vision_processor

    return load_vision_processor(args.model, flag=f"--workflow {args.workflow}")

    from .models import resolve_model

    return AutoProcessor.from_pretrained(resolve_model(args.model))


async def _run(args: argparse.Namespace) -> dict[str, Any]:
    from ._cli_workflow import build_workflow
    from .data import concat_padded_tensors
    from .executor import open_rollout_engine
    from .live import view_mode
    from .metrics import observe_run
    from .types import GenerationHyperparameters

    if args.max_head_offpolicyness is not None and args.consumer_batch_size is None:
        raise ValueError("--max-head-offpolicyness needs --consumer-batch-size (the batch a version consumes)")
    items = args.loaded.items
    start = time.perf_counter()
    tokenizer, backend, used = await _setup_backend(args)
    gconfig = GenerationHyperparameters(n_samples=args.n_samples, max_new_tokens=args.max_new_tokens,
                                        temperature=args.temperature, greedy=args.temperature == 0, seed=args.seed)
    plan = args.workflow_plan
    processor = await trio.to_thread.run_sync(_load_processor, args) if plan.needs_processor else None
    workflow = build_workflow(plan, gconfig=gconfig, tokenizer=tokenizer, processor=processor)
    config = _engine_config(args)
    async with open_rollout_engine(backend, config, tokenizer=tokenizer) as engine:
        opened = time.perf_counter()  # start-up (model load, waiting for servers) ends here
        await engine.reward_pool.check_reward_fn(plan.reward_fn, items[0])  # before any episode
        async with observe_run(engine, total=len(items), out=args.out, view=view_mode(quiet=args.quiet),
                               interval_s=args.progress_interval, metrics_port=args.metrics_port,
                               metrics_host=args.metrics_host) as monitor:
            tracked = monitor.track(workflow)  # episode start/tokens for the live view
            for item in items:
                engine.submit(item, tracked, group_size=args.group_size)
            results = await _collect(engine, len(items), step_every=args.consumer_batch_size,
                                     on_results=monitor.on_results)
        stats = engine.statistics()
    wall = time.perf_counter() - opened
    results.sort(key=lambda r: r.task_id)
    accepted = [r for r in results if r.status == "accepted"]
    batch = concat_padded_tensors([r.trajectory for r in accepted])
    rows = _rollout_rows(accepted, tokenizer)
    n_gen = sum(r["completion_tokens"] for r in rows)
    summary = {
        "submitted": stats.submitted,
        "accepted": stats.accepted,
        "rejected": stats.rejected,
        "failed": stats.failed,
        "rejected_by_reason": stats.rejected_by_reason,
        "failed_by_reason": stats.failed_by_reason,
        "failures": [
            {"task_id": r.task_id, "reason": r.reason, "error_type": r.error_type, "error_message": r.error_message}
            for r in results if r.status == "failed"
        ],
        "trajectories": len(rows),
        "reward_fallbacks": stats.reward_fallbacks,
        "workflow": args.workflow,
        "retokenization_drifts": stats.retokenization_drifts,
        "reward_mean": (sum(r["reward"] for r in rows) / len(rows)) if rows else 0.0,
        "truncation_rate": (sum(r["stop_reason"] == "length" for r in rows) / len(rows)) if rows else 0.0,
        "generated_tokens": n_gen,
        "wall_seconds": wall,
        "startup_seconds": opened - start,
        "generated_tokens_per_second": n_gen / wall if wall > 0 else 0.0,
        "backend": args.backend,
        **used,  # model, tokenizer, servers (and for a remote run what each server reported)
        "seed": args.seed,
        "dataset": args.dataset,
        "dataset_rows": args.loaded.rows,
        "dataset_rows_skipped": len(args.loaded.skipped),
        "epochs": args.epochs,
        "reward": args.reward,
        "n_samples": args.n_samples,
        "group_size": args.group_size,
        "final_version": stats.version,
        "max_new_tokens": args.max_new_tokens,
        "temperature": args.temperature,
        "logprob_semantics": backend.logprob_semantics,
        "reward_statistics": _plain(stats.rewards),
        "backend_statistics": _plain(stats.backend),
    }
    await trio.to_thread.run_sync(_write_outputs, args.out, batch, rows, summary)
    return summary


def _engine_config(args: argparse.Namespace) -> Any:
    """The engine settings of ``rollout run`` (a command owns its process: GC tuning on)."""
    from .executor import EngineConfig

    return EngineConfig(max_concurrent_rollouts=args.concurrency, reward_timeout_seconds=args.reward_timeout,
                        consumer_batch_size=args.consumer_batch_size or 1,
                        max_head_offpolicyness=args.max_head_offpolicyness,
                        dump_dir=str(args.dump_dir) if args.dump_dir else None, gc_tuning=True)


async def _collect(engine: Any, total: int, *, step_every: int | None,
                   on_results: Any = None) -> list[Any]:
    """Take every result as it ends, handing each batch taken to ``on_results`` (the
    live view's per-episode callback).  With ``step_every = B``, bump the policy
    version after each B accepted results, as a trainer consuming batches would."""
    results: list[Any] = []
    since_step = 0
    while len(results) < total:
        got = await engine.wait_results(1)
        results += got
        if on_results is not None:
            on_results(got)  # consumed at the current version
        since_step += sum(r.status == "accepted" for r in got)
        if step_every and since_step >= step_every:
            since_step -= step_every
            engine.set_version(engine.version + 1)
    return results


def _rollout_rows(accepted: list[Any], tokenizer: Any) -> list[dict[str, Any]]:
    rows = []
    for result in accepted:
        traj = result.trajectory
        for i in range(traj.batch_size[0]):
            real = traj["attention_mask"][i]
            ids = traj["input_ids"][i][real]
            gen = traj["loss_mask"][i][real].bool()
            prompt_ids, completion_ids = ids[~gen].tolist(), ids[gen].tolist()
            rows.append({
                "task_id": result.task_id,
                "sample": i,
                "prompt": tokenizer.decode(prompt_ids, skip_special_tokens=False),
                "completion": tokenizer.decode(completion_ids, skip_special_tokens=True),
                "reward": float(traj["rewards"][i]),
                "reward_is_fallback": bool(traj["reward_is_fallback"][i]) if "reward_is_fallback" in traj.keys()
                else False,
                "stop_reason": "length" if bool(traj["is_truncated"][i]) else "stop",
                "prompt_tokens": len(prompt_ids),
                "completion_tokens": len(completion_ids),
                **{key: traj[key][i].item() for key in ("num_turns", "retokenization_drift") if key in traj.keys()},
            })
    return rows


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


def _write_outputs(out: Path, batch: Any, rows: list[dict[str, Any]], summary: dict[str, Any]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    traj_dir = out / "trajectories"
    if traj_dir.exists():
        shutil.rmtree(traj_dir)
    batch.memmap(traj_dir)
    with (out / "rollouts.jsonl").open("w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")


if __name__ == "__main__":
    sys.exit(main())

"""``rollout``: the command line.

``rollout run`` turns a dataset into trajectories with the RLVR workflow and
writes, into ``--out``:

- ``trajectories/``: the padded batch, saved with TensorDict's own persistence
  (``TensorDict.load(DIR/"trajectories")`` or ``load_memmap`` reads it);
- ``rollouts.jsonl``: one line per trajectory (prompt, completion, reward,
  stop_reason, token counts);
- ``summary.json``: accounting, reward mean, truncation rate, throughput.

Bad input ends with one line ``rollout: error: ...`` on stderr and exit status 2.
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

logger = logging.getLogger(__name__)


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
    run = sub.add_parser("run", help="run the RLVR workflow over a dataset and write trajectories",
                         description="Run the RLVR workflow (chat template -> generate -> reward in worker "
                                     "processes) over a dataset; write trajectories/, rollouts.jsonl, summary.json.")
    run.add_argument("--model", default=None,
                     help="HF model folder or hub id (default: the built-in SmolLM2-135M-Instruct)")
    run.add_argument("--dataset", default="builtin:arith",
                     help="jsonl of {question, answer} rows (GSM8K format), or builtin:arith[:N] (default)")
    run.add_argument("--backend", default="hf", choices=("hf", "sim", "sglang", "vllm"),
                     help="inference backend (default hf: the model in this process)")
    run.add_argument("--server", action="append", default=[], metavar="URL",
                     help="server URL for --backend sglang|vllm (repeat for several; requests are routed "
                          "to the least loaded)")
    run.add_argument("--request-timeout", type=_positive_float, default=3600.0,
                     help="seconds a remote request may take in all, retries and failover included (default 3600)")
    run.add_argument("--n-samples", type=_positive_int, default=2, help="samples per prompt (default 2)")
    run.add_argument("--max-new-tokens", type=_positive_int, default=128, help="new-token budget (default 128)")
    run.add_argument("--temperature", type=_non_negative_float, default=1.0, help="sampling temperature (default 1.0)")
    run.add_argument("--concurrency", type=_positive_int, default=64, help="episodes in flight (default 64)")
    run.add_argument("--limit", type=_positive_int, default=None, help="use the first N rows of the dataset")
    run.add_argument("--seed", type=int, default=0, help="seed for torch and the sim backend (default 0)")
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
    run.add_argument("--quiet", action="store_true", help="no progress bar")
    from .bench import add_bench_parser
    from .serve import add_serve_parser

    add_serve_parser(sub)
    add_bench_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if args.command == "serve":
        return args.handler(args)
    if args.command == "bench":
        from .bench import run_bench

        return run_bench(args)
    if args.backend in ("sglang", "vllm") and not args.server:
        print(f"rollout: error: --backend {args.backend} needs at least one --server URL", file=sys.stderr)
        return 2
    try:
        summary = trio.run(_run, args)
    except (RolloutError, ValueError, OSError) as exc:
        print(f"rollout: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("rollout: interrupted", file=sys.stderr)
        return 130
    out = args.out
    print(
        f"{summary['accepted']}/{summary['submitted']} episodes accepted, {summary['trajectories']} trajectories, "
        f"reward mean {summary['reward_mean']:.3f}, {summary['generated_tokens']} tokens in "
        f"{summary['wall_seconds']:.1f} s ({summary['generated_tokens_per_second']:.1f} tok/s)"
    )
    print(f"wrote {out / 'trajectories'}/ , {out / 'rollouts.jsonl'} , {out / 'summary.json'}")
    return 0


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
    if args.backend in ("sglang", "vllm"):
        from .backends.remote import make_remote_backend

        tokenizer = AutoTokenizer.from_pretrained(resolve_model(args.model))
        return tokenizer, make_remote_backend(args.backend, args.server, request_timeout_s=args.request_timeout)
    if args.backend == "hf":
        from .backends.hf import HFBackend

        path = resolve_model(args.model)
        tokenizer = AutoTokenizer.from_pretrained(path)
        return tokenizer, HFBackend(path, tokenizer, max_batch_size=args.concurrency)
    from .backends.sim import SimBackend, SimConfig

    if args.model is None:
        from .testing import build_tiny_tokenizer

        tokenizer = build_tiny_tokenizer()
    else:
        tokenizer = AutoTokenizer.from_pretrained(resolve_model(args.model))
    config = SimConfig(vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id, first_token_id=0,
                       out_len_median=max(1, args.max_new_tokens // 2), out_len_sigma=0.5, seed=args.seed)
    return tokenizer, SimBackend(config)


async def _run(args: argparse.Namespace) -> dict[str, Any]:
    from rewards import gsm8k_reward
    from workflows.rlvr import RLVRWorkflow

    from .data import concat_padded_tensors
    from .datasets import load_dataset
    from .executor import EngineConfig, open_rollout_engine
    from .types import GenerationHyperparameters

    if args.max_head_offpolicyness is not None and args.consumer_batch_size is None:
        raise ValueError("--max-head-offpolicyness needs --consumer-batch-size (the batch a version consumes)")
    items = load_dataset(args.dataset, args.limit)
    tokenizer, backend = await trio.to_thread.run_sync(_tokenizer_and_backend, args)
    gconfig = GenerationHyperparameters(n_samples=args.n_samples, max_new_tokens=args.max_new_tokens,
                                        temperature=args.temperature, greedy=args.temperature == 0)
    workflow = RLVRWorkflow(gsm8k_reward, gconfig, tokenizer)
    config = EngineConfig(max_concurrent_rollouts=args.concurrency, reward_timeout_seconds=args.reward_timeout,
                          consumer_batch_size=args.consumer_batch_size or 1,
                          max_head_offpolicyness=args.max_head_offpolicyness,
                          dump_dir=str(args.dump_dir) if args.dump_dir else None)
    start = time.perf_counter()
    async with open_rollout_engine(backend, config, tokenizer=tokenizer) as engine:
        for item in items:
            engine.submit(item, workflow, group_size=args.group_size)
        results = await _collect(engine, len(items), quiet=args.quiet, step_every=args.consumer_batch_size)
        stats = engine.statistics()
    wall = time.perf_counter() - start
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
        "reward_mean": (sum(r["reward"] for r in rows) / len(rows)) if rows else 0.0,
        "truncation_rate": (sum(r["stop_reason"] == "length" for r in rows) / len(rows)) if rows else 0.0,
        "generated_tokens": n_gen,
        "wall_seconds": wall,
        "generated_tokens_per_second": n_gen / wall if wall > 0 else 0.0,
        "backend": args.backend,
        "model": args.model or ("builtin:smollm2" if args.backend == "hf" else "builtin:tiny-tokenizer"),
        "dataset": args.dataset,
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


async def _collect(engine: Any, total: int, *, quiet: bool, step_every: int | None) -> list[Any]:
    """Take every result as it ends, with live progress unless ``quiet``.  With
    ``step_every = B``, bump the policy version after each B accepted results, as
    a trainer consuming batches would."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    results: list[Any] = []
    since_step = 0
    start = time.perf_counter()
    with Progress(TextColumn("rollout"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  TextColumn("{task.fields[info]}"), disable=quiet, transient=False) as progress:
        bar = progress.add_task("episodes", total=total, info="")
        while len(results) < total:
            got = await engine.wait_results(1)
            results += got
            since_step += sum(r.status == "accepted" for r in got)
            if step_every and since_step >= step_every:
                since_step -= step_every
                engine.set_version(engine.version + 1)
            s = engine.statistics()
            rate = s.generated_tokens / max(time.perf_counter() - start, 1e-9)
            progress.update(bar, completed=len(results),
                            info=f"ok {s.accepted} rej {s.rejected} fail {s.failed} | in flight {s.running} "
                                 f"| {rate:.0f} tok/s | v{s.version}")
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
            })
    return rows


def _plain(obj: Any) -> Any:
    if obj is None or isinstance(obj, (int, float, str, bool)):
        return obj
    if isinstance(obj, dict):
        return {k: _plain(v) for k, v in obj.items()}
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

"""``rollout``'s argument parser: the subcommands, the ``rollout run`` options and the types
that check their values (a bad value is one line and exit status 2, before any work)."""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from collections.abc import Mapping
from typing import Any, NoReturn

from ._backend import SHARD_STATS_INTERVAL_S as _SHARD_STATS_INTERVAL_S
from ._deadlines import add_deadline_arguments


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


def _segments_bound(text: str) -> int | str:
    """``--scheduling-max-segments``: an int >= 1, or ``server`` (the backend's limit)."""
    if text == "server":
        return text
    try:
        int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1 or 'server', got {text!r}") from None
    return _positive_int(text)


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


def _adapter_folder(text: str) -> str:
    """``--lora``: a peft adapter folder (``adapter_config.json``) that exists here."""
    from ..backends.lora import adapter_folder_problem

    problem = adapter_folder_problem(text)
    if problem is not None:
        raise argparse.ArgumentTypeError(f"{text} {problem}")
    return text


def _lora_name(text: str) -> str:
    from ..types import valid_lora_name

    if not valid_lora_name(text):
        raise argparse.ArgumentTypeError(f"must be a name without spaces or slashes, got {text!r}")
    return text


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
    from ._workflow import add_workflow_arguments, workflows_epilog

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
    run.add_argument("--server-api-key", default=None, metavar="KEY",
                     help="API key of servers started with --api-key (vLLM, SGLang, rollout serve), sent as "
                          "Authorization: Bearer KEY (default: $ROLLOUT_SERVER_API_KEY, which keeps it out of the "
                          "process list; never written to config.toml or printed)")
    run.add_argument("--lora", type=_adapter_folder, default=None, metavar="PATH",
                     help="sample with this LoRA adapter (a peft adapter folder) on top of the model: --backend hf "
                          "loads it with peft (pip install 'trio-rollout[lora]'); vllm/sglang load it on every server "
                          "(vLLM: --enable-lora --max-lora-rank R and VLLM_ALLOW_RUNTIME_LORA_UPDATING=True; SGLang "
                          "and rollout serve: --enable-lora) from a copy in a temporary folder of this machine, which "
                          "the servers must be able to read")
    run.add_argument("--lora-name", type=_lora_name, default=None, metavar="NAME",
                     help="the adapter's name (default lora): it is served as NAME-v<version>")
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
    run.add_argument("--scheduling", choices=("fcfs", "length_aware"), default="fcfs",
                     help="episode scheduling (docs/guide/scheduling.md): fcfs, first come first served (default: "
                          "the fastest measured), or length_aware: each group's first sample probes, longer groups "
                          "go first (server priorities: vLLM --scheduling-policy priority, SGLang "
                          "--enable-priority-scheduling; needs --group-size > 1)")
    run.add_argument("--scheduling-max-segments", type=_segments_bound, default=None, metavar="N|server",
                     help="at most N generation requests on the servers at once, the rest wait in the engine, "
                          "lowest priority first (set it to the servers' running-sequence limit, vLLM's "
                          "--max-num-seqs; 'server': that limit as the backend reads it, summed over the "
                          "servers; default: no bound)")
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
                          "--shard-backend, --shard-timeout, --reward-backend, --scheduling, --scheduling-max-segments given "
                          "again replace the run's, for "
                          "this and every later resume")
    run.add_argument("--shard-episodes", type=_positive_int, default=64,
                     help="accepted episodes per trajectory shard, written atomically (default 64)")
    run.add_argument("--commit-interval", type=_positive_float, default=10.0,
                     help="seconds a finished episode waits at most before it is committed (default 10)")
    parser.run_parser = run  # for _explicit_options
    from ._options import add_user_run_arguments
    from ._report import add_report_parser
    from ..serve import add_serve_parser

    add_user_run_arguments(run)  # dataset mapping, --sim-*, live view, metrics, logging, --config
    add_deadline_arguments(run)  # --no-server-timeout, --attempt-timeout, --episode-timeout
    add_serve_parser(sub)
    sub.add_parser("bench", add_help=False, help=_BENCH_HELP)  # listed here; main() hands its options over
    add_report_parser(sub)
    return parser


_UNSET = object()


def _explicit_options(argv: list[str] | None) -> set[str]:
    """The ``rollout run`` options given on the command line (not defaulted)."""
    parser = build_parser()
    run = parser.run_parser
    appended = {a.dest for a in run._actions if isinstance(a, argparse._AppendAction)}  # (--server: appends to
    run.set_defaults(**{a.dest: None if a.dest in appended else _UNSET  # its default, so not a marker object)
                        for a in run._actions if a.dest != "help"})
    return {k for k, v in vars(parser.parse_args(argv)).items() if v is not _UNSET and not (k in appended and v is None)}

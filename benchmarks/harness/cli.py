"""``rollout bench``: the command line of the harness (``engine/cli/_main.py`` delegates
``rollout bench ...`` to :func:`main`; ``python -m benchmarks.harness.cli`` is the same).

With ``--backend sim`` (default) it runs the sides on a :class:`BenchConfig`
(options = its fields and :data:`~benchmarks.harness.config.SIM_OPTIONS`); with a
real backend, asynchronous vs synchronous batched rollout
(:mod:`benchmarks.async_vs_sync`); with ``--scenario tail``, the long-tail scheduling
policies against FCFS and a synchronous trainer (:mod:`.tail_cli`, its own options).
Prints one table, writes one JSON.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import fields
from typing import Any, NoReturn

from engine.backends.sim import SimConfig

from .config import DEFAULT_SIM, EXTRA_SIDES, SIDES, SIM_OPTIONS, BenchConfig, parse_sides
from .report import format_table, write_json
from .sides import compare, default_areal_python

__all__ = ["BACKENDS", "SCENARIOS", "add_bench_parser", "main", "run_bench"]


_HELP = {
    "tokenizer": "tiny | smollm2 | auto (smollm2 if built, else tiny) | a tokenizer folder",
    "window": "most episodes submitted and not yet consumed (default: concurrency + batch size)",
    "sample_every_s": "RSS sampling period in seconds",
    "batch_size": "consumer batch: episodes taken per wait, with a version bump after each",
    "warmup": "episodes run first on a throw-away executor (not measured)",
    "reward_workers": "reward worker processes per side (none: each side's default)",
    "reward_batch_size": "our reward pool's micro-batch cap (none: EngineConfig's default, adaptive; 1: off)",
    "gc_tuning": "EngineConfig.gc_tuning on our side (0/1; default 0, as shipped)",
    "max_running_seqs": "sim: sequences the server runs at once (none: unbounded)",
}


def _opt_int(text: str) -> int | None:
    return None if text.lower() == "none" else int(text)


def _bool(text: str) -> bool:
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected 0/1, true/false, yes/no or on/off, got {text!r}")


#: ``rollout bench --scenario``: ``throughput`` (this module) or ``tail`` (:mod:`.tail_cli`).
SCENARIOS = ("throughput", "tail")
#: ``rollout bench --backend``: ``sim`` (the simulated server, sides ours/AReaL/naive) or a real
#: backend (asynchronous vs synchronous batched rollout, :mod:`benchmarks.async_vs_sync`).
BACKENDS = ("sim", "hf", "sglang", "vllm")
#: Options shared by both kinds, and what they mean with a real backend (defaults there differ).
_REAL_MEANING = {"episodes": "real: GSM8K prompts (default 32)",
                 "concurrency": "real: the synchronous batch and the asynchronous episodes in flight (default 8)",
                 "max_new_tokens": "real: default 256", "seed": "real: per-request seeds derive from it"}


def add_bench_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``bench`` to ``rollout``'s subparsers (options = :class:`BenchConfig` fields
    for ``--backend sim``, plus the real-backend ones of :mod:`benchmarks.async_vs_sync`).
    Every option defaults to None here: each kind fills in its own defaults."""
    p = subparsers.add_parser("bench", help="throughput benchmark: on the simulated server side by side with "
                                            "AReaL's executor and a naive loop (--backend sim), or asynchronous "
                                            "vs synchronous batched rollout on a real backend "
                                            "(--backend hf|sglang|vllm)")
    p.add_argument("--scenario", default="throughput", choices=SCENARIOS,
                   help="throughput (default): the sides below; tail: scheduling policies on the long tail, in "
                        "virtual time (`rollout bench --scenario tail --help` for its options)")
    p.add_argument("--backend", default="sim", choices=BACKENDS,
                   help="sim (default): the simulated server; hf|sglang|vllm: async vs sync rollout on a real "
                        "model (hf: in this process; sglang|vllm: --server URL)")
    defaults = BenchConfig()
    sim_fields = [f for f in fields(SimConfig) if f.name in SIM_OPTIONS]
    for f in [f for f in fields(BenchConfig) if f.name not in ("sim", "record")] + sim_fields:
        flag = "--" + f.name.replace("_", "-")
        default = getattr(DEFAULT_SIM if f in sim_fields else defaults, f.name)
        kinds = {"int": int, "float": float, "str": str, "bool": _bool}
        kind = _opt_int if "None" in str(f.type) else kinds[str(f.type)]
        extra = _HELP.get(f.name)
        text = f"{extra} (default {default})" if extra else f"(default {default})"
        if f.name in _REAL_MEANING:
            text += f"; {_REAL_MEANING[f.name]}"
        p.add_argument(flag, type=kind, default=None, help=text)
    p.add_argument("--sides", default=None,
                   help=f"sim: comma-separated subset of {','.join(SIDES + EXTRA_SIDES)} (default {','.join(SIDES)}; "
                        "ours_gc: ours with gc_tuning on)")
    p.add_argument("--repeats", type=int, default=1, help="runs per side (or mode), interleaved; medians reported")
    p.add_argument("--areal-python", default=None,
                   help=f"sim: the AReaL peer venv's python (default {default_areal_python()})")
    p.add_argument("--out", default="rollout-out/bench.json", help="JSON output (default rollout-out/bench.json)")
    real = p.add_argument_group("real backends (--backend hf|sglang|vllm)")
    real.add_argument("--server", action="append", default=[], metavar="URL", help="server URL (sglang|vllm; repeat)")
    real.add_argument("--model", default=None, help="hf: model spec (default builtin:smollm2); servers: the model "
                                                    "whose tokenizer to use (default: what they report)")
    real.add_argument("--dataset", default=None, help="GSM8K-format jsonl (default: the first 64 GSM8K test rows, "
                                                      "benchmarks/data/gsm8k_test_64.jsonl)")
    real.add_argument("--temperature", type=float, default=None, help="sampling temperature (default 1.0)")
    real.add_argument("--hf-mode", default="continuous", choices=("continuous", "static"),
                      help="hf serving mode (default continuous: finished rows leave, new ones join)")
    real.add_argument("--torch-threads", type=int, default=1, help="hf: torch intra-op threads (default 1)")
    real.add_argument("--server-pid", type=int, default=None, help="a local server's pid: report its CPU (/proc)")
    real.add_argument("--modes", default="sync,async", help="which modes run, in this order (default sync,async)")
    real.add_argument("--request-timeout", type=float, default=3600.0, help="seconds per remote request (default 3600)")
    real.add_argument("--startup-timeout", type=float, default=300.0,
                      help="seconds to wait for a server at start-up (default 300)")
    return p


def run_bench(args: argparse.Namespace) -> int:
    """``rollout bench``: run the sides (or, with a real backend, the two modes),
    print one table, write one JSON; exit status."""
    if getattr(args, "backend", "sim") != "sim":
        from benchmarks.async_vs_sync import run_from_args

        return run_from_args(args)
    real_only = [flag for flag, given in (("--server", args.server), ("--model", args.model),
                                          ("--dataset", args.dataset), ("--temperature", args.temperature),
                                          ("--server-pid", args.server_pid)) if given]
    names = {f.name for f in fields(BenchConfig)} | set(SIM_OPTIONS)
    try:
        if real_only:
            raise ValueError(f"{real_only[0]} applies to --backend hf|sglang|vllm, not sim")
        cfg = BenchConfig(**{k: v for k, v in vars(args).items() if k in names and v is not None})
        sides = parse_sides(args.sides or ",".join(SIDES))
        results = compare(cfg, sides, areal_python=args.areal_python, repeats=args.repeats,
                          log=lambda m: print(m, file=sys.stderr))
    except (ValueError, RuntimeError) as exc:
        print(f"rollout bench: error: {exc}", file=sys.stderr)
        return 2
    tokenizers = sorted({r["tokenizer"] for r in results if r.get("tokenizer")})
    print(format_table(results, title=f"rollout bench: {cfg.episodes} episodes, {cfg.concurrency} in flight, "
                                      f"{cfg.sim.prefill_s} s + {cfg.sim.per_token_s} s/token x ~{cfg.sim.out_len_median}, "
                                      f"tokenizer {'/'.join(tokenizers) or cfg.tokenizer}"))
    path = write_json(args.out, "bench", cfg.to_dict(), results)
    print(f"wrote {path}")
    return 0 if all(r.get("failed", 0) == 0 or cfg.sim.error_fraction > 0 for r in results) else 1


class _Parser(argparse.ArgumentParser):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)  # whole option names only (--out is not --out-len-median)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:  # one line, no usage dump (as rollout's other commands)
        self.exit(2, f"{self.prog}: error: {message}\n")


def main(argv: list[str] | None = None) -> int:
    """``rollout bench ...`` / ``python -m benchmarks.harness.cli ...``: ``argv`` are the
    options after ``bench``; the exit status (2: bad options)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    pre.add_argument("--scenario", default="throughput")
    if pre.parse_known_args(argv)[0].scenario == "tail":
        from .tail_cli import main as tail_main

        return tail_main(argv)
    parser = _Parser(prog="rollout")
    bench = add_bench_parser(parser.add_subparsers(dest="command", required=True, parser_class=_Parser))
    args, extra = parser.parse_known_args(["bench", *argv])
    if extra:  # bench's error (`rollout bench: error: ...`, as its others), not `rollout`'s
        bench.error(f"unrecognized arguments: {' '.join(extra)}")
    return run_bench(args)


if __name__ == "__main__":
    sys.exit(main())

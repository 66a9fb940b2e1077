"""``rollout run``'s options for a user's own run: data, the simulated server, the
live view, metrics, logging and the config file; and what they build.

Kept apart from :mod:`engine.cli` so that the run loop there stays small.
"""

from __future__ import annotations

import argparse
import logging
import math
import sys
from typing import Any

__all__ = ["LOG_LEVELS", "add_user_run_arguments", "configure_logging", "data_spec", "sim_backend", "sim_config"]

LOG_LEVELS = ("debug", "info", "warning", "error")
_HANDLER_TAG = "_rollout_cli_handler"


def _number(minimum: float, *, integer: bool = False, maximum: float | None = None, above: bool = False):
    def parse(text: str) -> float:
        try:
            value = int(text) if integer else float(text)
        except ValueError:
            kind = "an integer" if integer else "a number"
            raise argparse.ArgumentTypeError(f"expected {kind}, got {text!r}") from None
        bad = not math.isfinite(value) or value < minimum or (above and value == minimum)
        if bad or (maximum is not None and value > maximum):
            where = f"in [{minimum}, {maximum}]" if maximum is not None else f"{'>' if above else '>='} {minimum}"
            raise argparse.ArgumentTypeError(f"must be a finite number {where}, got {text}")
        return value

    return parse


def add_user_run_arguments(run: argparse.ArgumentParser) -> None:
    """Add the data, sim, view, metrics, logging and config options to ``rollout run``."""
    data = run.add_argument_group("dataset (Hugging Face datasets: jsonl/json/parquet/csv/arrow files, save_to_disk "
                                  "folders, hub ids; or builtin:arith[:N], builtin:shapes[:N])")
    data.add_argument("--split", default=None, help="split to use (default: train, or the only split)")
    data.add_argument("--subset", default=None, help="a hub dataset's configuration name (e.g. main for openai/gsm8k)")
    data.add_argument("--shuffle", action="store_true", help="shuffle rows (with --seed) before --limit")
    data.add_argument("--epochs", type=_number(1, integer=True), default=1,
                      help="use every row this many times (default 1)")
    data.add_argument("--prompt-key", default=None,
                      help="column holding the prompt text (default: the first of question, prompt, problem, input, "
                           "instruction, query)")
    data.add_argument("--answer-key", default=None,
                      help="column passed to the reward as 'answer' (default: the first of answer, solution, "
                           "ground_truth, reference, target)")
    data.add_argument("--messages-key", default=None,
                      help="column holding a chat, a list of {role, content} (default: messages, when present)")
    data.add_argument("--system-prompt", default=None, help="a system turn put first in every chat")
    data.add_argument("--prompt-template", default=None,
                      help="user turn built from columns: 'Solve: {problem}' ({{ and }} are literal braces; "
                           "the reward's answer-format hint is then not added)")
    data.add_argument("--skip-bad-rows", action="store_true",
                      help="skip rows that cannot be used (one warning line each) instead of refusing the dataset")

    sim = run.add_argument_group("simulated server (--backend sim; engine.backends.sim.SimConfig)")
    sim.add_argument("--sim-per-token-s", type=_number(0), default=None,
                     help="seconds per decode step of a lone sequence (default 0: instant)")
    sim.add_argument("--sim-prefill-s", type=_number(0), default=None, help="seconds of prefill per request")
    sim.add_argument("--sim-prefill-s-per-token", type=_number(0), default=None,
                     help="seconds of prefill per prompt token")
    sim.add_argument("--sim-out-len-median", type=_number(1, integer=True), default=None,
                     help="median completion length in tokens (default --max-new-tokens / 2)")
    sim.add_argument("--sim-out-len-sigma", type=_number(0), default=None,
                     help="lognormal shape of completion lengths (default 0.5; 0: always the median)")
    sim.add_argument("--sim-max-running-seqs", type=_number(1, integer=True), default=None,
                     help="sequences the server holds at once; the rest queue (default unbounded)")
    sim.add_argument("--sim-decode-slowdown-per-seq", type=_number(0), default=None,
                     help="each decoding sequence beyond the first makes a step this fraction slower")
    sim.add_argument("--sim-straggler-fraction", type=_number(0, maximum=1), default=None,
                     help="fraction of requests that are stragglers")
    sim.add_argument("--sim-straggler-multiplier", type=_number(1), default=None,
                     help="how many times slower a straggler is")
    sim.add_argument("--sim-error-fraction", type=_number(0, maximum=1), default=None,
                     help="fraction of requests that fail after prefill")
    sim.add_argument("--sim-abort-fraction", type=_number(0, maximum=1), default=None,
                     help="fraction of requests interrupted half-way (then resumed)")
    sim.add_argument("--sim-text", default=None,
                     help="completions are slices of this text repeated (default: random tokens), e.g. "
                          "'The answer is \\boxed{4}. ' to rehearse the reward path too")

    view = run.add_argument_group("live view, metrics, logging, config file")
    view.add_argument("--progress-interval", type=_number(0, above=True), default=5.0,
                      help="seconds between progress lines when stderr is not a terminal (default 5)")
    view.add_argument("--metrics-port", type=_number(0, integer=True, maximum=65535), default=None,
                      help="serve Prometheus metrics on this port while the run lasts (0: any free port)")
    view.add_argument("--metrics-host", default="127.0.0.1", help="address the metrics endpoint binds (default "
                                                                  "127.0.0.1)")
    view.add_argument("--log-level", default="warning", choices=LOG_LEVELS,
                      help="log level of trio-rollout's loggers (namespace 'rollout'; default warning)")
    view.add_argument("--config", default=None, metavar="FILE.toml",
                      help="read options from a TOML file (keys: the long options, '-' or '_'); flags override it")
    view.add_argument("--print-config", action="store_true",
                      help="print the merged configuration as TOML and exit (the run saves it as config.toml in "
                           "--out; with --resume DIR: the options the resume would run with)")


def data_spec(args: argparse.Namespace, *, required: tuple[str, ...], prompt_suffix: str) -> Any:
    """The :class:`engine.datasets.DataSpec` of ``rollout run``'s options."""
    from ..datasets import DataSpec

    return DataSpec(source=args.dataset, split=args.split, subset=args.subset, limit=args.limit,
                    shuffle=args.shuffle, seed=args.seed, epochs=args.epochs, prompt_key=args.prompt_key,
                    answer_key=args.answer_key, messages_key=args.messages_key, system_prompt=args.system_prompt,
                    prompt_template=args.prompt_template, prompt_suffix=prompt_suffix, required=required,
                    skip_bad_rows=args.skip_bad_rows)


_SIM_FIELDS = ("per_token_s", "prefill_s", "prefill_s_per_token", "out_len_median", "out_len_sigma",
               "max_running_seqs", "decode_slowdown_per_seq", "straggler_fraction", "straggler_multiplier",
               "error_fraction", "abort_fraction")


def sim_config(args: argparse.Namespace, tokenizer: Any) -> Any:
    """The :class:`~engine.backends.sim.SimConfig` of ``--sim-*`` (unset ones: defaults)."""
    from ..backends.sim import SimConfig

    chosen = {name: getattr(args, f"sim_{name}") for name in _SIM_FIELDS
              if getattr(args, f"sim_{name}", None) is not None}
    chosen.setdefault("out_len_median", max(1, args.max_new_tokens // 2))
    chosen.setdefault("out_len_sigma", 0.5)
    if "straggler_fraction" in chosen and "straggler_multiplier" not in chosen:
        chosen["straggler_multiplier"] = 10.0
    return SimConfig(vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id, first_token_id=0,
                     seed=args.seed, **chosen)


def sim_backend(args: argparse.Namespace, tokenizer: Any) -> Any:
    """The :class:`~engine.backends.sim.SimBackend` of ``--sim-*`` (``--sim-text``: its token pool)."""
    from ..backends.sim import SimBackend

    text = getattr(args, "sim_text", None)
    if text is not None and not text:
        raise ValueError("--sim-text: must not be empty")
    pool = tokenizer.encode(text, add_special_tokens=False) if text else None
    return SimBackend(sim_config(args, tokenizer), token_pool=pool)


def configure_logging(level: str = "warning") -> None:
    """The CLI's logging: one stderr handler on the ``rollout`` logger (the package's
    namespace), every line prefixed with level, time and logger name.  Called again,
    it replaces its handler (no duplicate lines)."""
    root = logging.getLogger("rollout")
    for handler in list(root.handlers):
        if getattr(handler, _HANDLER_TAG, False):
            root.removeHandler(handler)
    handler = logging.StreamHandler(sys.stderr)
    setattr(handler, _HANDLER_TAG, True)
    handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s %(name)s: %(message)s", "%H:%M:%S"))
    root.addHandler(handler)
    root.setLevel(getattr(logging, level.upper()))

"""The learning proof: GRPO through TRL's ``GRPOTrainer`` with trio-rollout generating
(``engine.integrations.trl.TRLRollout``), on SmolLM2-135M-Instruct, on a 2-core CPU.

**Task.** "What is 17 - 5? Reply with the number only." (a one-turn chat; SmolLM2's chat
template adds its default system prompt): ``a + b`` or ``a - b`` with ``0 <= a, b <= 20`` and
``a >= b`` for ``-`` (no negative answers), 672 distinct problems.  Chosen by measuring the
base model first (greedy, 12 new tokens, a lenient and a strict parser): it *never* answers
with the number alone (0 of 64; 1 of 256 samples at temperature 0.6), so a number-alone
reward gives GRPO no signal; but it often answers ``"12 + 13 = 25"`` or ``"16 - 4 is 12."``,
right 37.5 % of the time (the 128 held-out problems), and otherwise wanders off (``"To
solve this problem, we need to..."``, cut at 12 tokens).  At temperature 0.7, 59 % of
8-sample groups hold both a right and a wrong answer (32 probe problems): the advantage is
non-zero there, so GRPO can move the greedy answer towards what some samples already get
right (pass@8 0.59 against greedy 0.375 on the probe).

**Reward** (training and eval): ``rewards.gsm8k:gsm8k_reward``, the project's GSM8K reward:
1.0 when the completion's final number (the last number in the text, there being no ``####``
or ``\\boxed``) equals the answer, else 0.0.  Scored by the engine's reward pool; TRL's
reward function only reads it (``engine_reward``).

**Held-out eval.** ``--eval-size`` problems never trained on (disjoint ``(a, op, b)``; the
training rows are the rest, shuffled with ``--seed``), answered *greedily* by the engine with
the trainer's current weights (synced before each eval), scored with the same reward: before
training and every ``--eval-every`` steps (and after the last).  Also recorded: the fraction
of greedy answers that are the number alone (format, not correctness) and a few samples.

**Hyperparameters** (the defaults): 4 prompts x ``num_generations`` 8 = 32 completions a
step, one optimizer step per generation call (TRL's default ``steps_per_generation``), 40
steps, ``max_new_tokens`` 12 (the model's "12 + 13 = 25" is 10 tokens), temperature 0.7 (the
workflow's gconfig and ``GRPOConfig.temperature`` both: TRL recomputes logprobs at its own
temperature; at 1.0 most of this 135M model's samples are nonsense), ``beta`` 0 (TRL's default:
no reference model), TRL's default loss (``"dapo"``) and advantage scaling (``"group"``),
AdamW (``Trainer``'s defaults: no weight decay, the rate decayed linearly to 0 over the steps,
gradient norm clipped at 1.0) at ``--lr`` 2e-5: a 3-point sweep of short synchronous runs (held-out accuracy from 0.39
on 64 problems; ``benchmarks/reference/learn_lr_sweep.json``) gave 5e-6: 0.52 at step 5, 0.53
at 10; 2e-5: 0.61, 0.69, 0.72 at 15; 5e-5: 0.59, then 0.41 at 10 (unstable).  Gradient
checkpointing off (it only saves memory, and costs a recomputed forward); bf16 autocast
(``GRPOConfig(bf16=True)``, TRL's default, with float32 master weights: this CPU has AMX-bf16);
the engine's ``hf`` backend in float32.  ``--max-staleness 1``: the adapter generates the next
call's batch while TRL trains, with ``GRPOConfig.off_policy_mask_threshold=0.5``
(DeepSeek-V3.2's off-policy sequence mask; 0.5 is the value TRL's docs suggest) for the
one-step-old samples.

**Threads.** ``torch.set_num_threads(1)`` by default, as the other benchmarks here: on this
shared 2-core machine a float32 forward+backward of 16 x 57 tokens took 10-36 s with 2
intra-op threads against 6-9 s with 1 (4-11 s with bf16 autocast), measured with other jobs
running (a second OpenMP thread stalls at every barrier while another process holds a core).
The engine's generation runs in its own thread: with run-ahead the trainer and the engine
use a core each; synchronously they take turns.

Writes ``--json`` (per step: reward mean/std, wall seconds, generated tokens, the seconds TRL
waited for rollouts vs the rest of the step; each eval with its step, its wall seconds and its
accuracy), ``--png`` (training reward and held-out accuracy against training wall-clock) and
the final policy (``save_pretrained``, with its tokenizer) under ``--out``, printed at the end.
Wall seconds count training only: evals pause the clock (with run-ahead, the prefetch goes on
during an eval, which the next step's ``rollout_wait_s`` shows).

Run::

    make learn                                           # SmolLM2, synchronous (max_staleness 0)
    make learn LEARN_ARGS="--max-staleness 1 --json benchmarks/results/learn_async.json \\
        --png benchmarks/results/learn_async.png --out benchmarks/results/learn_async_policy"
    .venv/bin/python benchmarks/learn.py --model builtin:tiny --steps 2 --eval-every 1 --eval-size 8  # plumbing
    .venv/bin/python benchmarks/learn.py --compare benchmarks/results/learn.json benchmarks/results/learn_async.json \
        --png benchmarks/results/learn_sync_vs_async.png                      # the curves side by side
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import sys
import time
import warnings
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b}
INSTRUCTION = "Reply with the number only."
REWARD = "rewards.gsm8k:gsm8k_reward"
_NUMBER_ALONE = re.compile(r"\s*-?\d+\.?\s*")


def is_number_alone(text: str) -> bool:
    """Whether ``text`` is one integer alone (whitespace and one trailing ``.`` allowed)."""
    return bool(_NUMBER_ALONE.fullmatch(text))


def problems(seed: int, n_eval: int, n_train: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Disjoint (train, held-out) lists of rows ``{"prompt": [user message], "answer": str}``.

    All 672 problems ``a + b`` and ``a - b`` (``0 <= a, b <= 20``, ``a >= b`` for ``-``),
    shuffled with ``seed``: the first ``n_eval`` are held out, the next ``n_train`` train
    (``n_eval + n_train`` above 672 is a ``ValueError``).
    """
    triples = [(a, op, b) for a in range(21) for b in range(21) for op in OPS if op == "+" or a >= b]
    if n_eval + n_train > len(triples) or n_eval < 1 or n_train < 1:
        raise ValueError(f"--eval-size + --train-size must be in 2..{len(triples)}, got {n_eval} + {n_train}")
    random.Random(seed).shuffle(triples)

    def row(t: tuple[int, str, int]) -> dict[str, Any]:
        a, op, b = t
        return {"prompt": [{"role": "user", "content": f"What is {a} {op} {b}? {INSTRUCTION}"}],
                "answer": str(OPS[op](a, b))}

    return [row(t) for t in triples[n_eval: n_eval + n_train]], [row(t) for t in triples[:n_eval]]


def evaluate(engine: Any, workflow: Any, tokenizer: Any, rows: list[dict[str, Any]],
             timeout_s: float = 600.0) -> dict[str, Any]:
    """Greedy accuracy on ``rows`` with the engine's current weights.

    Returns ``eval_accuracy`` (mean reward; an episode that did not end accepted counts as
    wrong), ``eval_number_alone`` (fraction of answers that are the number alone), ``eval_s``
    and ``samples`` (the first 6 ``[question, answer, completion]``).
    """
    start = time.perf_counter()
    ids = [engine.submit({"messages": r["prompt"], "answer": r["answer"]}, workflow) for r in rows]
    rewards, texts = [], []
    for task_id in ids:
        result = engine.wait_for_task(task_id, timeout_s)
        traj = result.trajectory if result.status == "accepted" else None
        if traj is None:
            rewards.append(0.0)
            texts.append(f"<{result.status}: {result.reason}>")
            continue
        mask = traj["loss_mask"][0].bool()
        texts.append(tokenizer.decode(traj["input_ids"][0][mask].tolist(), skip_special_tokens=True))
        rewards.append(float(traj["rewards"][0]))
    return {"eval_accuracy": sum(rewards) / len(rows),
            "eval_number_alone": sum(map(is_number_alone, texts)) / len(rows),
            "eval_s": round(time.perf_counter() - start, 2),
            "samples": [[r["prompt"][-1]["content"], r["answer"], t] for r, t in zip(rows[:6], texts[:6])]}


def plot(records: list[dict[str, Any]], evals: list[dict[str, Any]], path: Path, title: str) -> None:
    """The learning curve: training reward and held-out accuracy against training wall-clock."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([r["wall_s"] / 60 for r in records], [r["reward_mean"] for r in records],
            label="training reward (mean of the step's samples)", alpha=0.5)
    ax.plot([e["wall_s"] / 60 for e in evals], [e["eval_accuracy"] for e in evals], "o-",
            label=f"held-out accuracy (greedy, {evals[0]['eval_size']} problems)")
    ax.set_xlabel("training wall-clock (minutes; evals excluded)")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_comparison(paths: list[Path], out: Path) -> None:
    """Held-out accuracy against training wall-clock for several runs' JSON (``--compare``),
    each labelled with its trainer and ``max_staleness``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for path in paths:
        run = json.loads(path.read_text())
        evals = run["evals"]
        mode = "synchronous" if run["max_staleness"] == 0 else f"run-ahead (max_staleness {run['max_staleness']})"
        ax.plot([e["wall_s"] / 60 for e in evals], [e["eval_accuracy"] for e in evals], "o-",
                label=f"{run.get('trainer', 'TRL')}, {mode}: {run['steps']} steps")
    ax.set_xlabel("training wall-clock (minutes; evals excluded)")
    ax.set_ylabel(f"held-out accuracy (greedy, {evals[0]['eval_size']} problems)")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title(f"GRPO on {run['model']}: {run['task']}", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def build_parser(description: str, results: str = "learn") -> argparse.ArgumentParser:
    """The options of this benchmark (``benchmarks/learn_ours.py`` shares them); outputs
    default to ``benchmarks/results/<results>.json|.png`` and ``<results>_policy/``."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--model", default="builtin:smollm2")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--eval-every", type=int, default=5)
    parser.add_argument("--eval-size", type=int, default=128)
    parser.add_argument("--train-size", type=int, default=544)
    parser.add_argument("--prompts-per-step", type=int, default=4)
    parser.add_argument("--num-generations", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=12)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--lr", type=float, default=2e-5)
    parser.add_argument("--max-staleness", type=int, default=0,
                        help="0: synchronous; >= 1: run-ahead (TRL: with GRPOConfig(off_policy_mask_threshold=0.5); "
                             "learn_ours.py: EngineConfig(max_head_offpolicyness=N))")
    parser.add_argument("--no-bf16", dest="bf16", action="store_false", help="train in float32 (no bf16 autocast)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--torch-threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=RESULTS / f"{results}_policy", help="the final policy (save_pretrained)")
    parser.add_argument("--json", type=Path, default=RESULTS / f"{results}.json")
    parser.add_argument("--png", type=Path, default=RESULTS / f"{results}.png")
    parser.add_argument("--compare", type=Path, nargs="+", metavar="JSON",
                        help="train nothing: plot these runs' held-out accuracy against wall-clock into --png")
    return parser


def _shown(path: Path) -> str:
    """``path`` relative to the checkout when it lies inside it (as the reference JSON records it)."""
    resolved = path.resolve()
    return str(resolved.relative_to(ROOT)) if resolved.is_relative_to(ROOT) else str(resolved)


def write_outputs(args: argparse.Namespace, trainer: str, evals: list[dict[str, Any]],
                  records: list[dict[str, Any]], started: float) -> dict[str, Any]:
    """Write ``args.json`` and ``args.png``, print the one-line result; returns the summary."""

    def wall_to(accuracy: float) -> float | None:
        return next((e["wall_s"] for e in evals if e["eval_accuracy"] >= accuracy), None)

    before, after = evals[0]["eval_accuracy"], evals[-1]["eval_accuracy"]
    summary = {"trainer": trainer, "model": args.model,
               "task": f"a + b, a - b (0..20, a >= b for -); {INSTRUCTION!r}",
               "reward": REWARD, "max_staleness": args.max_staleness, "steps": args.steps,
               "prompts_per_step": args.prompts_per_step, "num_generations": args.num_generations,
               "max_new_tokens": args.max_new_tokens, "temperature": args.temperature, "lr": args.lr,
               "bf16": args.bf16, "torch_threads": args.torch_threads, "eval_size": args.eval_size,
               "train_size": args.train_size, "seed": args.seed, "eval_before": before, "eval_after": after,
               "eval_best": max(e["eval_accuracy"] for e in evals),
               "wall_s_to_before_plus_0.15": wall_to(before + 0.15),
               "train_wall_s": records[-1]["wall_s"] if records else 0.0,
               "total_s": round(time.perf_counter() - started, 1), "policy": _shown(args.out),
               "evals": evals, "per_step": records}
    for target in (args.json, args.png):
        target.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(summary, indent=2) + "\n")
    plot(records, evals, args.png, f"GRPO via {trainer} + trio-rollout, {args.model}, max_staleness {args.max_staleness}")
    print(f"held-out accuracy {before:.3f} -> {after:.3f} in {args.steps} steps "
          f"({summary['train_wall_s']:.0f} s of training); policy saved to {args.out}; {args.json}, {args.png}")
    return summary


def main(argv: list[str] | None = None) -> int:
    args = build_parser(__doc__.split("\n\n")[0]).parse_args(argv)
    if args.compare:
        plot_comparison(args.compare, args.png)
        print(args.png)
        return 0
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    warnings.filterwarnings("ignore", message=r".*gradient_checkpointing.* is deprecated", category=FutureWarning)

    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from transformers.trainer_callback import PrinterCallback
    from trl import GRPOConfig, GRPOTrainer

    from engine import EngineConfig, GenerationHyperparameters, HFBackend, RolloutEngineThread
    from engine.integrations.trl import TRLRollout, TRLRolloutConfig, engine_reward
    from engine.models import resolve_model
    from workflows.rlvr import RLVRWorkflow

    torch.set_num_threads(args.torch_threads)
    torch.manual_seed(args.seed)
    path = resolve_model(args.model)
    tok = AutoTokenizer.from_pretrained(path)
    sampled = RLVRWorkflow(REWARD, GenerationHyperparameters(max_new_tokens=args.max_new_tokens,
                                                             temperature=args.temperature), tok)
    greedy = RLVRWorkflow(REWARD, GenerationHyperparameters(max_new_tokens=args.max_new_tokens, greedy=True), tok)
    train_rows, eval_rows = problems(args.seed, args.eval_size, args.train_size)
    records: list[dict[str, Any]] = []
    evals: list[dict[str, Any]] = []
    rows_per_step = args.prompts_per_step * args.num_generations
    config = EngineConfig(max_concurrent_rollouts=max(rows_per_step * (args.max_staleness + 1), args.eval_size))
    started = time.perf_counter()

    with RolloutEngineThread(HFBackend(path, tok, dtype="float32"), config) as engine:
        rollout = TRLRollout(engine, sampled, TRLRolloutConfig(max_staleness=args.max_staleness))

        class Progress(TrainerCallback):
            """Per-step records, and the held-out evals (their time is excluded from ``wall_s``)."""

            def __init__(self) -> None:
                self.t0 = self.step_t0 = time.perf_counter()
                self.wait0 = 0.0
                self.tokens0 = 0
                self.paused = self.paused_total = 0.0
                self.cpu0 = time.process_time()

            def wall_s(self, now: float) -> float:
                return round(now - self.t0 - self.paused_total - self.paused, 2)

            def run_eval(self, step: int) -> None:
                pause, cpu_pause = time.perf_counter(), time.process_time()
                rollout.sync_weights(trainer)  # the engine generates with the trainer's current weights
                result = {"step": step, "wall_s": self.wall_s(pause), "eval_size": len(eval_rows),
                          **evaluate(engine, greedy, tok, eval_rows)}
                evals.append(result)
                print(f"eval at step {step} ({result['wall_s']:.0f} s): held-out accuracy "
                      f"{result['eval_accuracy']:.3f}, number alone {result['eval_number_alone']:.3f} "
                      f"({result['eval_s']:.1f} s); e.g. {result['samples'][0][2]!r}", flush=True)
                self.paused += time.perf_counter() - pause  # wall-clock counts training only
                self.cpu0 += time.process_time() - cpu_pause  # and so do CPU seconds

            def on_train_begin(self, _args, state, _control, **kwargs):
                self.t0 = time.perf_counter()
                self.run_eval(0)
                self.t0 = self.step_t0 = time.perf_counter()
                self.cpu0 = time.process_time()
                self.paused = 0.0
                self.tokens0 = engine.statistics().generated_tokens

            def on_log(self, _args, state, _control, logs=None, **kwargs):
                if not logs or "reward" not in logs:
                    return
                now, stats = time.perf_counter(), rollout.statistics()
                tokens = engine.statistics().generated_tokens
                row = {"step": state.global_step, "reward_mean": logs["reward"], "reward_std": logs.get("reward_std"),
                       "wall_s": self.wall_s(now), "step_s": round(now - self.step_t0 - self.paused, 2),
                       "rollout_wait_s": round(stats.wait_s - self.wait0, 2),
                       "generated_tokens": tokens - self.tokens0,
                       "completion_mean_length": logs.get("completions/mean_length")}
                row["train_s"] = round(row["step_s"] - row["rollout_wait_s"], 2)
                cpu = time.process_time()  # all threads of this process: the trainer's and the engine's
                row["cpu_s"], self.cpu0 = round(cpu - self.cpu0, 2), cpu
                row["load_avg_1m"] = round(os.getloadavg()[0], 2)  # the machine's, other processes included
                self.paused_total += self.paused
                self.step_t0, self.wait0, self.tokens0, self.paused = now, stats.wait_s, tokens, 0.0
                records.append(row)
                print(f"step {row['step']}: reward {row['reward_mean']:.3f}, {row['step_s']:.1f} s "
                      f"(rollout wait {row['rollout_wait_s']:.1f} s, train {row['train_s']:.1f} s), "
                      f"wall {row['wall_s']:.0f} s", flush=True)

            def on_step_end(self, _args, state, _control, **kwargs):
                if state.global_step % args.eval_every == 0 or state.global_step == args.steps:
                    self.run_eval(state.global_step)

        grpo = GRPOConfig(
            output_dir=str(args.out.parent / "learn_trl"), max_steps=args.steps, learning_rate=args.lr,
            per_device_train_batch_size=rows_per_step, num_generations=args.num_generations,
            max_completion_length=args.max_new_tokens, temperature=args.temperature, beta=0.0,
            bf16=args.bf16, gradient_checkpointing=False, use_cpu=not torch.cuda.is_available(),
            report_to="none", save_strategy="no", logging_steps=1, disable_tqdm=True, seed=args.seed,
            off_policy_mask_threshold=0.5 if args.max_staleness else None)
        trainer = GRPOTrainer(model=path, reward_funcs=engine_reward, args=grpo,
                              train_dataset=Dataset.from_list(train_rows), processing_class=tok,
                              rollout_func=rollout, callbacks=[Progress()])
        trainer.remove_callback(PrinterCallback)
        trainer.train()
        rollout.discard_prefetched()
        args.out.mkdir(parents=True, exist_ok=True)
        policy: Any = trainer.accelerator.unwrap_model(trainer.model)
        policy.save_pretrained(args.out)
        tok.save_pretrained(args.out)

    write_outputs(args, "TRL", evals, records, started)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The learning proof: GRPO through TRL's ``GRPOTrainer`` with trio-rollout generating
(``engine.integrations.trl.TRLRollout``), on a task the built-in SmolLM2-135M-Instruct can
learn on a CPU: one-step arithmetic answered with the number alone.

* Task: "What is 17 + 5? Reply with the number only." (``a op b``, ``op`` in ``+ -``,
  operands 0..20).  Training reward (:func:`arithmetic_reward`): 1.0 when the whole
  completion is the right integer (surrounding whitespace and one trailing ``.`` allowed),
  0.25 when it is wordy but its last integer is right, else 0.0 (the 135M model answers
  with the number alone too rarely for the strict reward alone to give GRPO a signal).
* Held-out eval: ``--eval-size`` problems whose ``(a, op, b)`` never appears in training,
  answered greedily by the engine with the trainer's current weights, scored strictly
  (:func:`number_alone_reward`): before training and every ``--eval-every`` steps.
* Writes ``--json`` (per step: reward mean/std, eval accuracy when measured, wall seconds,
  generated tokens, seconds TRL waited for rollouts vs the rest of the step), ``--png`` (the
  learning curve: training reward and held-out accuracy against step) and the final policy
  (``save_pretrained``, with its tokenizer) under ``--out``, for anyone to evaluate.

Run::

    make learn                                           # SmolLM2, synchronous (max_staleness 0)
    .venv/bin/python benchmarks/learn.py --max-staleness 1 --json benchmarks/results/learn_async.json
    .venv/bin/python benchmarks/learn.py --model builtin:tiny --steps 2 --eval-every 1   # plumbing check
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


def number_alone_reward(prompt: Any, completions: str, prompt_ids: Any, completion_ids: Any, answer: str,
                        **data: Any) -> float:
    """1.0 when the completion is exactly the integer ``answer`` (whitespace and one trailing
    ``.`` allowed), else 0.0.  Standard library only: it runs in reward worker processes."""
    text = (completions or "").strip()
    if text.endswith("."):
        text = text[:-1].rstrip()
    return 1.0 if text == str(answer) else 0.0


_INTEGERS = re.compile(r"-?\d+")


def arithmetic_reward(prompt: Any, completions: str, prompt_ids: Any, completion_ids: Any, answer: str,
                      **data: Any) -> float:
    """The training reward: :func:`number_alone_reward`, else 0.25 when the completion's
    last integer is ``answer`` (right, but not the number alone), else 0.0."""
    if number_alone_reward(prompt, completions, prompt_ids, completion_ids, answer):
        return 1.0
    found = _INTEGERS.findall(completions or "")
    return 0.25 if found and found[-1] == str(answer) else 0.0


def problems(seed: int, n_eval: int, n_train: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Disjoint (train, eval) lists of rows ``{"prompt": [user message], "answer": str}``."""
    triples = [(a, op, b) for a in range(21) for b in range(21) for op in OPS]
    random.Random(seed).shuffle(triples)

    def row(t: tuple[int, str, int]) -> dict[str, Any]:
        a, op, b = t
        return {"prompt": [{"role": "user", "content": f"What is {a} {op} {b}? {INSTRUCTION}"}],
                "answer": str(OPS[op](a, b))}

    held_out = [row(t) for t in triples[:n_eval]]
    train = [row(t) for t in triples[n_eval: n_eval + n_train]]
    return train, held_out


def evaluate(engine: Any, workflow: Any, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Greedy accuracy on ``rows`` with the engine's current weights (a failed episode counts as wrong)."""
    items = [{"messages": r["prompt"], "answer": r["answer"]} for r in rows]
    start = time.perf_counter()
    batch = engine.rollout_batch(items, workflow)
    rewards = batch["rewards"].tolist() if batch.batch_size[0] else []
    return {"eval_accuracy": sum(rewards) / len(rows), "eval_scored": len(rewards),
            "eval_s": round(time.perf_counter() - start, 2)}


def plot(records: list[dict[str, Any]], evals: list[dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([r["step"] for r in records], [r["reward_mean"] for r in records], label="training reward (mean)",
            alpha=0.6)
    ax.plot([e["step"] for e in evals], [e["eval_accuracy"] for e in evals], "o-", label="held-out accuracy (greedy)")
    ax.set_xlabel("GRPO step")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="builtin:smollm2")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--eval-size", type=int, default=64)
    parser.add_argument("--train-size", type=int, default=768)
    parser.add_argument("--prompts-per-step", type=int, default=4)
    parser.add_argument("--num-generations", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=10)
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--max-staleness", type=int, default=0,
                        help="0: synchronous; >= 1: run-ahead with GRPOConfig(off_policy_mask_threshold=0.5)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--torch-threads", type=int, default=None)
    parser.add_argument("--out", type=Path, default=RESULTS / "learn_policy", help="the final policy (save_pretrained)")
    parser.add_argument("--json", type=Path, default=RESULTS / "learn.json")
    parser.add_argument("--png", type=Path, default=RESULTS / "learn.png")
    args = parser.parse_args(argv)
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

    torch.set_num_threads(args.torch_threads or max(1, os.cpu_count() or 1))
    torch.manual_seed(args.seed)
    path = resolve_model(args.model)
    tok = AutoTokenizer.from_pretrained(path)
    sampled = RLVRWorkflow("benchmarks.learn:arithmetic_reward",
                           GenerationHyperparameters(max_new_tokens=args.max_new_tokens), tok)
    greedy = RLVRWorkflow("benchmarks.learn:number_alone_reward",
                          GenerationHyperparameters(max_new_tokens=args.max_new_tokens, greedy=True), tok)
    train_rows, eval_rows = problems(args.seed, args.eval_size, args.train_size)
    records: list[dict[str, Any]] = []
    evals: list[dict[str, Any]] = []
    rows_per_step = args.prompts_per_step * args.num_generations
    config = EngineConfig(max_concurrent_rollouts=max(rows_per_step * (args.max_staleness + 1), args.eval_size))

    with RolloutEngineThread(HFBackend(path, tok, dtype="float32"), config) as engine:
        rollout = TRLRollout(engine, sampled, TRLRolloutConfig(max_staleness=args.max_staleness))

        def run_eval(trainer: Any, step: int) -> None:
            rollout.sync_weights(trainer)  # the engine generates with the trainer's current weights
            result = {"step": step, **evaluate(engine, greedy, eval_rows)}
            evals.append(result)
            print(f"eval at step {step}: held-out accuracy {result['eval_accuracy']:.3f} "
                  f"({result['eval_s']:.1f} s)", flush=True)

        class Progress(TrainerCallback):
            def __init__(self) -> None:
                self.t0 = self.step_t0 = time.perf_counter()
                self.wait0 = 0.0
                self.tokens0 = 0
                self.paused = self.paused_total = 0.0  # seconds of held-out evals (not training)

            def on_train_begin(self, _args, state, _control, **kwargs):
                run_eval(trainer, 0)
                self.t0 = self.step_t0 = time.perf_counter()
                self.tokens0 = engine.statistics().generated_tokens

            def on_log(self, _args, state, _control, logs=None, **kwargs):
                if not logs or "reward" not in logs:
                    return
                now, stats = time.perf_counter(), rollout.statistics()
                tokens = engine.statistics().generated_tokens
                self.paused_total += self.paused
                row = {"step": state.global_step, "reward_mean": logs["reward"], "reward_std": logs.get("reward_std"),
                       "wall_s": round(now - self.t0 - self.paused_total, 2),
                       "step_s": round(now - self.step_t0 - self.paused, 2),
                       "rollout_wait_s": round(stats.wait_s - self.wait0, 2),
                       "generated_tokens": tokens - self.tokens0,
                       "completion_mean_length": logs.get("completions/mean_length")}
                row["train_s"] = round(row["step_s"] - row["rollout_wait_s"], 2)
                self.step_t0, self.wait0, self.tokens0, self.paused = now, stats.wait_s, tokens, 0.0
                records.append(row)
                print(f"step {row['step']}: reward {row['reward_mean']:.3f}, {row['step_s']:.1f} s "
                      f"(rollout wait {row['rollout_wait_s']:.1f} s, train {row['train_s']:.1f} s)", flush=True)

            def on_step_end(self, _args, state, _control, **kwargs):
                if state.global_step % args.eval_every == 0 or state.global_step == args.steps:
                    pause = time.perf_counter()
                    run_eval(trainer, state.global_step)
                    self.paused += time.perf_counter() - pause  # wall-clock counts training only

        grpo = GRPOConfig(
            output_dir=str(args.out.parent / "learn_trl"), max_steps=args.steps, learning_rate=args.lr,
            per_device_train_batch_size=rows_per_step, num_generations=args.num_generations,
            max_completion_length=args.max_new_tokens, temperature=1.0, bf16=False,
            use_cpu=not torch.cuda.is_available(), report_to="none", save_strategy="no", logging_steps=1,
            disable_tqdm=True, seed=args.seed, off_policy_mask_threshold=0.5 if args.max_staleness else None)
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

    summary = {"model": args.model, "max_staleness": args.max_staleness, "steps": args.steps,
               "prompts_per_step": args.prompts_per_step, "num_generations": args.num_generations,
               "lr": args.lr, "eval_size": args.eval_size, "seed": args.seed,
               "eval_before": evals[0]["eval_accuracy"], "eval_after": evals[-1]["eval_accuracy"],
               "train_wall_s": records[-1]["wall_s"] if records else 0.0, "policy": str(args.out),
               "evals": evals, "per_step": records}
    for target in (args.json, args.png):
        target.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(summary, indent=2) + "\n")
    plot(records, evals, args.png, f"GRPO via TRL + trio-rollout: {args.model}, max_staleness {args.max_staleness}")
    print(f"held-out accuracy {summary['eval_before']:.3f} -> {summary['eval_after']:.3f} in {args.steps} steps "
          f"({summary['train_wall_s']:.0f} s of training); policy saved to {args.out}; {args.json}, {args.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""GRPO with Hugging Face TRL, trio-rollout generating: ``GRPOTrainer(rollout_func=TRLRollout(...))``.

TRL owns the training loop (sampler, loss, optimizer, logging); the engine generates every
completion (batched, with its reward pool scoring them in killable workers) and receives the
trainer's weights at every step (``engine.integrations.trl``).

Run::

    .venv/bin/python examples/trl_grpo.py                           # tiny random model, toy reward, 3 steps
    .venv/bin/python examples/trl_grpo.py --model builtin:smollm2 --reward rewards.gsm8k:gsm8k_reward \\
        --steps 20 --max-new-tokens 96
    # a vLLM / SGLang server of the same model generates; the weights of every step reach it as a
    # save_pretrained folder it reads (--weights-dir, default a temporary folder: a server on this machine):
    .venv/bin/python examples/trl_grpo.py --model /models/qwen --backend vllm --server http://127.0.0.1:8000 \\
        --weights-dir /shared/weights

Prints one line per step (reward, seconds, token versions) and, with ``--json PATH``, writes
the per-step records as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOY_REWARD = f"{ROOT / 'examples' / 'toy_rewards.py'}:digit_fraction"


def trl_dataset(spec: str):
    """``engine.datasets`` items (``messages``, ``question``, ``answer``) as a TRL dataset:
    a conversational ``prompt`` column plus the other columns (they reach the reward)."""
    from datasets import Dataset

    from engine.datasets import load_dataset

    rows = [{"prompt": item["messages"], "question": item["question"], "answer": item["answer"]}
            for item in load_dataset(spec)]
    return Dataset.from_list(rows)


def make_backend(args: argparse.Namespace, path: str, tokenizer):
    if args.backend == "hf":
        from engine import HFBackend

        return HFBackend(path, tokenizer)
    from engine.backends.remote import make_remote_backend

    if not args.server:
        raise SystemExit(f"--backend {args.backend} needs --server URL (a running server of the same model)")
    return make_remote_backend(args.backend, [args.server])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="builtin:tiny", help="builtin:tiny (default), builtin:smollm2, or an HF folder")
    parser.add_argument("--backend", choices=("hf", "vllm", "sglang"), default="hf")
    parser.add_argument("--server", default=None, help="the server URL of --backend vllm/sglang")
    parser.add_argument("--weights-dir", default=None,
                        help="vllm/sglang: a folder the server reads new weights from at the same path "
                             "(default: a temporary folder, for a server on this machine)")
    parser.add_argument("--dataset", default="builtin:arith:64")
    parser.add_argument("--reward", default=None,
                        help="reward import string (default: a toy digit reward for builtin:tiny, else rewards.gsm8k:gsm8k_reward)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--prompts-per-step", type=int, default=2)
    parser.add_argument("--num-generations", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--max-staleness", type=int, default=0,
                        help="generation calls the engine runs ahead of TRL (>= 1 turns on off_policy_mask_threshold)")
    parser.add_argument("--output-dir", default=None, help="TRL's output_dir (default: a temporary folder)")
    parser.add_argument("--json", type=Path, default=None, help="write the per-step records here")
    args = parser.parse_args(argv)
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # rollout_func is "experimental" in TRL 1.16
    # transformers 5 deprecations that TRL 1.16's own calls trigger (nothing for a user to change)
    warnings.filterwarnings("ignore", message=r".*gradient_checkpointing.* is deprecated", category=FutureWarning)

    import torch
    from transformers import AutoTokenizer, TrainerCallback
    from transformers.trainer_callback import PrinterCallback
    from trl import GRPOConfig, GRPOTrainer

    from engine import EngineConfig, GenerationHyperparameters, RolloutEngineThread, RolloutError
    from engine.integrations.trl import TRLRollout, TRLRolloutConfig, engine_reward
    from engine.models import resolve_model
    from workflows.rlvr import RLVRWorkflow

    torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
    path = resolve_model(args.model)
    reward = args.reward or (TOY_REWARD if args.model == "builtin:tiny" else "rewards.gsm8k:gsm8k_reward")
    tokenizer = AutoTokenizer.from_pretrained(path)
    gconfig = GenerationHyperparameters(max_new_tokens=args.max_new_tokens, temperature=args.temperature)
    workflow = RLVRWorkflow(reward, gconfig, tokenizer)
    records: list[dict] = []

    class OneLine(TrainerCallback):
        def __init__(self) -> None:
            self.t0 = time.perf_counter()

        def on_log(self, _args, state, _control, logs=None, **kwargs):
            if not logs or "reward" not in logs:
                return
            stats = rollout.statistics()
            row = {"step": state.global_step, "reward_mean": logs["reward"], "reward_std": logs.get("reward_std"),
                   "loss": logs.get("loss"), "wall_s": round(time.perf_counter() - self.t0, 2),
                   "completion_mean_length": logs.get("completions/mean_length"), "version": stats.version,
                   "samples_rerun": stats.samples_rerun}
            records.append(row)
            print(f"step {row['step']}: reward {row['reward_mean']:.3f} (std {row['reward_std']:.3f}), "
                  f"loss {row['loss']:+.4f}, {row['wall_s']:.1f} s, generated by policy version {row['version']}",
                  flush=True)

    config = EngineConfig(max_concurrent_rollouts=args.prompts_per_step * args.num_generations * (args.max_staleness + 1))
    with tempfile.TemporaryDirectory() as tmp, RolloutEngineThread(make_backend(args, path, tokenizer), config) as engine:
        weights_dir = args.weights_dir
        if weights_dir is None and args.backend != "hf":
            weights_dir = str(Path(tmp) / "weights")
            print(f"weights of each step go to {weights_dir}/step-N (a server on another machine needs "
                  "--weights-dir on storage it shares)", flush=True)
        rollout = TRLRollout(engine, workflow, TRLRolloutConfig(max_staleness=args.max_staleness,
                                                                weights_dir=weights_dir))
        grpo = GRPOConfig(
            output_dir=args.output_dir or str(Path(tmp) / "trl"), max_steps=args.steps, learning_rate=args.lr,
            per_device_train_batch_size=args.prompts_per_step * args.num_generations,
            num_generations=args.num_generations, max_completion_length=args.max_new_tokens,
            temperature=args.temperature, bf16=False, use_cpu=not torch.cuda.is_available(), report_to="none",
            save_strategy="no", logging_steps=1, disable_tqdm=True,
            off_policy_mask_threshold=0.5 if args.max_staleness else None)
        trainer = GRPOTrainer(model=path, reward_funcs=engine_reward, args=grpo, train_dataset=trl_dataset(args.dataset),
                              processing_class=tokenizer, rollout_func=rollout, callbacks=[OneLine()])
        trainer.remove_callback(PrinterCallback)
        try:
            trainer.train()
        except RolloutError as exc:  # a bad set-up or a batch that could not be completed: one line
            print(f"error: {exc}", file=sys.stderr)
            return 2
        rollout.discard_prefetched()
        stats = engine.statistics()
        print(f"done: {rollout.statistics()}; engine groups accepted {stats.accepted}, failed {stats.failed}, "
              f"rejected {stats.rejected}, {stats.generated_tokens} tokens generated", flush=True)
    if args.json:
        args.json.write_text(json.dumps(records, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The learning proof with our own loop: ``examples/grpo_minimal.py``'s GRPO on the task of
``benchmarks/learn.py``, synchronous or with the engine running ahead.

The same task, reward, held-out eval, hyperparameters, outputs and options as
``benchmarks/learn.py`` (read its docstring); what differs is the trainer:

* **The loop** is ``examples/grpo_minimal.py``'s, through the blocking facade
  (``RolloutEngineThread``): ``engine.prepare_batch(train rows, workflow, group_size=G)``
  returns ``--prompts-per-step`` accepted groups, the policy trains on them in this thread
  (the engine's thread keeps generating), ``engine.update_weights(state_dict, version=step +
  1)`` publishes the new weights (partial rollout: in-flight generations are aborted and
  resumed under them).  ``--max-staleness N`` is ``EngineConfig(max_head_offpolicyness=N)``:
  0 is synchronous (nothing of the next batch is admitted before the version bump), 1 lets
  the next batch generate while this one trains.
* **The loss** is ``grpo_minimal.grpo_loss``: rewards z-scored within each group by the
  engine (``EngineConfig(reward_normalization=True)``), PPO's clipped ratio (0.2) against the
  behaviour logprobs the backend recorded (so samples of the previous version are corrected
  by the importance ratio and its clip), token mean over ``loss_mask``, no KL term; gradient
  norm clipped at 1.0 (as the example), bf16 autocast unless ``--no-bf16``.  The optimizer is
  set up as TRL's ``Trainer`` does by default: AdamW at ``--lr`` without weight decay, the
  rate decayed linearly to 0 over ``--steps`` (a first run with the example's constant rate
  and torch's weight decay 0.01 went 0.375 -> 0.555 at step 5, then down to 0.16 by step 35).  TRL's loss is the same family (``loss_type="dapo"``: token mean over the
  batch, clipped ratio 0.2, group-scaled advantages); the example computes logits at every
  position (TRL only at completion positions), so a step costs somewhat more here.
* **The held-out eval** runs on a second engine (``RolloutEngineThread`` on its own
  ``HFBackend``), loaded with the policy's weights before each eval: episodes submitted to
  the training engine would count towards its staleness capacity.

Run::

    .venv/bin/python benchmarks/learn_ours.py                      # synchronous (max_head_offpolicyness 0)
    .venv/bin/python benchmarks/learn_ours.py --max-staleness 1 --json benchmarks/results/learn_ours_async.json \\
        --png benchmarks/results/learn_ours_async.png --out benchmarks/results/learn_ours_async_policy
"""

from __future__ import annotations

import importlib.util
import os
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: import the project's packages from the checkout
    sys.path.insert(0, str(ROOT))

from benchmarks.learn import REWARD, build_parser, evaluate, plot_comparison, problems, write_outputs  # noqa: E402


def _grpo_loss() -> Any:
    """``grpo_loss`` of ``examples/grpo_minimal.py`` (``examples/`` is not a package)."""
    spec = importlib.util.spec_from_file_location("grpo_minimal", ROOT / "examples" / "grpo_minimal.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.grpo_loss


def main(argv: list[str] | None = None) -> int:
    args = build_parser(__doc__.split("\n\n")[0], results="learn_ours").parse_args(argv)
    if args.compare:  # train nothing: the shared parser's plot of several runs (it trained before)
        plot_comparison(args.compare, args.png)
        return 0
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from engine import EngineConfig, GenerationHyperparameters, HFBackend, RolloutEngineThread
    from engine.models import resolve_model
    from workflows.rlvr import RLVRWorkflow

    grpo_loss = _grpo_loss()
    torch.set_num_threads(args.torch_threads)
    torch.manual_seed(args.seed)
    path = resolve_model(args.model)
    tok = AutoTokenizer.from_pretrained(path)
    policy = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)  # the trainer's copy
    policy.train()
    # as TRL's Trainer sets it up (TrainingArguments' defaults): AdamW without weight decay, the
    # learning rate decayed linearly to 0 over the run, no warm-up
    optimizer = torch.optim.AdamW(policy.parameters(), lr=args.lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda done: 1.0 - done / args.steps)
    sampled = RLVRWorkflow(REWARD, GenerationHyperparameters(max_new_tokens=args.max_new_tokens,
                                                             temperature=args.temperature), tok)
    greedy = RLVRWorkflow(REWARD, GenerationHyperparameters(max_new_tokens=args.max_new_tokens, greedy=True), tok)
    train_rows, eval_rows = problems(args.seed, args.eval_size, args.train_size)
    dataloader = [{"messages": r["prompt"], "answer": r["answer"]} for r in train_rows]  # the same list every step
    rows_per_step = args.prompts_per_step * args.num_generations  # as examples/grpo_minimal.py sizes it
    config = EngineConfig(consumer_batch_size=args.prompts_per_step, max_head_offpolicyness=args.max_staleness,
                          max_concurrent_rollouts=rows_per_step * (args.max_staleness + 1),
                          reward_normalization=True)
    records: list[dict[str, Any]] = []
    evals: list[dict[str, Any]] = []
    started = time.perf_counter()

    def train_step(batch: Any) -> float:
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.bf16):
            loss = grpo_loss(policy, batch, args.temperature)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        return float(loss.detach())

    with (RolloutEngineThread(HFBackend(path, tok, dtype="float32"), config) as engine,
          RolloutEngineThread(HFBackend(path, tok, dtype="float32"),
                              EngineConfig(max_concurrent_rollouts=args.eval_size)) as evaluator):
        paused = 0.0

        def run_eval(step: int, state: dict[str, Any] | None, t0: float) -> None:
            nonlocal paused
            pause = time.perf_counter()
            if state is not None:
                evaluator.update_weights(state, version=step)
            result = {"step": step, "wall_s": round(pause - t0 - paused, 2), "eval_size": len(eval_rows),
                      **evaluate(evaluator, greedy, tok, eval_rows)}
            evals.append(result)
            print(f"eval at step {step} ({result['wall_s']:.0f} s): held-out accuracy "
                  f"{result['eval_accuracy']:.3f}, number alone {result['eval_number_alone']:.3f} "
                  f"({result['eval_s']:.1f} s); e.g. {result['samples'][0][2]!r}", flush=True)
            paused += time.perf_counter() - pause  # wall-clock counts training only

        run_eval(0, None, time.perf_counter())
        t0 = time.perf_counter()
        paused, cpu0, tokens0 = 0.0, time.process_time(), engine.statistics().generated_tokens
        for step in range(1, args.steps + 1):
            s0, p0 = time.perf_counter(), paused
            batch = engine.prepare_batch(dataloader, sampled, group_size=args.num_generations)
            s1 = time.perf_counter()
            loss = train_step(batch)
            state = {k: v.detach().clone() for k, v in policy.state_dict().items()}
            if step % args.eval_every == 0 or step == args.steps:  # before the publish: synchronously,
                cpu_pause = time.process_time()  # nothing of the next batch generates during the eval
                run_eval(step, state, t0)
                cpu0 += time.process_time() - cpu_pause
            engine.update_weights(state, version=step)  # publish; the engine's version is the step
            now, cpu = time.perf_counter(), time.process_time()
            tokens = engine.statistics().generated_tokens
            gen = batch["loss_mask"].bool()
            row = {"step": step, "reward_mean": float(batch["original_rewards"].mean()),
                   "reward_std": float(batch["original_rewards"].std()), "wall_s": round(now - t0 - paused, 2),
                   "step_s": round(now - s0 - (paused - p0), 2), "rollout_wait_s": round(s1 - s0, 2),
                   "generated_tokens": tokens - tokens0, "completion_mean_length": float(gen.sum(1).float().mean()),
                   "train_s": round(now - s1 - (paused - p0), 2), "cpu_s": round(cpu - cpu0, 2),
                   "load_avg_1m": round(os.getloadavg()[0], 2), "loss": loss,
                   "versions": sorted({int(v) for v in batch["versions"][gen].tolist()})}
            cpu0, tokens0 = cpu, tokens
            records.append(row)
            print(f"step {step}: reward {row['reward_mean']:.3f}, {row['step_s']:.1f} s (rollout wait "
                  f"{row['rollout_wait_s']:.1f} s, train {row['train_s']:.1f} s), token versions {row['versions']}, "
                  f"wall {row['wall_s']:.0f} s", flush=True)
        args.out.mkdir(parents=True, exist_ok=True)
        policy.save_pretrained(args.out)
        tok.save_pretrained(args.out)

    write_outputs(args, "grpo_minimal", evals, records, started)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""A minimal GRPO loop on trio-rollout: asynchronous rollout overlapped with training.

The engine generates the next batch while the trainer trains on the current one:
``prepare_batch`` returns ``B`` accepted groups and tops its pipeline back up at once;
the training step runs in a worker thread (``trio.to_thread.run_sync``), so the
engine's trio loop keeps generating; after each step the new weights are published
with ``engine.update_weights`` (partial rollout: in-flight generations are aborted and
resumed under the new weights, and per-token ``versions`` show the boundary).

GRPO here: group-normalised rewards (the engine z-scores rewards within each group:
``EngineConfig(reward_normalization=True)``), a clipped importance ratio against the
behaviour logprobs the backend recorded, token-mean loss over ``loss_mask``.  Logprob
semantics the trainer must match: the backend reports the logprob of each sampled
token under the distribution it sampled from, i.e. after dividing the logits by the
sampling temperature (and after top-k/top-p, which this example leaves off).

Run::

    .venv/bin/python examples/grpo_minimal.py --reward examples/toy_rewards.py:digit_fraction  # tiny model
    .venv/bin/python examples/grpo_minimal.py --model builtin:smollm2 --steps 4 --max-new-tokens 96

Prints one line per step (rollout wait vs train time) and, with ``--json PATH``,
writes them as JSON.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch
import trio

from engine import EngineConfig, GenerationHyperparameters, HFBackend, open_rollout_engine
from engine.datasets import load_dataset
from workflows.rlvr import RLVRWorkflow


def grpo_loss(model: torch.nn.Module, batch, temperature: float, clip_eps: float = 0.2) -> torch.Tensor:
    """Clipped-ratio GRPO loss (DeepSeekMath; no KL term), token mean over ``loss_mask``.

    ``batch``: ``input_ids [B,T] int32``, ``attention_mask [B,T] bool``, ``loss_mask
    [B,T] int32`` (1 on sampled tokens), ``logprobs [B,T] float32`` (behaviour
    logprobs after temperature), ``rewards [B] float32`` (already group-normalised:
    the advantage).
    """
    ids = batch["input_ids"].long()  # [B, T]
    attn = batch["attention_mask"].long()  # [B, T]
    logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1].float()  # [B, T-1, V]
    logp = torch.log_softmax(logits / temperature, dim=-1)  # the sampled distribution's semantics
    new_logp = logp.gather(-1, ids[:, 1:, None]).squeeze(-1)  # [B, T-1]: logprob of token t+1
    mask = batch["loss_mask"][:, 1:].float()  # [B, T-1]
    old_logp = batch["logprobs"][:, 1:]  # [B, T-1]
    adv = batch["rewards"][:, None]  # [B, 1]
    ratio = torch.exp(new_logp - old_logp)
    surrogate = torch.minimum(ratio * adv, ratio.clamp(1 - clip_eps, 1 + clip_eps) * adv)
    return -(surrogate * mask).sum() / mask.sum().clamp(min=1)


def _model_path(spec: str, tmp: Path) -> str:
    from engine.models import resolve_model  # builtin:tiny, builtin:smollm2, a folder or a hub id

    return resolve_model(spec)


async def run(args: argparse.Namespace) -> list[dict]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from engine.imports import resolve_reward_fn

    with tempfile.TemporaryDirectory() as tmp:
        path = await trio.to_thread.run_sync(_model_path, args.model, Path(tmp))
        tokenizer = AutoTokenizer.from_pretrained(path)
        policy = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)  # the trainer's copy
        policy.train()
        optimizer = torch.optim.AdamW(policy.parameters(), lr=args.lr)
        gconfig = GenerationHyperparameters(n_samples=1, max_new_tokens=args.max_new_tokens,
                                            temperature=args.temperature)
        workflow = RLVRWorkflow(resolve_reward_fn(args.reward), gconfig, tokenizer)
        dataloader = load_dataset(args.dataset)  # the same list object every step (the data position)
        config = EngineConfig(consumer_batch_size=args.batch_size, max_head_offpolicyness=args.eta,
                              max_concurrent_rollouts=args.batch_size * args.group_size * (args.eta + 1),
                              reward_normalization=True)

        def train_step(batch) -> float:  # runs in a worker thread: generation goes on meanwhile
            optimizer.zero_grad()
            loss = grpo_loss(policy, batch, args.temperature)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
            optimizer.step()
            return float(loss.detach())

        steps = []
        async with open_rollout_engine(HFBackend(path, tokenizer), config) as engine:
            for step in range(args.steps):
                t0 = time.perf_counter()
                batch = await engine.prepare_batch(dataloader, workflow, group_size=args.group_size)
                t1 = time.perf_counter()
                loss = await trio.to_thread.run_sync(train_step, batch)
                t2 = time.perf_counter()
                state = {k: v.detach().clone() for k, v in policy.state_dict().items()}
                await engine.update_weights(state, version=step + 1)  # publish; the engine bumps the version
                t3 = time.perf_counter()
                gen = batch["loss_mask"].bool()
                row = {"step": step, "rollout_wait_s": t1 - t0, "train_s": t2 - t1, "publish_s": t3 - t2,
                       "rows": int(batch.batch_size[0]), "loss": loss,
                       "reward_mean": float(batch["original_rewards"].mean()),
                       "versions": sorted({int(v) for v in batch["versions"][gen].tolist()})}
                steps.append(row)
                print(f"step {step}: rollout wait {row['rollout_wait_s']:.2f} s, train {row['train_s']:.2f} s, "
                      f"publish {row['publish_s']:.2f} s, {row['rows']} rows, loss {loss:+.4f}, "
                      f"reward {row['reward_mean']:.3f}, token versions {row['versions']}", flush=True)
    return steps


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="builtin:tiny", help="builtin:tiny (default), builtin:smollm2, or a folder")
    parser.add_argument("--dataset", default="builtin:arith:64")
    parser.add_argument("--reward", default="rewards.gsm8k:gsm8k_reward",
                        help="reward import string (e.g. examples/toy_rewards.py:digit_fraction for the tiny model)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=2, help="groups per training batch (B)")
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--eta", type=int, default=1, help="max_head_offpolicyness")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--json", type=Path, default=None, help="write the per-step table here")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    steps = trio.run(run, args)
    if args.json:
        args.json.write_text(json.dumps(steps, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""RLVR episodes through the engine on the ``hf`` backend, checked against the trajectory contract.

Written for the first run on a GPU (``benchmarks/gpu_check.sh``), and runs the same on CPU::

    python -m benchmarks.gpu_check_episodes --model builtin:smollm2 --device cuda --out episodes.json
    python -m benchmarks.gpu_check_episodes --model builtin:tiny --device cpu --episodes 4   # smoke test

Two runs, each ``episodes`` GSM8K prompts x ``n_samples`` through :func:`engine.open_rollout_engine`
+ :class:`workflows.rlvr.RLVRWorkflow` (the GSM8K reward in the reward pool):

* ``continuous``: the backend's default dtype on ``device`` (bfloat16 on CUDA, float32 on CPU),
  continuous batching, ``max_new_tokens`` 128; half the episodes are submitted, and once half of
  those have ended the weights are updated (the same weights, from the model folder,
  ``mode="abort"``: the stragglers are resumed) and the other half is submitted: per-token
  versions must be 0 then 1 along each row, some tokens must carry version 1, and since the weights
  are unchanged every logprob must still match a teacher-forced forward pass;
* ``static_fp32``: float32 on ``device``, static batches, seeded: run twice, the tokens must be
  identical row for row (per-request seeds), and the logprobs must match teacher forcing within
  ``--fp32-tol``.

Checked on every accepted row (:data:`engine.data.TRAJECTORY_SCHEMA`): every per-token field has the
row's shape ``[n_samples, T]``; ``attention_mask`` True on the real tokens; ``loss_mask`` 0 on
the prompt then 1 on the whole output; ``logprobs`` 0.0 on the prompt, finite and <= 0 on the
output; ``versions`` and ``turn_ids`` -1 on the prompt; ``versions`` on the output non-decreasing
and in the versions the run set; ``is_truncated`` iff ``stop_reason`` was ``"length"``: the output used the whole budget and
its last token is not a stop token (a row whose last allowed token is a stop token is not truncated),
no row over the budget, and a row that is not truncated ends with a stop token (``workflow.gconfig.stop_token_ids``: RLVR adds
the tokenizer's pad and eos ids).  Teacher forcing: one forward pass of a separate
copy of the model (same device and dtype) over each row, ``log_softmax`` of the logits at the
output positions (temperature 1, no top-k/top-p: the processed distribution is the raw one);
reported as max/mean absolute difference; bfloat16 is reported only (its rounding differs between
batched and single-row kernels), float32 must stay within ``--fp32-tol``.

JSON (``--out``; schema ``gpu_check_episodes/1``)::

    {"schema": "gpu_check_episodes/1", "device": str, "torch": str, "transformers": str,
     "cuda_device": str or null, "model": str, "passed": bool, "failures": [str, ...],
     "runs": [{"name", "mode", "dtype", "episodes", "n_samples", "max_new_tokens", "wall_s",
               "accepted", "failed", "rows", "generated_tokens", "tokens_per_s", "truncated_rows",
               "versions_seen": [int], "rows_crossing_update", "logprob_max_abs_diff",
               "logprob_mean_abs_diff", "reward_mean", "repeat_identical": bool or null}, ...]}

Exit status 0 when every check passed, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

DEFAULT_DATASET = str(Path(__file__).resolve().parent / "data" / "gsm8k_test_64.jsonl")


class Checker:
    """Collects contract violations (at most ``limit`` messages kept, all counted)."""

    def __init__(self, limit: int = 40) -> None:
        self.failures: list[str] = []
        self.count = 0
        self._limit = limit

    def check(self, ok: bool, message: str) -> bool:
        if not ok:
            self.count += 1
            if len(self.failures) < self._limit:
                self.failures.append(message)
        return ok


def _rows(traj: Any) -> list[dict[str, Any]]:
    """The rows of one episode's trajectory as lists (real tokens only)."""
    rows = []
    for j in range(traj.batch_size[0]):
        real = traj["attention_mask"][j]
        rows.append({key: traj[key][j][real].tolist() for key in ("input_ids", "loss_mask", "logprobs", "versions",
                                                                  "turn_ids")}
                    | {"is_truncated": bool(traj["is_truncated"][j].item()), "reward": float(traj["rewards"][j].item())})
    return rows


def check_rows(traj: Any, *, where: str, stop_ids: set[int], budget: int, versions: set[int], chk: Checker
               ) -> list[dict]:
    """Check one accepted episode's trajectory (module docstring); returns its rows."""
    n = traj.batch_size[0]
    shape = tuple(traj["input_ids"].shape)
    for key in ("loss_mask", "logprobs", "versions", "turn_ids", "attention_mask"):
        chk.check(tuple(traj[key].shape) == shape, f"{where}: {key} shape {tuple(traj[key].shape)} != input_ids {shape}")
    chk.check(tuple(traj["rewards"].shape) == (n,) and tuple(traj["is_truncated"].shape) == (n,),
              f"{where}: rewards/is_truncated shapes {tuple(traj['rewards'].shape)}/{tuple(traj['is_truncated'].shape)}")
    rows = _rows(traj)
    for j, row in enumerate(rows):
        w = f"{where} row {j}"
        mask = row["loss_mask"]
        n_prompt = mask.index(1) if 1 in mask else len(mask)
        n_out = len(mask) - n_prompt
        row["n_prompt"], row["n_out"] = n_prompt, n_out
        if not chk.check(n_prompt > 0 and n_out > 0 and all(m == 1 for m in mask[n_prompt:]),
                         f"{w}: loss_mask is not 0* 1+ (prompt {n_prompt}, output {n_out})"):
            continue
        lp_prompt, lp_out = row["logprobs"][:n_prompt], row["logprobs"][n_prompt:]
        chk.check(all(x == 0.0 for x in lp_prompt), f"{w}: logprobs not 0.0 on the prompt")
        chk.check(all(math.isfinite(x) and x <= 0.0 for x in lp_out),
                  f"{w}: output logprobs not finite and <= 0 (min {min(lp_out)}, max {max(lp_out)})")
        chk.check(all(v == -1 for v in row["versions"][:n_prompt]), f"{w}: versions not -1 on the prompt")
        chk.check(all(t == -1 for t in row["turn_ids"][:n_prompt]), f"{w}: turn_ids not -1 on the prompt")
        chk.check(all(t == 0 for t in row["turn_ids"][n_prompt:]), f"{w}: turn_ids not 0 on the output")
        v_out = row["versions"][n_prompt:]
        chk.check(all(a <= b for a, b in zip(v_out, v_out[1:])) and set(v_out) <= versions,
                  f"{w}: output versions {sorted(set(v_out))} not non-decreasing within {sorted(versions)}")
        # stop_reason "length" (CONTRACTS.md: is_truncated == stop_reason "length"): the budget is used up and the
        # last token is not a stop token; a row whose last allowed token is a stop token stopped ("stop")
        length = n_out >= budget and row["input_ids"][-1] not in stop_ids
        chk.check(n_out <= budget, f"{w}: {n_out} output tokens over the budget of {budget}")
        chk.check(row["is_truncated"] == length,
                  f"{w}: is_truncated {row['is_truncated']} but {n_out} output tokens of a budget of {budget}, "
                  f"last token {row['input_ids'][-1]} {'' if row['input_ids'][-1] in stop_ids else 'not '}a stop token")
        if not row["is_truncated"]:
            chk.check(row["input_ids"][-1] in stop_ids, f"{w}: stopped before the budget on a token that is not a "
                                                         f"stop token ({row['input_ids'][-1]} not in {sorted(stop_ids)})")
    return rows


def teacher_forced_diffs(model: Any, rows: list[dict[str, Any]]) -> list[float]:
    """Absolute differences between each row's output logprobs and a forward pass over the row."""
    import torch

    diffs: list[float] = []
    with torch.inference_mode():
        for row in rows:
            if row.get("n_out", 0) <= 0:
                continue
            ids = torch.tensor([row["input_ids"]], device=model.device)
            logits = model(input_ids=ids).logits[0].float()  # [T, V]
            logp = torch.log_softmax(logits, dim=-1)
            n_prompt = row["n_prompt"]
            positions = torch.arange(n_prompt - 1, len(row["input_ids"]) - 1, device=model.device)
            ref = logp[positions, ids[0, n_prompt:]].cpu()
            diffs += (ref - torch.tensor(row["logprobs"][n_prompt:])).abs().tolist()
    return diffs


async def run_once(args: argparse.Namespace, *, name: str, mode: str, dtype: str, seeded: bool, budget: int,
                   update_weights: bool, items: list[dict[str, Any]], tok: Any, path: str, chk: Checker
                   ) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """One run of ``items`` through a fresh engine; its record and all accepted rows."""
    import trio

    from engine import EngineConfig, GenerationHyperparameters, HFBackend, open_rollout_engine
    from rewards import gsm8k_reward
    from workflows.rlvr import RLVRWorkflow

    backend = HFBackend(path, tok, device=args.device, dtype=dtype, mode=mode, max_batch_size=args.concurrency)
    gconfig = GenerationHyperparameters(n_samples=args.n_samples, max_new_tokens=budget, temperature=1.0,
                                        seed=args.seed if seeded else None)
    workflow = RLVRWorkflow(gsm8k_reward, gconfig, tok)
    config = EngineConfig(max_concurrent_rollouts=args.concurrency)
    versions = {0, 1} if update_weights else {0}
    rows: list[dict[str, Any]] = []
    records: list[Any] = []
    t0 = time.perf_counter()
    async with open_rollout_engine(backend, config, tokenizer=tok) as engine:
        loaded = time.perf_counter()
        half = (len(items) + 1) // 2 if update_weights else len(items)
        for i, item in enumerate(items[:half]):
            engine.submit(item, workflow, task_id=i)
        first = max(1, half // 2) if update_weights else len(items)
        records += await engine.wait_results(first)
        if update_weights:  # the first half's stragglers cross the boundary; the second half is all version 1
            await engine.update_weights(path, version=1, mode="abort")
            chk.check(engine.version == 1, f"{name}: engine.version {engine.version} after update_weights(version=1)")
            for i, item in enumerate(items[half:], start=half):
                engine.submit(item, workflow, task_id=i)
            records += await engine.wait_results(len(items) - first)
        stats = engine.statistics()
    wall = time.perf_counter() - loaded
    stop_ids = set(workflow.gconfig.stop_token_ids)  # RLVR adds the pad and eos ids (AReaL)
    failed = [r for r in records if r.status != "accepted"]
    for r in failed[:5]:
        chk.check(False, f"{name}: task {r.task_id} {r.status}: {r.reason} {r.error_type} {r.error_message}")
    for r in records:
        if r.status == "accepted":
            chk.check(r.trajectory.batch_size[0] == args.n_samples,
                      f"{name}: task {r.task_id} has {r.trajectory.batch_size[0]} rows, n_samples {args.n_samples}")
            for row in check_rows(r.trajectory, where=f"{name}: task {r.task_id}", stop_ids=stop_ids, budget=budget,
                                  versions=versions, chk=chk):
                row["task_id"] = r.task_id
                rows.append(row)
    out_versions = sorted({v for row in rows for v in row["versions"][row.get("n_prompt", 0):]})
    crossing = sum(1 for row in rows if len(set(row["versions"][row.get("n_prompt", 0):])) > 1)
    if update_weights:
        chk.check(1 in out_versions, f"{name}: no output token carries version 1 after the update")
    tokens = sum(row.get("n_out", 0) for row in rows)
    record = {
        "name": name, "mode": mode, "dtype": dtype, "episodes": len(items), "n_samples": args.n_samples,
        "max_new_tokens": budget, "load_s": round(loaded - t0, 2), "wall_s": round(wall, 3),
        "accepted": len(records) - len(failed), "failed": len(failed), "rows": len(rows), "generated_tokens": tokens,
        "tokens_per_s": round(tokens / wall, 1), "truncated_rows": sum(row["is_truncated"] for row in rows),
        "versions_seen": out_versions, "rows_crossing_update": crossing,
        "segments_resumed": getattr(stats, "segments_resumed", None),
        "batches": getattr(stats.backend, "batches", None),  # static: generate calls, and rows per call
        "batch_occupancy": round(getattr(stats.backend, "batch_occupancy", 0.0), 2),
        "reward_mean": round(sum(row["reward"] for row in rows) / max(1, len(rows)), 4),
    }
    await trio.lowlevel.checkpoint()
    return record, rows


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    import transformers
    import trio
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from engine.datasets import load_dataset
    from engine.models import resolve_model

    path = resolve_model(args.model)
    tok = AutoTokenizer.from_pretrained(path)
    items = await trio.to_thread.run_sync(lambda: load_dataset(args.dataset, args.episodes, required=("answer",)))
    chk = Checker()
    runs: list[dict[str, Any]] = []

    def log(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    plan = [("continuous", "continuous", "auto", False, args.max_new_tokens, True),
            ("static_fp32", "static", "float32", True, args.fp32_max_new_tokens, False)]
    for name, mode, dtype, seeded, budget, update in plan:
        log(f"[episodes] {name}: {len(items)} episodes x {args.n_samples}, {mode}, dtype {dtype}, budget {budget}")
        record, rows = await run_once(args, name=name, mode=mode, dtype=dtype, seeded=seeded, budget=budget,
                                      update_weights=update, items=items, tok=tok, path=path, chk=chk)
        if seeded:
            again, rows2 = await run_once(args, name=name + "_repeat", mode=mode, dtype=dtype, seeded=True,
                                          budget=budget, update_weights=False, items=items, tok=tok, path=path,
                                          chk=chk)
            key = sorted(((r["task_id"], r["input_ids"]) for r in rows))
            record["repeat_identical"] = chk.check(
                key == sorted(((r["task_id"], r["input_ids"]) for r in rows2)),
                f"{name}: a seeded rerun generated different tokens")
            record["repeat_wall_s"] = again["wall_s"]
        else:
            record["repeat_identical"] = None
        ref_dtype = torch.float32 if dtype == "float32" else (
            torch.bfloat16 if args.device.startswith("cuda") else torch.float32)  # the backend's "auto"

        def reference_diffs() -> list[float]:
            model: Any = AutoModelForCausalLM.from_pretrained(path, dtype=ref_dtype)
            return teacher_forced_diffs(model.to(args.device).eval(), rows)

        diffs = await trio.to_thread.run_sync(reference_diffs)
        record["logprob_max_abs_diff"] = round(max(diffs), 6) if diffs else None
        record["logprob_mean_abs_diff"] = round(sum(diffs) / len(diffs), 7) if diffs else None
        if ref_dtype == torch.float32 and diffs:
            chk.check(max(diffs) < args.fp32_tol,
                      f"{name}: float32 logprobs differ from teacher forcing by {max(diffs):.3g} >= {args.fp32_tol}")
        runs.append(record)
        log(f"[episodes] {name}: {json.dumps(record)}")
    cuda_name = torch.cuda.get_device_name(0) if args.device.startswith("cuda") else None
    return {"schema": "gpu_check_episodes/1", "device": args.device, "torch": torch.__version__,
            "transformers": transformers.__version__, "cuda_device": cuda_name, "model": args.model,
            "passed": chk.count == 0, "failure_count": chk.count, "failures": chk.failures, "runs": runs}


def main(argv: list[str] | None = None) -> int:
    import trio

    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0] if __doc__ else None)
    p.add_argument("--model", default="builtin:smollm2", help="model spec (engine.models.resolve_model)")
    p.add_argument("--device", default="cuda", help="torch device of the backend and the reference (default cuda)")
    p.add_argument("--dataset", default=DEFAULT_DATASET, help="GSM8K-style jsonl (question, answer)")
    p.add_argument("--episodes", type=int, default=16)
    p.add_argument("--n-samples", type=int, default=2)
    p.add_argument("--concurrency", type=int, default=16, help="episodes in flight and the backend's batch cap")
    p.add_argument("--max-new-tokens", type=int, default=128, help="budget of the continuous run")
    p.add_argument("--fp32-max-new-tokens", type=int, default=64, help="budget of the float32 static run")
    p.add_argument("--fp32-tol", type=float, default=1e-3, help="float32: max |logprob - teacher forcing|")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="write the JSON here")
    args = p.parse_args(argv)
    doc = trio.run(main_async, args)
    text = json.dumps(doc, indent=1)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n", encoding="utf-8")
    print(json.dumps({k: doc[k] for k in ("passed", "failure_count", "failures")}))
    return 0 if doc["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())

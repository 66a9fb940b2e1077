"""Generated tokens/s of the ``hf`` backend: the engine driving N concurrent
requests vs one static ``model.generate`` over the same N prompts vs one request
at a time.  Same model, same prompts, same lengths (``ignore_eos``, fixed
``max_new_tokens``), sampling at temperature 1, measured side by side in one run.

    .venv/bin/python benchmarks/bench_hf_backend.py                    # SmolLM2-135M (builtin)
    .venv/bin/python benchmarks/bench_hf_backend.py --model tiny       # a tiny random Llama

Prints one table and writes ``benchmarks/results/bench_hf_backend.json``:
``{"config": {...}, "rows": [{"mode", "requests", "tokens", "wall_s", "tokens_per_s",
"vs_static"}, ...], "concurrent_vs_serial": float}`` (engine static mode, concurrent
vs one at a time).  The engine is run in both serving modes (``static``,
``continuous``).  One-at-a-time runs a subset of the prompts (``--serial-requests``)
to keep the run short; tokens/s is comparable because lengths are fixed.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import torch
import trio

from engine import EngineConfig, HFBackend, ModelRequest, open_rollout_engine
from engine.models import resolve_model
from engine.testing import build_tiny_model
from engine.types import GenerationHyperparameters

RESULTS = Path(__file__).resolve().parent / "results"


class _NoRewards:
    """A reward pool that no episode calls (this benchmark only generates)."""

    async def score(self, *args, **data):
        raise RuntimeError("this benchmark scores nothing")

    def statistics(self):
        return None


def _prompts(tok, n):
    return [
        tok.apply_chat_template([{"role": "user", "content": f"Question {i}: what is {i} plus {i * 3}?" + " Think." * (i % 5)}],
                                tokenize=True, add_generation_prompt=True, return_dict=False)
        for i in range(n)
    ]


def static_generate(model, tok, prompts, new_tokens):
    from transformers import GenerationConfig

    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), tok.pad_token_id or 0, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    cfg = GenerationConfig(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=True, temperature=1.0,
                           top_k=0, top_p=1.0, pad_token_id=tok.pad_token_id or 0)
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, generation_config=cfg)
    return (out.shape[1] - width) * len(prompts), time.perf_counter() - t0


async def engine_generate(model, tok, prompts, new_tokens, concurrent: bool, mode: str = "static"):
    backend = HFBackend(model, tok, max_batch_size=len(prompts), batch_window_s=0.01, mode=mode)
    g = GenerationHyperparameters(max_new_tokens=new_tokens, ignore_eos=True)
    tokens = 0
    async with open_rollout_engine(backend, EngineConfig(gc_tuning=True), reward_pool=_NoRewards()) as engine:
        async def one(p):
            nonlocal tokens
            resp = await engine.agenerate(ModelRequest(input_ids=p, gconfig=g))
            tokens += resp.output_len  # after the await: `tokens += await ...` would lose updates

        t0 = time.perf_counter()
        if concurrent:
            async with trio.open_nursery() as nursery:
                for p in prompts:
                    nursery.start_soon(one, p)
        else:
            for p in prompts:
                await one(p)
        wall = time.perf_counter() - t0
    return tokens, wall, backend.statistics()


def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="builtin:smollm2", help="builtin:smollm2, tiny, or an HF folder")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--serial-requests", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1 on the 2-core CI box)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = build_tiny_model(Path(tempfile.mkdtemp()) / "tiny") if args.model == "tiny" else resolve_model(args.model)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(path)
    prompts = _prompts(tok, args.requests)
    static_generate(model, tok, prompts[:2], 2)  # warm-up

    rows = []
    tokens, wall = static_generate(model, tok, prompts, args.new_tokens)
    rows.append({"mode": f"static model.generate (batch {len(prompts)})", "requests": len(prompts),
                 "tokens": tokens, "wall_s": wall})
    tokens, wall, stats = trio.run(engine_generate, model, tok, prompts, args.new_tokens, True)
    rows.append({"mode": f"engine static, {len(prompts)} concurrent", "requests": len(prompts), "tokens": tokens,
                 "wall_s": wall, "batch_occupancy": stats.batch_occupancy})
    tokens, wall, stats = trio.run(engine_generate, model, tok, prompts, args.new_tokens, True, "continuous")
    rows.append({"mode": f"engine continuous, {len(prompts)} concurrent", "requests": len(prompts), "tokens": tokens,
                 "wall_s": wall})
    serial = prompts[: args.serial_requests]
    tokens, wall, _ = trio.run(engine_generate, model, tok, serial, args.new_tokens, False)
    rows.append({"mode": "engine, one request at a time", "requests": len(serial), "tokens": tokens, "wall_s": wall})
    static_rate = rows[0]["tokens"] / rows[0]["wall_s"]
    for row in rows:
        row["tokens_per_s"] = row["tokens"] / row["wall_s"]
        row["vs_static"] = row["tokens_per_s"] / static_rate

    print(f"model {args.model}  new tokens {args.new_tokens}  torch threads {args.threads}  cpus {os.cpu_count()}")
    print(f"{'mode':42} {'requests':>8} {'tokens':>7} {'wall s':>8} {'tok/s':>8} {'vs static':>9}")
    for r in rows:
        print(f"{r['mode']:42} {r['requests']:>8} {r['tokens']:>7} {r['wall_s']:>8.2f} {r['tokens_per_s']:>8.1f} "
              f"{r['vs_static']:>9.2f}")
    ratio = rows[1]["tokens_per_s"] / rows[-1]["tokens_per_s"]
    print(f"engine concurrent / one-at-a-time: {ratio:.1f}x")
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / "bench_hf_backend.json"
    out.write_text(json.dumps({"config": vars(args), "rows": rows, "concurrent_vs_serial": ratio}, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

"""Per-decoding-step time of the ``hf`` backend vs raw ``model.generate``, on any device.

A random-weight model with SmolLM2-135M's architecture (``benchmarks/data/smollm2_135m_config.json``;
``--layers`` / ``--hidden`` shrink it for a CPU run), ``--batch`` rows of ``--prompt-len`` tokens,
``--new`` new tokens each (``ignore_eos``: every row runs the whole budget).  Measured, each as
seconds per decoding step (wall / steps, median of ``--repeats``):

    raw_generate         model.generate, greedy, our GenerationConfig, no processors
    raw_generate_sample  model.generate, do_sample (transformers' own multinomial sampling)
    static_direct        StaticBatcher._generate_rows (our processors + stopping criterion), this thread
    static_thread        the same in a worker thread while a trio loop waits (as in the engine)
    static_engine        HFBackend(mode="static") driven by --batch concurrent requests (trio)
    continuous_engine    HFBackend(mode="continuous") driven the same way (streaming outputs)
    continuous_direct    transformers' manager with our config, no trio, no pump (``_streaming``: every
                         token delivered, read here)

A ``torch.profiler`` table (top 20 by self CPU time and, on CUDA, by self CUDA time) of one
``static_direct`` call.  Then (``--compiled``) the named cases again with a static KV cache, so that
``generate`` compiles the forward (``torch.compile`` mode ``reduce-overhead``: CUDA graphs): the
A/B of "the decode step is bound by the host launching ~2,700 kernels per step".  Every case is
guarded (``--budget-s``; a failure is recorded, the rest still runs); the JSON (``--out``) is
rewritten after each case, so a run cut short still reports what it measured.

    python -m benchmarks.gpu_profile --device cpu --layers 4 --batch 8 --new 16   # here
    python -m benchmarks.gpu_profile --device cuda --out $OUT/profile.json       # the H200
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

CONFIG = Path(__file__).resolve().parent / "data" / "smollm2_135m_config.json"


def build_model(args: argparse.Namespace) -> Any:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = json.loads(CONFIG.read_text(encoding="utf-8"))
    for key in ("_model_name_or_path", "architectures", "transformers_version", "dtype"):
        cfg.pop(key, None)
    if args.layers:
        cfg["num_hidden_layers"] = args.layers
    if args.hidden:
        cfg["hidden_size"], cfg["intermediate_size"] = args.hidden, args.hidden * 8 // 3
        cfg["head_dim"] = args.hidden // cfg["num_attention_heads"]
    if args.vocab:
        cfg["vocab_size"] = args.vocab
    torch.manual_seed(0)
    model: Any = LlamaForCausalLM(LlamaConfig(**cfg))
    model.to(device=args.device, dtype=getattr(torch, args.dtype))
    model.eval()
    model.generation_config.eos_token_id = None
    return model


class _Tok:
    """The little of a tokenizer the batchers use."""

    eos_token_id = 2
    pad_token_id = 2

    def decode(self, ids: list[int], **kwargs: Any) -> str:
        return " ".join(map(str, ids))


def prompts(args: argparse.Namespace, vocab: int) -> list[list[int]]:
    import random

    rng = random.Random(0)
    return [[rng.randrange(3, vocab) for _ in range(args.prompt_len - (i % 8) * 4)] for i in range(args.batch)]


def sync(args: argparse.Namespace) -> None:
    import torch

    if args.device.startswith("cuda"):
        torch.cuda.synchronize()


def left_pad(ps: list[list[int]], device: str) -> tuple[Any, Any]:
    import torch

    width = max(map(len, ps))
    ids = torch.full((len(ps), width), 2, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(ps):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    return ids.to(device), mask.to(device)


def raw_generate(model: Any, args: argparse.Namespace, ps: list[list[int]], sample: bool) -> float:
    import torch

    from engine.backends.hf._static import generation_config

    ids, mask = left_pad(ps, args.device)
    cfg = generation_config(max_new_tokens=args.new, min_new_tokens=0, eos_token_id=None, pad_token_id=2)
    if sample:
        cfg.do_sample, cfg.top_k = True, 0
    sync(args)
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, generation_config=cfg)
    sync(args)
    assert out.shape[1] - ids.shape[1] == args.new, out.shape
    return time.perf_counter() - t0


def _jobs(args: argparse.Namespace, ps: list[list[int]]) -> list[Any]:
    from engine.backends.hf._jobs import GenerationJob
    from engine.types import GenerationHyperparameters, ModelRequest

    g = GenerationHyperparameters(max_new_tokens=args.new, temperature=1.0, ignore_eos=True, seed=1)
    return [GenerationJob(ModelRequest(input_ids=p, gconfig=g), args.new) for p in ps]


def _loaded(model: Any, args: argparse.Namespace) -> Any:
    from engine.backends.hf._model import LoadedModel

    lm = LoadedModel(model, _Tok(), device=args.device, dtype=args.dtype)
    lm.load()
    return lm


def static_direct(model: Any, args: argparse.Namespace, ps: list[list[int]]) -> float:
    from engine.backends.hf._static import StaticBatcher

    batcher = StaticBatcher(_loaded(model, args), lambda: 0, max_batch_size=args.batch, batch_window_s=0.0)
    jobs = _jobs(args, ps)
    sync(args)
    t0 = time.perf_counter()
    rows, _ = batcher._generate_rows(jobs, [], {})
    sync(args)
    assert all(len(r[0]) == args.new for r in rows), [len(r[0]) for r in rows]
    return time.perf_counter() - t0


def static_thread(model: Any, args: argparse.Namespace, ps: list[list[int]]) -> float:
    import trio

    async def main() -> float:
        t0 = time.perf_counter()
        await trio.to_thread.run_sync(static_direct, model, args, ps)
        return time.perf_counter() - t0

    return trio.run(main)


def engine_run(model: Any, args: argparse.Namespace, ps: list[list[int]], mode: str) -> float:
    import trio

    from engine import HFBackend
    from engine.types import GenerationHyperparameters, ModelRequest

    backend = HFBackend(model, _Tok(), device=args.device, dtype=args.dtype, mode=mode, max_batch_size=args.batch,
                        batch_window_s=0.05, cache_tokens=args.batch * (args.prompt_len + args.new + 64))
    g = GenerationHyperparameters(max_new_tokens=args.new, temperature=1.0, ignore_eos=True)
    lengths: list[int] = []

    async def one(p: list[int]) -> None:
        resp = await backend.generate(ModelRequest(input_ids=p, gconfig=g), args.new)
        lengths.append(len(resp.output_tokens))

    async def main() -> float:
        async with backend.open():
            t0 = time.perf_counter()
            async with trio.open_nursery() as nursery:
                for p in ps:
                    nursery.start_soon(one, p)
            return time.perf_counter() - t0

    wall = trio.run(main)
    assert lengths == [args.new] * len(ps), lengths
    return wall


def continuous_direct(model: Any, args: argparse.Namespace, ps: list[list[int]], streaming: bool) -> float:
    """transformers' continuous batching with our manager config, driven from this thread (no trio,
    no pump): the manager's own cost, to compare with continuous_engine (our bridge)."""
    import threading as _threading

    from engine.backends.hf._continuous import ContinuousBatcher

    batcher = ContinuousBatcher(_loaded(model, args), lambda: 0, max_batch_size=args.batch,
                                cache_tokens=args.batch * (args.prompt_len + args.new + 64))
    batcher._start_manager()
    manager = batcher.manager
    try:
        sync(args)
        t0 = time.perf_counter()
        for i, p in enumerate(ps):
            manager.add_request(list(p), request_id=f"r{i}", max_new_tokens=args.new, streaming=streaming,
                                eos_token_id=-1, temperature=1.0, top_k=model.config.vocab_size, top_p=1.0)
        done: set[str] = set()
        stop = _threading.Event()
        while len(done) < len(ps) and not stop.is_set():
            out = manager.get_result(timeout=1.0)
            if out is not None and out.is_finished():
                assert len(out.generated_tokens) == args.new, len(out.generated_tokens)
                done.add(out.request_id)
        sync(args)
        return time.perf_counter() - t0
    finally:
        batcher._stop_manager()


def measure(name: str, fn: Any, args: argparse.Namespace, label: str = "") -> dict[str, Any]:
    t0 = time.perf_counter()
    fn()  # warm-up (CUDA context, kernels, allocator; the compiled variant compiles here)
    warmup = time.perf_counter() - t0
    walls = [fn() for _ in range(args.repeats)]
    wall = statistics.median(walls)
    rec = {"name": name, "wall_s": round(wall, 4), "ms_per_step": round(1000 * wall / args.new, 3),
           "walls": [round(w, 4) for w in walls], "warmup_s": round(warmup, 3)}
    print(f"  {label or name:<34} {rec['ms_per_step']:9.2f} ms/step  ({wall:.3f} s for {args.new} steps x {args.batch} rows; "
          f"first call {warmup:.2f} s)", flush=True)
    return rec


@contextlib.contextmanager
def compiled_generation(enabled: bool) -> Any:
    """While enabled: the static batcher's (and raw_generate's) ``GenerationConfig`` asks for a
    static KV cache, which makes ``generate`` compile the forward (transformers' auto-compile on
    CUDA: ``torch.compile`` mode ``reduce-overhead``, i.e. CUDA graphs)."""
    from engine.backends.hf import _static

    if not enabled:
        yield
        return
    from transformers import CompileConfig

    original = _static.generation_config

    def patched(**kwargs: Any) -> Any:
        cfg = original(**kwargs)
        cfg.cache_implementation = "static"
        cfg.compile_config = CompileConfig(fullgraph=False, dynamic=False, mode="reduce-overhead")
        return cfg

    _static.generation_config = patched
    try:
        yield
    finally:
        _static.generation_config = original


def _pump_one_by_one(self: Any) -> None:
    """``ContinuousBatcher._pump`` before the fix: one trio round trip per streamed output."""
    import trio

    manager = self.manager
    while manager is not None and manager.is_running():
        with self._pump_lock:
            out = manager.get_result(timeout=0.05)
            if out is None:
                continue
            try:
                trio.from_thread.run_sync(self._route, out, trio_token=self._token)
            except trio.RunFinishedError:
                return


@contextlib.contextmanager
def variant_context(variant: str) -> Any:
    """``eager``: the code as it is; ``compiled``: :func:`compiled_generation`; ``onebyone``: the
    continuous batcher's pump as before the fix (the A/B of the batched pump)."""
    from engine.backends.hf._continuous import ContinuousBatcher

    if variant not in ("eager", "compiled", "onebyone"):
        raise ValueError(f"unknown variant {variant!r}")
    original = ContinuousBatcher._pump
    if variant == "onebyone":
        ContinuousBatcher._pump = _pump_one_by_one  # type: ignore[method-assign]
    try:
        with compiled_generation(variant == "compiled"):
            yield
    finally:
        ContinuousBatcher._pump = original  # type: ignore[method-assign]


def profile_table(model: Any, args: argparse.Namespace, ps: list[list[int]]) -> dict[str, str]:
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device.startswith("cuda") else [])
    with profile(activities=activities) as prof:
        static_direct(model, args, ps)
    events = prof.key_averages()
    tables = {"self_cpu": events.table(sort_by="self_cpu_time_total", row_limit=20, max_name_column_width=60)}
    if args.device.startswith("cuda"):
        for key in ("self_device_time_total", "self_cuda_time_total"):  # the name changed across torch versions
            try:
                tables["self_cuda"] = events.table(sort_by=key, row_limit=20, max_name_column_width=60)
                break
            except (AttributeError, KeyError, ValueError) as exc:
                tables["self_cuda"] = f"sort_by={key}: {exc!r}"
    for name, table in tables.items():
        print(f"-- torch.profiler, static_direct, top 20 by {name} --\n{table}", flush=True)
    return tables


def main(argv: list[str] | None = None) -> int:
    import os

    import torch
    import transformers

    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0] if __doc__ else None)
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--layers", type=int, default=0, help="override num_hidden_layers (0: SmolLM2's 30)")
    p.add_argument("--hidden", type=int, default=0, help="override hidden_size (0: SmolLM2's 576)")
    p.add_argument("--vocab", type=int, default=0, help="override vocab_size (0: SmolLM2's 49152)")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=120)
    p.add_argument("--new", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--only", default="", help="comma-separated eager cases (default raw_generate, static_direct, "
                   "static_engine, continuous_engine; also raw_generate_sample, static_thread)")
    p.add_argument("--compiled", default="", help="cases to rerun with a static cache + torch.compile (CUDA), "
                   "e.g. raw_generate,static_direct")
    p.add_argument("--plan", default="", help="overrides --only/--compiled/--no-profile: comma-separated "
                   "VARIANT:CASE (variant eager, compiled or onebyone) or profile, run in this order")
    p.add_argument("--budget-s", type=float, default=1e9, help="start no case after this many seconds")
    p.add_argument("--min-left-s", type=float, default=0.0, help="skip a case with less than this left of --budget-s")
    p.add_argument("--no-profile", action="store_true")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if args.device == "cpu":
        torch.set_num_threads(int(os.environ.get("GPU_PROFILE_THREADS", "1")))
    model = build_model(args)
    ps = prompts(args, model.config.vocab_size)
    print(f"torch {torch.__version__} transformers {transformers.__version__} device {args.device} "
          f"{torch.cuda.get_device_name(0) if args.device.startswith('cuda') else ''} dtype {args.dtype} "
          f"layers {model.config.num_hidden_layers} hidden {model.config.hidden_size} batch {args.batch} "
          f"new {args.new} threads {torch.get_num_threads()} attn {model.config._attn_implementation}", flush=True)
    cases = {
        "raw_generate": lambda: raw_generate(model, args, ps, False),
        "raw_generate_sample": lambda: raw_generate(model, args, ps, True),
        "static_direct": lambda: static_direct(model, args, ps),
        "static_thread": lambda: static_thread(model, args, ps),
        "static_engine": lambda: engine_run(model, args, ps, "static"),
        "continuous_engine": lambda: engine_run(model, args, ps, "continuous"),
        "continuous_direct": lambda: continuous_direct(model, args, ps, False),
        "continuous_direct_streaming": lambda: continuous_direct(model, args, ps, True),
    }
    t_start = time.perf_counter()
    records: list[dict[str, Any]] = []
    tables: dict[str, str] = {}

    def dump() -> None:
        if args.out:
            doc = {"schema": "gpu_profile/1", "args": vars(args), "torch": torch.__version__,
                   "transformers": transformers.__version__, "records": records, "profile": tables,
                   "elapsed_s": round(time.perf_counter() - t_start, 1)}
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")

    if args.plan:  # "variant:case" or "profile", in order
        plan = [tuple(item.split(":", 1)) if ":" in item else ("eager", item) for item in args.plan.split(",")]
    else:
        plan = [("eager", name) for name in (args.only or "raw_generate,static_direct,static_engine,continuous_engine"
                                             ).split(",")]
        if not args.no_profile:
            plan.insert(2, ("eager", "profile"))
        plan += [("compiled", name) for name in args.compiled.split(",") if name]
    for variant, name in plan:
        left = args.budget_s - (time.perf_counter() - t_start)
        if left < args.min_left_s:
            print(f"  skip {variant}/{name}: {left:.0f} s of --budget-s left", flush=True)
            records.append({"name": name, "variant": variant, "skipped": f"{left:.0f} s left"})
            continue
        try:
            if name == "profile":
                tables = profile_table(model, args, ps)
            else:
                with variant_context(variant):
                    rec = measure(name, cases[name], args, label=f"{variant}/{name}")
                rec["variant"] = variant
                records.append(rec)
        except Exception as exc:  # report and go on: one device call must bring back all it can
            print(f"  {variant}/{name} FAILED: {exc!r}"[:2000], flush=True)
            records.append({"name": name, "variant": variant, "error": repr(exc)[:2000]})
        dump()
    return 0


if __name__ == "__main__":
    sys.exit(main())

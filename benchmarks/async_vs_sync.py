"""Asynchronous vs synchronous batched rollout on a real backend (``rollout bench --backend hf|sglang|vllm``).

The same episodes run two ways on one backend, one after the other (``--repeats``
times, interleaved), in one process and one engine (same model, same warm
caches, same reward pool):

* ``sync``: what a synchronous RL trainer does: take a batch of ``concurrency``
  prompts, generate all of them, wait for the slowest, score them all, build
  the trajectories, repeat;
* ``async``: the engine: ``concurrency`` episodes in flight, a new one admitted
  as soon as one ends (:func:`engine.open_rollout_engine` + :class:`workflows.rlvr.RLVRWorkflow`).

Same prompts (the first ``prompts`` GSM8K test questions: ``benchmarks/data/gsm8k_test_64.jsonl``
is the first 64 rows of the GSM8K test split, MIT licence in ``GSM8K_LICENSE``; ``--dataset``
for another jsonl), same sampling (``temperature``, natural EOS, ``max_new_tokens``), the
GSM8K reward in the engine's reward pool on both sides.  Where the backend honours
per-request seeds (``hf`` static mode, vLLM, SGLang) both sides send request ``i``
with the same seed, ``derive_seed(seed, i, 0, 0)``, so they generate the same tokens; ``hf``
continuous mode has no seeds, so lengths are drawn afresh on each side.

Reported per run: episodes/s, generated tokens/s, output-length spread (the long
tail is what async rollout wins on), slot occupancy (mean generation requests
in flight / ``concurrency``), and what the backend's machine did: ``hf``: the
process's CPU (``cpu_cores_busy`` = CPU seconds / wall seconds; the process is
the backend), ``--server-pid``: the CPU of that server's process tree, and GPU
utilisation (mean of ``nvidia-smi`` samples) where ``nvidia-smi`` exists here.
The summary gives the medians per mode and the ratios async / sync.

JSON (``--out``; schema ``bench_real/1``)::

    {"schema": "bench_real/1", "created": str, "machine": {"cpus", "python", "platform",
     "load_avg_1m_before", "load_avg_1m_after"}, "config": RealBenchConfig as a dict,
     "used": {"backend", "model", "tokenizer", "servers", "hf_mode", "seeded"},
     "runs": [{"mode", "repeat", "episodes", "accepted", "failed", "wall_s", "episodes_per_s",
               "generated_tokens", "tokens_per_s", "out_len": {"mean", "p50", "p90", "max"},
               "truncated_fraction", "reward_mean", "slot_occupancy", "cpu_s", "cpu_cores_busy",
               "server_cpu_s", "server_cpu_cores_busy", "gpu_util_mean"}, ...],
     "summary": {"sync": {...medians...}, "async": {...}, "episodes_per_s_ratio": float,
                 "tokens_per_s_ratio": float}}
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

__all__ = ["DEFAULT_DATASET", "MODES", "RealBenchConfig", "format_real_table", "run_from_args", "run_real_bench"]

DEFAULT_DATASET = str(Path(__file__).resolve().parent / "data" / "gsm8k_test_64.jsonl")
MODES = ("sync", "async")
BACKENDS = ("hf", "sglang", "vllm")


@dataclass(frozen=True, kw_only=True)
class RealBenchConfig:
    """One async-vs-sync comparison (units in the names).

    ``concurrency``: the synchronous batch size and the asynchronous episodes in
    flight (the same generation budget on both sides).  ``model``: for ``hf`` a
    model spec (:func:`engine.models.resolve_model`; default the built-in
    SmolLM2-135M-Instruct), for a server the model whose tokenizer to use
    (default: what the server reports).  ``hf_mode``: ``HFBackend`` serving mode
    (``continuous``: finished rows leave and new ones join, as in vLLM/SGLang;
    ``static``: one ``generate`` per batch).  ``torch_threads``: torch intra-op
    threads for ``hf`` (None: leave torch's setting).  ``server_pid``: a local
    server process whose CPU (with its children) is read from ``/proc``.
    """

    backend: str = "hf"
    servers: tuple[str, ...] = ()
    model: str | None = None
    dataset: str = DEFAULT_DATASET
    prompts: int = 32
    concurrency: int = 8
    max_new_tokens: int = 256
    temperature: float = 1.0
    seed: int = 0
    hf_mode: str = "continuous"
    torch_threads: int | None = 1
    repeats: int = 1
    modes: tuple[str, ...] = MODES
    warmup: int = 2
    reward_batch_size: int | None = None
    reward_workers: int | None = None
    server_pid: int | None = None
    request_timeout_s: float = 3600.0
    startup_timeout_s: float = 300.0

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")
        if self.backend != "hf" and not self.servers:
            raise ValueError(f"backend {self.backend!r} needs at least one server URL (--server)")
        if self.backend == "hf" and self.servers:
            raise ValueError("servers (--server) apply to --backend sglang|vllm, not hf")
        for name in ("prompts", "concurrency", "max_new_tokens", "repeats"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.warmup < 0:
            raise ValueError(f"warmup must be >= 0, got {self.warmup}")
        if not (self.temperature >= 0 and math.isfinite(self.temperature)):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if self.hf_mode not in ("static", "continuous"):
            raise ValueError(f"hf_mode must be 'static' or 'continuous', got {self.hf_mode!r}")
        if self.torch_threads is not None and self.torch_threads < 1:
            raise ValueError(f"torch_threads must be >= 1, got {self.torch_threads}")
        bad = [m for m in self.modes if m not in MODES]
        if bad or not self.modes:
            raise ValueError(f"modes must be a non-empty subset of {MODES}, got {list(self.modes)}")

    @property
    def seeded(self) -> bool:
        """Whether requests carry seeds (not in hf continuous mode, which has none)."""
        return not (self.backend == "hf" and self.hf_mode == "continuous")


# -- measuring ---------------------------------------------------------------------------------------
class _InFlight:
    """Generation requests in flight over time: an exact time-weighted mean (trio clock)."""

    def __init__(self) -> None:
        import trio

        self._now = trio.current_time
        self.current = 0
        self.start()

    def start(self) -> None:
        """Start a new measurement window."""
        self._t0 = self._last = self._now()
        self._area = 0.0

    def _advance(self) -> None:
        now = self._now()
        self._area += self.current * (now - self._last)
        self._last = now

    def enter(self) -> None:
        self._advance()
        self.current += 1

    def exit(self) -> None:
        self._advance()
        self.current -= 1

    def mean(self) -> float:
        """Mean requests in flight since :meth:`start`."""
        self._advance()
        elapsed = self._last - self._t0
        return self._area / elapsed if elapsed > 0 else 0.0


class _Counted:
    """The engine as a workflow sees it, counting generation requests in flight."""

    def __init__(self, engine: Any, meter: _InFlight) -> None:
        self._engine = engine
        self._meter = meter

    @property
    def reward_pool(self) -> Any:
        return self._engine.reward_pool

    async def agenerate(self, req: Any) -> Any:
        self._meter.enter()
        try:
            return await self._engine.agenerate(req)
        finally:
            self._meter.exit()


def _tree_cpu_s(pid: int) -> float | None:
    """CPU seconds (user + system, reaped children included) of ``pid`` and its
    live descendants, from ``/proc``; None when unreadable."""
    tick = os.sysconf("SC_CLK_TCK")
    parents: dict[int, int] = {}
    times: dict[int, float] = {}
    try:
        entries = [e for e in os.listdir("/proc") if e.isdigit()]
    except OSError:
        return None
    for entry in entries:
        try:
            with open(f"/proc/{entry}/stat", encoding="ascii", errors="replace") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents[int(entry)] = int(fields[1])
        times[int(entry)] = sum(int(x) for x in fields[11:15]) / tick  # utime stime cutime cstime
    if pid not in times:
        return None
    total, frontier = 0.0, [pid]
    while frontier:
        p = frontier.pop()
        total += times.get(p, 0.0)
        frontier += [c for c, parent in parents.items() if parent == p]
    return total


class _GpuSampler:
    """Mean ``utilization.gpu`` of ``nvidia-smi`` samples (every 0.5 s, in a thread)."""

    def __init__(self) -> None:
        self.samples: list[float] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if shutil.which("nvidia-smi") is None:
            return
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                out = subprocess.run(["nvidia-smi", "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits"],
                                     capture_output=True, text=True, timeout=5).stdout
                values = [float(x) for x in out.split()]
                if values:
                    self.samples.append(sum(values) / len(values))
            except (OSError, ValueError, subprocess.SubprocessError):
                return
            self._stop.wait(0.5)

    def stop(self) -> float | None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        return round(statistics.fmean(self.samples), 1) if self.samples else None


def _pct(values: list[int], q: float) -> int:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


# -- the two modes -----------------------------------------------------------------------------------
async def _run_async(engine: Any, workflow: Any, items: list[dict[str, Any]]) -> list[Any]:
    for i, item in enumerate(items):
        engine.submit(item, workflow, task_id=i)
    results = await engine.wait_results(len(items))
    return [r.trajectory if r.status == "accepted" else None for r in results]


async def _run_sync(engine: Any, workflow: Any, items: list[dict[str, Any]], cfg: RealBenchConfig) -> list[Any]:
    """Generate a batch, wait for the slowest, score the batch, repeat."""
    import trio

    from engine.trajectory import trajectory_from_response
    from engine.types import ModelRequest, derive_seed

    out: list[Any] = []
    sample_cfg = workflow._sample_cfg
    for start in range(0, len(items), cfg.concurrency):
        batch = items[start:start + cfg.concurrency]
        prompts = [workflow._prompt(item) for item in batch]
        resps: list[Any] = [None] * len(batch)
        scores: list[Any] = [None] * len(batch)

        async def generate(i: int) -> None:
            gcfg = sample_cfg if sample_cfg.seed is None else sample_cfg.new(
                seed=derive_seed(sample_cfg.seed, start + i, 0, 0))  # what the workflow sends for task start + i
            try:
                resps[i] = await engine.agenerate(ModelRequest(input_ids=prompts[i].ids, gconfig=gcfg,
                                                               tokenizer=workflow.tokenizer))
            except Exception as exc:  # counted as failed, as the engine would
                resps[i] = exc

        async def score(i: int) -> None:
            scores[i] = await workflow._reward(engine, resps[i], batch[i], prompts[i])

        async with trio.open_nursery() as nursery:  # generate the whole batch ...
            for i in range(len(batch)):
                nursery.start_soon(generate, i)
        ok = [i for i in range(len(batch)) if not isinstance(resps[i], BaseException)]
        async with trio.open_nursery() as nursery:  # ... then score it
            for i in ok:
                nursery.start_soon(score, i)
        for i in range(len(batch)):
            out.append(trajectory_from_response(resps[i], scores[i].reward, reward_is_fallback=scores[i].is_fallback)
                       if i in ok else None)
    return out


async def _open_backend(cfg: RealBenchConfig) -> tuple[Any, Any, dict[str, Any]]:
    import trio

    if cfg.backend == "hf":
        def load() -> tuple[Any, Any]:
            import torch
            from transformers import AutoTokenizer

            from engine.backends.hf import HFBackend
            from engine.models import resolve_model

            if cfg.torch_threads:
                torch.set_num_threads(cfg.torch_threads)  # a command owns its process
            path = resolve_model(cfg.model)
            tokenizer = AutoTokenizer.from_pretrained(path)
            return tokenizer, HFBackend(path, tokenizer, mode=cfg.hf_mode, max_batch_size=cfg.concurrency)

        tokenizer, backend = await trio.to_thread.run_sync(load)
        return tokenizer, backend, {"model": cfg.model or "builtin:smollm2", "servers": []}
    from engine.backends.remote import open_remote_backend

    tokenizer, backend, used = await open_remote_backend(cfg.backend, list(cfg.servers), model=cfg.model,
                                                         request_timeout_s=cfg.request_timeout_s,
                                                         startup_timeout_s=cfg.startup_timeout_s)
    return tokenizer, backend, {"model": used["model"], "servers": used["servers"]}


def _record(mode: str, repeat: int, trajs: list[Any], wall: float, cpu_s: float, server_cpu: float | None,
            gpu: float | None, occupancy: float, cfg: RealBenchConfig) -> dict[str, Any]:
    accepted = [t for t in trajs if t is not None]
    lens = [int(t["loss_mask"].sum()) for t in accepted]
    tokens = sum(lens)
    return {
        "mode": mode, "repeat": repeat, "episodes": len(trajs), "accepted": len(accepted),
        "failed": len(trajs) - len(accepted), "wall_s": round(wall, 3),
        "episodes_per_s": round(len(accepted) / wall, 4), "generated_tokens": tokens,
        "tokens_per_s": round(tokens / wall, 2),
        "out_len": {"mean": round(tokens / max(1, len(lens)), 1), "p50": _pct(lens, 0.5) if lens else None,
                    "p90": _pct(lens, 0.9) if lens else None, "max": max(lens) if lens else None},
        "truncated_fraction": round(sum(bool(t["is_truncated"].item()) for t in accepted) / max(1, len(accepted)), 3),
        "reward_mean": round(sum(float(t["rewards"].item()) for t in accepted) / max(1, len(accepted)), 4),
        "slot_occupancy": round(occupancy / cfg.concurrency, 3),
        "cpu_s": round(cpu_s, 2), "cpu_cores_busy": round(cpu_s / wall, 3),
        "server_cpu_s": None if server_cpu is None else round(server_cpu, 2),
        "server_cpu_cores_busy": None if server_cpu is None else round(server_cpu / wall, 3),
        "gpu_util_mean": gpu,
    }


async def run_real_bench(cfg: RealBenchConfig, log: Any = None) -> dict[str, Any]:
    """Run ``cfg`` (both modes, ``repeats`` times, interleaved) and return the JSON
    document (schema in the module docstring).

    Raises:
        DatasetError: the dataset cannot be read or has fewer than ``prompts`` rows.
        BackendError / InvalidRequestError: the backend cannot start (model, servers).
    """
    import trio

    from engine import EngineConfig, GenerationHyperparameters, open_rollout_engine
    from engine.datasets import load_dataset
    from engine.errors import DatasetError
    from rewards import RewardPool, gsm8k_reward
    from workflows.rlvr import RLVRWorkflow

    log = log or (lambda message: None)
    load_before = os.getloadavg()[0]
    items = await trio.to_thread.run_sync(lambda: load_dataset(cfg.dataset, cfg.prompts, required=("answer",)))
    if len(items) < cfg.prompts:
        raise DatasetError(f"dataset {cfg.dataset} has {len(items)} rows, fewer than prompts={cfg.prompts}")
    tokenizer, backend, used = await _open_backend(cfg)
    gconfig = GenerationHyperparameters(n_samples=1, max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature,
                                        greedy=cfg.temperature == 0, seed=cfg.seed if cfg.seeded else None)
    meter = _InFlight()
    defaults = EngineConfig()
    config = EngineConfig(max_concurrent_rollouts=cfg.concurrency, reward_max_workers=cfg.reward_workers,
                          reward_batch_size=cfg.reward_batch_size or defaults.reward_batch_size)

    class Counting(RLVRWorkflow):  # the engine's own workflow, counting requests in flight
        async def arun_episode(self, engine: Any, data: dict[str, Any]) -> Any:
            return await super().arun_episode(_Counted(engine, meter), data)

    workflow = Counting(gsm8k_reward, gconfig, tokenizer)
    runs: list[dict[str, Any]] = []
    async with open_rollout_engine(backend, config, tokenizer=tokenizer) as engine:
        assert isinstance(engine.reward_pool, RewardPool)  # the engine's own (local workers)
        await engine.reward_pool.check_reward_fn(gsm8k_reward, items[0])
        if cfg.warmup:  # loads the model's kernels, starts the reward workers (not measured)
            warm = Counting(gsm8k_reward, gconfig.new(max_new_tokens=8), tokenizer)
            await _run_sync(engine, warm, items[:cfg.warmup], replace(cfg, concurrency=cfg.warmup))
        counted = _Counted(engine, meter)
        for repeat in range(cfg.repeats):
            for mode in cfg.modes:
                log(f"  {mode} run {repeat + 1}/{cfg.repeats}: {cfg.prompts} prompts, {cfg.concurrency} at a time ...")
                gpu = _GpuSampler()
                gpu.start()
                server0 = _tree_cpu_s(cfg.server_pid) if cfg.server_pid else None
                cpu0, t0 = time.process_time(), time.perf_counter()
                meter.start()
                if mode == "sync":
                    trajs = await _run_sync(counted, workflow, items, cfg)
                else:
                    trajs = await _run_async(engine, workflow, items)
                wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
                occupancy = meter.mean()
                server1 = _tree_cpu_s(cfg.server_pid) if cfg.server_pid else None
                server_cpu = server1 - server0 if server0 is not None and server1 is not None else None
                runs.append(_record(mode, repeat, trajs, wall, cpu, server_cpu, gpu.stop(), occupancy, cfg))
                r = runs[-1]
                log(f"  {mode}: {r['episodes_per_s']} episodes/s, {r['tokens_per_s']} tokens/s, "
                    f"occupancy {r['slot_occupancy']}, {r['wall_s']} s")
    summary: dict[str, Any] = {}
    for mode in cfg.modes:
        mine = [r for r in runs if r["mode"] == mode]
        summary[mode] = {key: statistics.median(r[key] for r in mine)
                         for key in ("wall_s", "episodes_per_s", "tokens_per_s", "slot_occupancy", "cpu_cores_busy")}
        summary[mode]["reward_mean"] = statistics.fmean(r["reward_mean"] for r in mine)
    if "sync" in summary and "async" in summary:
        for key in ("episodes_per_s", "tokens_per_s"):
            summary[f"{key}_ratio"] = round(summary["async"][key] / summary["sync"][key], 3)
    import platform

    return {
        "schema": "bench_real/1", "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform(),
                    "load_avg_1m_before": round(load_before, 2), "load_avg_1m_after": round(os.getloadavg()[0], 2)},
        "config": asdict(cfg),
        "used": {"backend": cfg.backend, **used, "tokenizer": str(getattr(tokenizer, "name_or_path", "")),
                 "hf_mode": cfg.hf_mode if cfg.backend == "hf" else None, "seeded": cfg.seeded},
        "runs": runs, "summary": summary,
    }


def format_real_table(doc: dict[str, Any]) -> str:
    """One line per run and the ratio, as text."""
    cfg = doc["config"]
    head = (f"rollout bench --backend {cfg['backend']}: {cfg['prompts']} GSM8K prompts, "
            f"{cfg['concurrency']} at a time, "
            f"max_new_tokens {cfg['max_new_tokens']}, temperature {cfg['temperature']}, model {doc['used']['model']}"
            + (f" ({cfg['hf_mode']})" if cfg["backend"] == "hf" else ""))
    cols = ("mode", "wall s", "episodes/s", "tokens/s", "out len mean/p50/p90/max", "trunc", "occupancy",
            "CPU cores", "server CPU", "GPU %", "reward")
    rows = []
    for r in doc["runs"]:
        o = r["out_len"]
        rows.append((r["mode"], f"{r['wall_s']:.1f}", f"{r['episodes_per_s']:.3f}", f"{r['tokens_per_s']:.1f}",
                     f"{o['mean']}/{o['p50']}/{o['p90']}/{o['max']}", f"{r['truncated_fraction']:.2f}",
                     f"{r['slot_occupancy']:.2f}", f"{r['cpu_cores_busy']:.2f}",
                     "-" if r["server_cpu_cores_busy"] is None else f"{r['server_cpu_cores_busy']:.2f}",
                     "-" if r["gpu_util_mean"] is None else f"{r['gpu_util_mean']:.0f}", f"{r['reward_mean']:.3f}"))
    widths = [max(len(str(x)) for x in col) for col in zip(cols, *rows)]
    lines = [head, "  ".join(c.rjust(w) for c, w in zip(cols, widths)), "  ".join("-" * w for w in widths)]
    lines += ["  ".join(str(x).rjust(w) for x, w in zip(row, widths)) for row in rows]
    s = doc["summary"]
    if "episodes_per_s_ratio" in s:
        lines.append(f"async / sync: episodes/s x{s['episodes_per_s_ratio']}, tokens/s x{s['tokens_per_s_ratio']} "
                     f"(medians of {cfg['repeats']})")
    return "\n".join(lines)


#: ``rollout bench`` options that only the simulated server has.
SIM_ONLY = ("batch_size", "warmup", "prefill_s", "prefill_s_per_token", "per_token_s", "out_len_median",
            "out_len_sigma", "max_running_seqs", "decode_slowdown_per_seq", "straggler_fraction",
            "straggler_multiplier", "error_fraction", "abort_fraction", "max_head_offpolicyness", "tokenizer",
            "window", "sample_every_s", "gc_tuning")


def run_from_args(args: argparse.Namespace) -> int:
    """``rollout bench --backend hf|sglang|vllm``: run, print the table, write the JSON; exit status
    (2: bad options or the backend could not start; 1: an episode failed)."""
    import trio

    from engine.errors import RolloutError

    given = [name for name in SIM_ONLY if getattr(args, name, None) is not None]
    try:
        if given:
            raise ValueError(f"--{given[0].replace('_', '-')} applies to --backend sim only")
        if args.sides is not None:
            raise ValueError("--sides applies to --backend sim only (a real backend runs the modes sync and async)")

        def or_default(value: Any, default: Any) -> Any:
            return default if value is None else value

        d = RealBenchConfig(backend="hf")
        cfg = RealBenchConfig(
            backend=args.backend, servers=tuple(args.server), model=args.model, dataset=or_default(args.dataset, d.dataset),
            prompts=or_default(args.episodes, d.prompts), concurrency=or_default(args.concurrency, d.concurrency),
            max_new_tokens=or_default(args.max_new_tokens, d.max_new_tokens),
            temperature=or_default(args.temperature, d.temperature), seed=or_default(args.seed, d.seed), hf_mode=args.hf_mode,
            torch_threads=args.torch_threads, repeats=args.repeats, reward_batch_size=args.reward_batch_size,
            modes=tuple(m.strip() for m in args.modes.split(",") if m.strip()),
            reward_workers=args.reward_workers, server_pid=args.server_pid,
            request_timeout_s=args.request_timeout, startup_timeout_s=args.startup_timeout)
        doc = trio.run(run_real_bench, cfg, lambda m: print(m, file=sys.stderr, flush=True))
    except (ValueError, RolloutError, OSError) as exc:
        print(f"rollout bench: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    print(format_real_table(doc))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {out}")
    return 0 if all(r["failed"] == 0 for r in doc["runs"]) else 1

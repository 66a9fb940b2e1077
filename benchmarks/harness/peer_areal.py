"""The AReaL side of ``rollout bench`` (:mod:`engine.bench`): runs under the AReaL
peer venv's interpreter (``.venv-areal-peer``, built by ``make areal-peer``).

AReaL 1.0.4's ``WorkflowExecutor`` + ``RLVRWorkflow`` + ``AsyncRewardWrapper``,
unmodified, drive an in-process fake ``InferenceEngine`` whose ``agenerate``
makes the same draws as :class:`engine.backends.sim.SimBackend` (pure-Python
copies below, checked against the sim by ``tests/test_bench.py``) and
``asyncio.sleep``s their latency.  Only the standard library is imported at the
top; AReaL, torch and transformers are imported inside :func:`areal_side`.
"""

from __future__ import annotations

import hashlib
import math
import random
import threading
import time
from array import array
from typing import Any

from ._bench_meter import Meter, percentile, staleness_histogram
from .bench import _POOL, BenchConfig, _r, bench_item, corpus_token_pool, pool_digest

__all__ = ["areal_side"]


def _pure_prompt_key(input_ids: list[int]) -> int:
    """Same as :func:`engine.backends.sim.prompt_key` (a test checks they agree)."""
    return int.from_bytes(hashlib.blake2b(array("q", input_ids).tobytes(), digest_size=8).digest(), "little")


def _pure_draw(sim: dict[str, Any], key: int, occurrence: int, budget: int) -> tuple[int, bool, int, float]:
    """Same draws as ``SimBackend.draw`` with ``draws_by_prompt`` for the AReaL side
    (no failures): (tokens, finished, pool offset, multiplier).  A test checks they agree."""
    rng = random.Random((sim["seed"] * 1_000_003 + occurrence) ^ key)
    n = sim["out_len_median"]
    if sim["out_len_sigma"] > 0:
        n = max(1, round(rng.lognormvariate(math.log(sim["out_len_median"]), sim["out_len_sigma"])))
    u_straggle, _u_fail = rng.random(), rng.random()
    finished = n < budget
    n = max(min(n, budget), 0)
    mult = sim["straggler_multiplier"] if u_straggle < sim["straggler_fraction"] else 1.0
    return n, finished, rng.randrange(_POOL - min(n, _POOL - 1)), mult


def _pure_pools(seed: int, first_token_id: int, vocab_size: int) -> tuple[list[int], list[float]]:
    """Same token/logprob pools as ``SimBackend`` (a test checks they agree)."""
    rng = random.Random(f"sim-pool:{seed}")
    tokens = [rng.randrange(first_token_id, vocab_size) for _ in range(_POOL)]
    return tokens, [-rng.uniform(0.01, 5.0) for _ in range(_POOL)]


def areal_side(cfg: BenchConfig, tokenizer_dir: str) -> dict[str, Any]:  # pragma: no cover - peer venv only
    """Run the AReaL side (in the peer venv's interpreter) and return its raw record."""
    import asyncio
    import logging

    import torch  # noqa: F401
    from transformers import AutoTokenizer

    from areal.api.cli_args import GenerationHyperparameters, InferenceEngineConfig
    from areal.api.engine_api import InferenceEngine
    from areal.api.io_struct import ModelResponse
    from areal.api.reward_api import AsyncRewardWrapper
    from areal.infra.workflow_executor import WorkflowExecutor
    from areal.utils import stats_tracker
    from areal.workflow.rlvr import RLVRWorkflow
    from rewards.gsm8k import gsm8k_reward

    for name in list(logging.root.manager.loggerDict):
        logging.getLogger(name).setLevel(logging.WARNING)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    sim = cfg.sim_params(vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id)
    _, lp_pool = _pure_pools(sim["seed"], sim["first_token_id"], sim["vocab_size"])
    tok_pool = corpus_token_pool(tokenizer, cfg.seed)
    tok_pool = (tok_pool * -(-_POOL // len(tok_pool)))[:_POOL]  # engine.backends.sim.tile_pool

    class FakeEngine(InferenceEngine):
        """The sim's per-request model: same draws, one asyncio.sleep of its latency."""

        def __init__(self) -> None:
            self._version, self._lock = 0, threading.Lock()
            self.seen: dict[int, int] = {}
            self.log: list[tuple[int, int, int, float]] = []
            self.inflight = self.peak_inflight = self.out_tokens = 0

        @property
        def initialized(self) -> bool:
            return True

        def get_version(self) -> int:
            with self._lock:
                return self._version

        def set_version(self, version: int) -> None:
            with self._lock:
                self._version = version

        async def agenerate(self, req: Any) -> Any:
            version = self.get_version()
            ids = list(req.input_ids)
            key = _pure_prompt_key(ids)
            occurrence = self.seen.get(key, 0)
            self.seen[key] = occurrence + 1
            budget = min(req.gconfig.max_tokens - len(ids), req.gconfig.max_new_tokens)
            n, finished, offset, mult = _pure_draw(sim, key, occurrence, budget)
            if cfg.record:
                self.log.append((key, len(ids), n, mult))
            prefill = (sim["prefill_s"] + len(ids) * sim["prefill_s_per_token"]) * mult
            latency = prefill + n * mult * sim["per_token_s"]
            self.inflight += 1
            self.peak_inflight = max(self.peak_inflight, self.inflight)
            try:
                await asyncio.sleep(latency)
            finally:
                self.inflight -= 1
            self.out_tokens += n
            tokens = tok_pool[offset:offset + n]
            if finished and tokens:
                tokens[-1] = sim["eos_token_id"]
            return ModelResponse(input_tokens=ids, output_tokens=tokens, output_logprobs=lp_pool[offset:offset + n],
                                 output_versions=[version] * n, stop_reason="stop" if finished else "length",
                                 tokenizer=req.tokenizer, latency=latency, ttft=prefill + mult * sim["per_token_s"])

    engine = FakeEngine()
    gconfig = GenerationHyperparameters(n_samples=1, max_new_tokens=cfg.max_new_tokens)
    workflow = RLVRWorkflow(reward_fn=gsm8k_reward, gconfig=gconfig, tokenizer=tokenizer, enable_thinking=False)
    if cfg.reward_workers is not None:
        workflow.async_reward_fn = AsyncRewardWrapper(gsm8k_reward, max_workers=cfg.reward_workers)
    inner_reward = workflow.async_reward_fn
    latencies: list[float] = []

    class TimedReward:  # reward latency from the call, queueing included (as ours)
        async def __call__(self, *args: Any, **kwargs: Any) -> Any:
            t = time.perf_counter()
            try:
                return await inner_reward(*args, **kwargs)
            finally:
                if cfg.record:
                    latencies.append(time.perf_counter() - t)

    workflow.async_reward_fn = TimedReward()

    def new_executor(batch: int) -> Any:
        ex = WorkflowExecutor(config=InferenceEngineConfig(
            max_concurrent_rollouts=cfg.concurrency, consumer_batch_size=batch,
            max_head_offpolicyness=10**9 if cfg.max_head_offpolicyness is None else cfg.max_head_offpolicyness,
        ), inference_engine=engine)
        ex.initialize(logger=logging.getLogger("WorkflowExecutor"), train_data_parallel_size=1)
        return ex

    if cfg.warmup:
        ex = new_executor(cfg.batch_size)
        for i in range(cfg.warmup):
            ex.submit(bench_item(i, warmup=True, seed=cfg.seed), workflow)
        ex.wait(count=cfg.warmup, timeout=3600)
        ex.destroy()
        engine.seen.clear()
        engine.log.clear()
        latencies.clear()
        engine.peak_inflight = engine.out_tokens = 0
        stats_tracker.export_all(reset=True)
    ex = new_executor(cfg.batch_size)
    n, window = cfg.episodes, cfg.effective_window
    submitted = consumed = accepted = 0
    reward_sum = 0.0
    stale: dict[int, int] = {}
    first_batch_s = None
    meter = Meter()
    stop = threading.Event()

    def sampler() -> None:
        while not stop.is_set():
            meter.sample(consumed)
            stop.wait(cfg.sample_every_s)

    threading.Thread(target=sampler, daemon=True).start()
    while consumed < n:
        while submitted < n and submitted - consumed < window:
            ex.submit(bench_item(submitted, seed=cfg.seed), workflow)
            submitted += 1
        results = ex.wait(count=min(cfg.batch_size, n - consumed), timeout=3600)
        if first_batch_s is None:
            first_batch_s = time.perf_counter() - meter.t0
        consumed += len(results)
        version = engine.get_version()
        for r in results:
            if r is None:
                continue
            accepted += 1
            reward_sum += float(r["rewards"].sum())
            oldest = int(r["versions"].masked_fill(r["loss_mask"] == 0, 1 << 30).min())
            stale[version - oldest] = stale.get(version - oldest, 0) + 1
        engine.set_version(version + 1)
        stats_tracker.export_all(reset=True)
    wall = time.perf_counter() - meter.t0
    stop.set()
    measured = meter.result(wall_s=wall, episodes=n, generated_tokens=engine.out_tokens,
                            max_inflight=engine.peak_inflight, keep_samples=not cfg.record)
    ex.destroy()
    import importlib.metadata as md

    return {
        "counts": {"accepted": accepted, "rejected": n - accepted, "failed": 0, "failed_by_reason": {}},
        "measured": measured, "log": engine.log, "time_to_first_batch_s": _r(first_batch_s),
        "staleness_histogram": staleness_histogram(stale), "reward_latency_p50_s": _r(percentile(latencies, 0.5)),
        "reward_latency_p99_s": _r(percentile(latencies, 0.99)), "reward_workers": inner_reward.max_workers,
        "reward_mean": _r(reward_sum / max(1, accepted)), "token_pool_digest": pool_digest(tok_pool),
        "areal_version": md.version("areal"),
    }

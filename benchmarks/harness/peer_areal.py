"""The AReaL side of the benchmark (:mod:`benchmarks.harness`): runs under the AReaL
peer venv's interpreter (``.venv-areal-peer``, built by ``make areal-peer``).

AReaL 1.0.4's ``WorkflowExecutor`` + ``RLVRWorkflow`` + ``AsyncRewardWrapper``,
unmodified, drive an in-process fake ``InferenceEngine`` whose ``agenerate``
makes the sim's draws by calling the sim's own draw code
(:func:`engine.backends.sim.draw`, ``engine/backends/sim/_draws.py``) and
``asyncio.sleep``s their latency.

That interpreter has AReaL, torch and transformers but neither trio nor this
project's other dependencies; :func:`~benchmarks.harness.sides.run_side` puts the
checkout on its ``PYTHONPATH``.  So this module imports, at the top, only the
standard library and modules that import nothing else: the harness's config,
workload and meter, and ``engine.backends.sim``'s ``SimConfig`` and draws, whose
package exports its names lazily (as ``engine`` does), so that importing them
loads neither trio nor the sim's backend (``tests/e2e/test_bench.py`` checks this
with trio and torch made unimportable).  AReaL, torch and transformers are
imported inside :func:`areal_side`.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from typing import Any, NamedTuple

from engine.backends.sim import SimConfig, completion, draw, prompt_key, prompt_rng, tile_pool, token_pools

from .config import BenchConfig
from .meter import Meter, batch_figures, percentile, rounded, staleness_histogram
from .workload import bench_item, corpus_token_pool, pool_digest

__all__ = ["PeerResponse", "SimPeer", "areal_side", "child_main"]


class PeerResponse(NamedTuple):
    """What :meth:`SimPeer.serve` answers: the completion, its stop reason, and its
    latency and time to first token in seconds (the sim's per-request model)."""

    tokens: list[int]
    logprobs: list[float]
    stop_reason: str
    latency: float
    ttft: float


class SimPeer:
    """The simulated server as the AReaL side serves it: :class:`~engine.backends.sim.SimBackend`'s
    draws, pools and per-request latency, by the same code, with no event loop
    (the caller sleeps :attr:`PeerResponse.latency`).  Only the per-request model:
    no shared server clock, no injected failures (:meth:`BenchConfig.areal_unsupported`).

    Args:
        sim: the sim's config (``draws_by_prompt`` is assumed: draws by prompt and occurrence).
        token_pool: token ids outputs are sliced from (tiled, as ``SimBackend(token_pool=...)``).
        record: keep ``(key, prompt_len, out_len, multiplier, outcome)`` per request in :attr:`log`.
    """

    def __init__(self, sim: SimConfig, token_pool: list[int], *, record: bool) -> None:
        self.sim, self.record = sim, record
        self.tokens = tile_pool(token_pool)
        _, self.logprobs = token_pools(sim.seed, sim.first_token_id, sim.vocab_size)
        self.seen: dict[int, int] = {}
        self.log: list[tuple[int, int, int, float, str]] = []

    def serve(self, input_ids: list[int], budget: int) -> PeerResponse:
        """One request: its draws (by prompt and occurrence), tokens and latency."""
        sim = self.sim
        key = prompt_key(input_ids)
        occurrence = self.seen.get(key, 0)
        self.seen[key] = occurrence + 1
        d = draw(sim, prompt_rng(sim.seed, key, occurrence), budget, key=key)
        if self.record:
            self.log.append((key, len(input_ids), d.n, d.multiplier, d.outcome))
        tokens, logprobs = completion(self.tokens, self.logprobs, d.offset, d.n,
                                      sim.eos_token_id if d.finished else None)
        prefill = sim.prefill_seconds(len(input_ids)) * d.multiplier
        return PeerResponse(tokens, logprobs, "stop" if d.finished else "length",
                            latency=prefill + d.n * d.multiplier * sim.per_token_s,
                            ttft=prefill + d.multiplier * sim.per_token_s)

    def reset(self) -> None:
        """Forget the occurrences and the log (after the warm-up)."""
        self.seen.clear()
        self.log.clear()


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
    peer = SimPeer(cfg.sim_for(tokenizer), corpus_token_pool(tokenizer, cfg.seed), record=cfg.record)

    class FakeEngine(InferenceEngine):
        """The sim's per-request model (:class:`SimPeer`): one asyncio.sleep of each request's latency."""

        def __init__(self) -> None:
            self._version, self._lock = 0, threading.Lock()
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
            budget = min(req.gconfig.max_tokens - len(ids), req.gconfig.max_new_tokens)
            out = peer.serve(ids, budget)
            self.inflight += 1
            self.peak_inflight = max(self.peak_inflight, self.inflight)
            try:
                await asyncio.sleep(out.latency)
            finally:
                self.inflight -= 1
            self.out_tokens += len(out.tokens)
            return ModelResponse(input_tokens=ids, output_tokens=out.tokens, output_logprobs=out.logprobs,
                                 output_versions=[version] * len(out.tokens), stop_reason=out.stop_reason,
                                 tokenizer=req.tokenizer, latency=out.latency, ttft=out.ttft)

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
        peer.reset()
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
        kept = [r for r in results if r is not None]
        accepted += len(kept)
        batch_reward, oldest = batch_figures(kept)  # the same consumer as every other side's Tally
        reward_sum += batch_reward
        for v in oldest:
            stale[version - v] = stale.get(version - v, 0) + 1
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
        "measured": measured, "log": peer.log, "time_to_first_batch_s": rounded(first_batch_s),
        "staleness_histogram": staleness_histogram(stale), "reward_latency_p50_s": rounded(percentile(latencies, 0.5)),
        "reward_latency_p99_s": rounded(percentile(latencies, 0.99)), "reward_workers": inner_reward.max_workers,
        "reward_mean": rounded(reward_sum / max(1, accepted)), "token_pool_digest": pool_digest(peer.tokens),
        "areal_version": md.version("areal"),
    }


def child_main() -> None:  # pragma: no cover - peer venv only
    """Entry point of the AReaL side's process: ``argv = [side, config json,
    tokenizer dir]``; prints ``RESULT <json>`` (counts, meter numbers, the request log)."""
    cfg = BenchConfig.from_dict(json.loads(sys.argv[2]))
    print("RESULT " + json.dumps(areal_side(cfg, sys.argv[3])), flush=True)

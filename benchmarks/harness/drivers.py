"""The in-process drivers of the ``ours`` and ``naive`` sides (run inside a side's process).

* :func:`drive_ours`: :func:`engine.open_rollout_engine` + :class:`workflows.rlvr.RLVRWorkflow`
  on :class:`~engine.backends.sim.SimBackend`, consumed in batches with a version bump after each;
* :func:`drive_naive`: a synchronous loop: tokenise a batch of ``concurrency`` prompts,
  generate them all, wait for all, then score them all.

Each returns the side's raw record (:func:`~benchmarks.harness.report.summary`, with the
sim's recorded ``requests`` for :func:`~benchmarks.harness.report.add_ideal`).
"""

from __future__ import annotations

import time
from dataclasses import asdict, replace
from typing import Any

import trio

from engine import BackendError, EngineConfig, GenerationHyperparameters, ModelRequest, SimBackend, open_rollout_engine
from engine.backends.base import validate_response
from engine.trajectory import trajectory_from_response
from rewards import gsm8k_reward, open_reward_pool
from workflows.rlvr import RLVRWorkflow, default_get_input_ids

from .config import BenchConfig
from .meter import Meter, Tally, percentile, rounded, staleness_histogram
from .report import summary
from .workload import bench_item, corpus_token_pool, pool_digest

__all__ = ["TimedPool", "drive_naive", "drive_ours"]


async def drive_ours(cfg: BenchConfig, tokenizer: Any) -> dict[str, Any]:
    """Run our side: a warm-up engine, then the measured one; the raw record."""
    sim = cfg.sim_for(tokenizer)
    gconfig = GenerationHyperparameters(n_samples=1, max_new_tokens=cfg.max_new_tokens)
    workflow = RLVRWorkflow(gsm8k_reward, gconfig, tokenizer, enable_thinking=False)
    pool_ids = corpus_token_pool(tokenizer, cfg.seed)
    defaults = EngineConfig()  # the reward pool is opened here (shared with the warm-up) with the engine's settings
    async with open_reward_pool(max_workers=cfg.reward_workers, batch_size=cfg.effective_reward_batch_size,
                                timeout_seconds=defaults.reward_timeout_seconds,
                                max_retries=defaults.reward_max_retries,
                                max_batch_delay_s=defaults.reward_max_batch_delay_s) as pool:
        if cfg.warmup:  # a throw-away engine: starts the reward workers, warms caches
            async with open_rollout_engine(SimBackend(sim, token_pool=pool_ids),
                                           EngineConfig(max_concurrent_rollouts=cfg.concurrency,
                                                        gc_tuning=cfg.gc_tuning),
                                           reward_pool=pool) as engine:
                for i in range(cfg.warmup):
                    engine.submit(bench_item(i, warmup=True, seed=cfg.seed), workflow)
                await engine.wait_results(cfg.warmup)
        backend = SimBackend(sim, record=cfg.record, token_pool=pool_ids)
        config = EngineConfig(max_concurrent_rollouts=cfg.concurrency, consumer_batch_size=cfg.batch_size,
                              max_head_offpolicyness=cfg.max_head_offpolicyness, gc_tuning=cfg.gc_tuning)
        tally = Tally()
        n, window = cfg.episodes, cfg.effective_window
        submitted = consumed = max_inflight = 0
        first_batch_s = None
        timed = TimedPool(pool)
        meter = Meter()
        async with open_rollout_engine(backend, config, reward_pool=timed if cfg.record else pool) as engine, \
                trio.open_nursery() as bg:
            async def sampler() -> None:
                nonlocal max_inflight
                while True:
                    meter.sample(consumed)
                    max_inflight = max(max_inflight, engine.statistics().running)
                    await trio.sleep(cfg.sample_every_s)

            bg.start_soon(sampler)
            while consumed < n:
                while submitted < n and submitted - consumed < window:
                    engine.submit(bench_item(submitted, seed=cfg.seed), workflow)
                    submitted += 1
                results = await engine.wait_results(min(cfg.batch_size, n - consumed))
                if first_batch_s is None:
                    first_batch_s = time.perf_counter() - meter.t0
                consumed += len(results)
                version = engine.version
                max_inflight = max(max_inflight, engine.statistics().running)
                tally.add(results, version)
                engine.set_version(version + 1)
            wall = time.perf_counter() - meter.t0
            max_inflight = max(max_inflight, backend.peak_in_progress)  # exact (the samples can miss the peak)
            stats = engine.statistics()
            bg.cancel_scope.cancel()
        measured = meter.result(wall_s=wall, episodes=n, generated_tokens=stats.generated_tokens,
                                max_inflight=max_inflight, keep_samples=not cfg.record)
        latencies = timed.latencies if cfg.record else None
        pool_stats = pool.statistics()
    if latencies is None:  # the pool's window of recent calls
        p50, p99 = pool_stats.latency_p50_s, pool_stats.latency_p99_s
    else:
        p50, p99 = percentile(latencies, 0.5), percentile(latencies, 0.99)
    return summary("ours", cfg, tally.counts_with_reasons(), measured, requests=recorded_requests(backend),
                   time_to_first_batch_s=rounded(first_batch_s), staleness_histogram=staleness_histogram(tally.stale),
                   reward_latency_p50_s=rounded(p50), reward_latency_p99_s=rounded(p99),
                   reward_workers=pool.max_workers, reward_fallbacks=pool_stats.fallbacks,
                   reward_mean=tally.reward_mean,
                   token_pool_digest=pool_digest(backend.token_pool), backend=asdict(backend.statistics()))


class TimedPool:
    """A reward pool proxy that keeps each call's latency (the pool's own
    ``RewardOutcome.latency_s``: from the call, queueing and retries included)."""

    def __init__(self, pool: Any) -> None:
        self._pool = pool
        self.latencies: list[float] = []

    async def score(self, *args: Any, **kwargs: Any) -> Any:
        outcome = await self._pool.score(*args, **kwargs)
        self.latencies.append(outcome.latency_s)
        return outcome

    def __getattr__(self, name: str) -> Any:
        return getattr(self._pool, name)


def recorded_requests(backend: Any) -> list[tuple[Any, ...]] | None:
    """The sim's recorded requests as ``(key, prompt_len, out_len, multiplier, outcome)``
    tuples (None when it did not record)."""
    if not backend.record:
        return None
    return [(r.key, r.prompt_len, r.out_len, r.multiplier, r.outcome) for r in backend.requests]


async def drive_naive(cfg: BenchConfig, tokenizer: Any) -> dict[str, Any]:
    """Run the naive side: generate a whole batch of ``concurrency`` episodes, wait
    for all, then score all; the raw record."""
    sim = cfg.sim_for(tokenizer)
    gconfig = GenerationHyperparameters(n_samples=1, max_new_tokens=cfg.max_new_tokens)
    gconfig = gconfig.new_with_stop_and_pad_token_ids(tokenizer)
    sample_cfg = gconfig.new(n_samples=1)
    skip = gconfig.skip_special_tokens
    pool_ids = corpus_token_pool(tokenizer, cfg.seed)

    async def generate(backend: Any, req: Any) -> Any:
        budget = req.validate()
        prompt = list(req.input_ids)
        tokens: list[int] = []
        logprobs: list[float] = []
        versions: list[int] = []
        while True:  # resume an aborted request, as the engine does
            seg = req if not tokens else replace(req, input_ids=prompt + tokens)
            resp = await backend.generate(seg, budget - len(tokens))  # straight to the server (counted)
            validate_response(resp, seg)
            tokens += resp.output_tokens
            logprobs += resp.output_logprobs
            versions += resp.output_versions
            if resp.stop_reason != "abort" or len(tokens) >= budget:
                break
        return replace(resp, input_tokens=prompt, output_tokens=tokens, output_logprobs=logprobs,
                       output_versions=versions)

    async def run_batch(backend: Any, pool: Any, items: list[dict[str, Any]], counts: dict[str, Any]) -> list[Any]:
        ids = [default_get_input_ids(tokenizer, item, False) for item in items]
        resps: list[Any] = [None] * len(items)
        rewards: list[Any] = [None] * len(items)

        async def gen(i: int) -> None:
            try:
                resps[i] = await generate(backend, ModelRequest(input_ids=ids[i], gconfig=sample_cfg))
            except BackendError as exc:
                resps[i] = exc

        async def score(i: int) -> None:
            resp = resps[i]
            prompt = tokenizer.decode(resp.input_tokens, skip_special_tokens=False)
            completion = tokenizer.decode(resp.output_tokens, skip_special_tokens=skip)
            outcome = await pool.score(gsm8k_reward, prompt, completion, resp.input_tokens, resp.output_tokens,
                                       **items[i])
            rewards[i] = outcome.reward

        async with trio.open_nursery() as nursery:  # generate all ...
            for i in range(len(items)):
                nursery.start_soon(gen, i)
        ok = [i for i, r in enumerate(resps) if not isinstance(r, BaseException)]
        counts["failed"] += len(items) - len(ok)
        async with trio.open_nursery() as nursery:  # ... then score all
            for i in ok:
                nursery.start_soon(score, i)
        counts["accepted"] += len(ok)
        return [trajectory_from_response(resps[i], rewards[i]) for i in ok]

    async with open_reward_pool(max_workers=cfg.reward_workers,
                                batch_size=cfg.effective_reward_batch_size) as real_pool:
        pool = TimedPool(real_pool)
        for phase in ("warmup", "measure"):
            backend = SimBackend(sim, record=cfg.record and phase == "measure", token_pool=pool_ids)
            async with backend.open():  # the sim's event clock
                counts: dict[str, Any] = {"accepted": 0, "rejected": 0, "failed": 0}
                if phase == "warmup":
                    if cfg.warmup:
                        await run_batch(backend, pool, [bench_item(i, warmup=True, seed=cfg.seed)
                                                          for i in range(cfg.warmup)], counts)
                    continue
                meter = Meter()
                first_batch_s, max_inflight, version, done = None, 0, 0, 0
                generated, reward_sum = 0, 0.0
                pool.latencies.clear()
                while done < cfg.episodes:
                    k = min(cfg.concurrency, cfg.episodes - done)
                    trajs = await run_batch(backend, pool, [bench_item(done + i, seed=cfg.seed)
                                                              for i in range(k)], counts)
                    generated += sum(int(t["loss_mask"].sum()) for t in trajs)
                    reward_sum += sum(float(t["rewards"].sum()) for t in trajs)
                    done += k
                    if first_batch_s is None:
                        first_batch_s = time.perf_counter() - meter.t0
                    max_inflight = max(max_inflight, backend.peak_in_progress)
                    version += 1
                    backend.set_version(version)
                    meter.sample(done)
                wall = time.perf_counter() - meter.t0
                latencies = pool.latencies
                measured = meter.result(wall_s=wall, episodes=cfg.episodes, generated_tokens=generated,
                                        max_inflight=max_inflight, keep_samples=False)
    return summary("naive", cfg, counts, measured, requests=recorded_requests(backend),
                   time_to_first_batch_s=rounded(first_batch_s), staleness_histogram={"0": counts["accepted"]},
                   reward_latency_p50_s=rounded(percentile(latencies, 0.5)),
                   reward_latency_p99_s=rounded(percentile(latencies, 0.99)), reward_workers=pool.max_workers,
                   reward_mean=rounded(reward_sum / max(1, counts["accepted"])),
                   token_pool_digest=pool_digest(backend.token_pool), backend=asdict(backend.statistics()))

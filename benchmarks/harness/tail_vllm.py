"""The tail scenario (:mod:`.tail_config`) on a real vLLM CPU server, in real time, beside
the sim at the same scale (``benchmarks/bench_tail_vllm.py``, issue 27).

Same trainer (:func:`.tail_run.train`: ``trio.sleep(train_step_s)`` per step, a version
bump after it), same prompts, workflow, engine settings and per-sample seeds as
:func:`.tail_run.run_policy`; the server is vLLM and the clock trio's own.  Each sample's
length is the sim's draw for ``(seed, prompt, sample)``, forced on the server by
:class:`.tail_vllm_backend.ForcedLengthVLLM` (``ignore_eos`` and ``min_tokens``: vLLM
decodes exactly that many tokens), so the two servers get the same work and differ only in
what it costs.

Scaling (the defaults of :func:`scaled_config`; :data:`TAIL_SIM` is the reference).  The
tiny model (2 layers, hidden 128, fp32) on this 2-core box, measured by :func:`calibrate` in
steady state at the start of the reference run (2026-12-02, quiet box): ~290 output tok/s
with one request in flight (3.4 ms per decode step), ~390 with 16, ~475 with 64 or 128, the
engine core running 1.0 sequence on average with 16 in flight and 13 with 64 (the rest wait
in the API server process, ~15 ms per request one after another).  Bursts of requests sent
at once had measured 1.7-4.8k tok/s at 16-64 on their fastest repeat and spread up to 11x.
So the CPU server is far from the sim's "nearly flat" step (x1.06 at 128): its throughput
stops growing by ~16 requests.  What is kept from the sim scenario, and how:

* **the server saturated by one step's work**: the sim runs ``K = 128 = B x G`` slots; here
  ``--max-num-seqs 64 = B x G`` with ``B = 8`` groups of ``G = 8`` (the knee of the
  measured throughput), and the sim at this scale gets ``max_running_seqs = 64``;
* **the length model**: ``difficulty_sigma``, ``out_len_sigma`` as fitted to Seer, with the
  median scaled 512 -> ``out_len_median`` (default 64) and the cap 6x it (3072 ->
  ``max_new_tokens``); prompts scaled likewise (64-512 -> 16-64 tokens; the tiny model's
  vocabulary is 259 ids, prompts use 3-255).  The probe and chunk budgets of
  ``length_aware`` and ``overprovision`` (256 at median 512) scale to half the median;
* **the trainer step comparable to a rollout step**: in the sim ``train_step_s = 10 s`` is
  0.54 of the server-bound generation time of a step (``B G`` mean-length samples on ``K``
  slots: 18.5 s); here it is the same fraction of the same quantity with the measured
  cost (:func:`scaled_config`);
* **the tail's share of a synchronous step**: 0.48 in the sim (Seer's "up to 50%"); with
  the CPU's cheaper lone sequences the same lengths give a smaller share, which the JSON
  reports (``tail_share`` of ``sync`` on both servers);
* **the sim fitted to the measured server** (:func:`fit_sim`): ``per_token_s`` = the
  measured step of a lone sequence, ``decode_slowdown_per_seq`` through the step at ``K``
  running sequences (the sim's step cost is a line; the CPU's is not quite one, the points
  between are in the JSON), ``prefill_s`` the latency of a lone one-token request, no KV
  limit (the server holds 1M tokens: nothing is preempted), the server's
  ``--scheduling-policy``, and the two costs a first reference run (2026-12-02) showed
  missing: on the CPU a request costs the API server and the scheduler ~10 ms *one after
  another* (``request_serial_s`` -> the sim's ``frontend_s_per_request``, a serial queue
  in front of the slots), and a resumed segment re-prefills its prompt and partial output
  (``prefill_s_per_token``); ``overprovision``'s chunks sent 3.2x the requests and 7.3x
  the prompt tokens of ``fcfs`` there.  Calibration points are medians of the repeats.

The client (engine, workflow, trainer) runs on the same 2 cores as the server: its CPU
time is part of what is measured, as on a real rollout node it would not be.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
import os
import statistics
from dataclasses import dataclass, replace
from typing import Any

import httpx
import trio

from engine import GenerationHyperparameters, open_rollout_engine
from engine.backends.sim import SimConfig
from engine.testing import InProcessRewardPool

from .tail_config import POLICIES, TAIL_SIM, TailConfig
from .tail_run import Observed, TailWorkflow, engine_config_for, train
from .tail_vllm_backend import ForcedLengthVLLM, ServerMetrics, forced_draw

__all__ = ["Calibration", "calibrate", "fit_sim", "observe_vllm", "policy_settings", "run_policy_vllm", "scaled_config"]

_CALIBRATION_IDS = itertools.count()

#: prompt tokens of :func:`calibrate`'s lone request (its default ``prompt_len``)
CALIBRATION_PROMPT_LEN = 32

#: the sim scenario's trainer step over its server-bound generation time per step (10 s / 18.5 s)
TRAIN_TO_GENERATION = 0.54


@dataclass(frozen=True)
class Calibration:
    """Decode step times measured on the server (seconds per step; one step = one token
    for each running sequence).

    Attributes:
        step_s: requests in flight -> seconds per decode step in steady state (``k`` over
            the server's output tokens per second; the median of the repeats).
        tokens_per_s: running sequences -> output tokens per second in all.
        request_s: latency of a lone one-token request (seconds).
        request_serial_s: seconds per request when many arrive at once (one-token requests:
            the API server's and scheduler's own cost, paid one request after another on the
            CPU; median of the repeats): the fitted sim's ``frontend_s_per_request``.
        prefill_s_per_token: seconds per extra prompt token of a lone one-token request
            (a long prompt's latency minus a short one's, over the difference in tokens).
        running_mean: requests in flight -> the server's mean running-requests gauge while
            they were (below ``k``: the rest were in the API server or queued).
        tokens: tokens per sequence in each measurement.
        repeats: measurements per point.
        load_avg: the 1-minute load average before and after.
        samples: running sequences -> every repeat's step time.
    """

    step_s: dict[int, float]
    tokens_per_s: dict[int, float]
    request_s: float
    tokens: int
    repeats: int
    load_avg: tuple[float, float]
    samples: dict[int, list[float]]
    request_serial_s: float | None = None
    prefill_s_per_token: float | None = None
    running_mean: dict[int, float] | None = None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


async def _completion(client: httpx.AsyncClient, url: str, prompt: list[int], tokens: int, model: str) -> int:
    body = {"model": model, "prompt": prompt, "max_tokens": tokens, "min_tokens": tokens, "ignore_eos": True,
            "request_id": f"calibration-{next(_CALIBRATION_IDS)}",
            "temperature": 1.0, "logprobs": 0, "return_token_ids": True, "return_tokens_as_token_ids": True}
    for attempt in range(3):  # uvicorn may close a kept-alive connection as it is reused: send again
        try:
            answer = await client.post(url + "/v1/completions", json=body, timeout=300)
            break
        except httpx.TransportError:
            if attempt == 2:
                raise
    answer.raise_for_status()
    return len(answer.json()["choices"][0]["token_ids"])


async def _burst(client: httpx.AsyncClient, url: str, k: int, tokens: int, prompt_len: int, r: int, model: str) -> float:
    """Seconds for ``k`` concurrent requests of ``tokens`` forced tokens each (prompts differ by ``r``)."""
    got: list[int] = []

    async def one(i: int) -> None:
        ids = [3 + (i * 31 + r * 7 + j) % 253 for j in range(prompt_len)]
        got.append(await _completion(client, url, ids, tokens, model))

    t0 = trio.current_time()
    async with trio.open_nursery() as nursery:
        for i in range(k):
            nursery.start_soon(one, i)
    if sum(got) != k * tokens:
        raise httpx.HTTPError(f"calibration: {sum(got)} tokens for {k} x {tokens} (ignore_eos not honoured?)")
    return trio.current_time() - t0


async def _steady(client: httpx.AsyncClient, url: str, k: int, tokens: int, prompt_len: int, model: str,
                  metrics: ServerMetrics, *, warmup_s: float, window_s: float) -> tuple[float, float]:
    """``(output tokens per second, mean running-requests gauge)`` of the server while ``k``
    clients each keep one request of ``tokens`` forced tokens in flight (a new one the moment
    the last answers): the server's own ``vllm:generation_tokens_total`` over ``window_s``
    seconds after ``warmup_s``; then the clients leave and the server drains (aborts landed)."""
    async def client_loop(i: int) -> None:
        n = 0
        while True:
            await _completion(client, url, [3 + (i * 31 + n * 7 + j) % 253 for j in range(prompt_len)], tokens, model)
            n += 1

    running: list[float] = []
    async with trio.open_nursery() as nursery:
        for i in range(k):
            nursery.start_soon(client_loop, i)
        await trio.sleep(warmup_s)
        first = await metrics.read(client)
        last = first
        while last.t_s - first.t_s < window_s:
            await trio.sleep(min(metrics.interval_s, max(first.t_s + window_s - trio.current_time(), 0.0)))
            last = await metrics.read(client)
            running.append(last.running)
        nursery.cancel_scope.cancel()
    await metrics.wait_idle(client)
    return (last.generation_tokens - first.generation_tokens) / (last.t_s - first.t_s), sum(running) / len(running)


async def calibrate(url: str, *, seqs: tuple[int, ...] = (1, 16, 64, 128), tokens: int = 64, repeats: int = 2,
                    prompt_len: int = CALIBRATION_PROMPT_LEN, long_prompt_len: int = 512, model: str = "tiny",
                    warmup_s: float = 2.0, window_s: float = 6.0,
                    transport: httpx.AsyncBaseTransport | None = None) -> Calibration:
    """Measure the server's decode cost at each of ``seqs`` requests in flight, in steady
    state (:func:`_steady`: ``k`` clients each keep one ``ignore_eos`` request of ``tokens``
    tokens in flight for ``window_s`` seconds after ``warmup_s``; the step time at ``k`` is
    ``k`` over the tokens per second the server counted, so admission, prefill and the API
    server's own work are in it, as in a run), ``repeats`` times; a lone one-token request's
    latency; the serial cost of a request (``max(seqs)`` one-token requests at once: wall
    time / count); the prefill cost of a prompt token (lone one-token requests with
    ``long_prompt_len`` and with ``prompt_len`` tokens).  Medians of the repeats.  (A first
    version timed bursts of ``k`` requests sent at once: their ramp and drain spread the
    repeats up to 11x at 64 sequences.)

    Raises:
        httpx.HTTPError: the server failed a request (or answered another token count).
    """
    load0 = os.getloadavg()[0]
    samples: dict[int, list[float]] = {k: [] for k in seqs}
    running: dict[int, list[float]] = {k: [] for k in seqs}
    metrics = ServerMetrics(url, interval_s=0.5)
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=None), transport=transport) as client:
        prompt = [3 + (i * 37) % 253 for i in range(prompt_len)]
        await _completion(client, url, prompt, 8, model)  # warm-up
        lone, lone_long = [], []
        for r in range(repeats):
            t0 = trio.current_time()
            await _completion(client, url, prompt, 1, model)
            lone.append(trio.current_time() - t0)
            long_prompt = [3 + (i * 41 + r * 13) % 253 for i in range(long_prompt_len)]  # no cached prefix
            t0 = trio.current_time()
            await _completion(client, url, long_prompt, 1, model)
            lone_long.append(trio.current_time() - t0)
        for _ in range(repeats):
            for k in seqs:
                rate, gauge = await _steady(client, url, k, tokens, prompt_len, model, metrics,
                                            warmup_s=warmup_s, window_s=window_s)
                samples[k].append(k / rate if rate > 0 else math.inf)
                running[k].append(gauge)
        burst = max(seqs)  # that many one-token requests at once: the server's serial cost per request
        serial = [await _burst(client, url, burst, 1, prompt_len, r, model) / burst for r in range(repeats)]
    step = {k: statistics.median(v) for k, v in samples.items()}
    per_prompt_token = (statistics.median(lone_long) - statistics.median(lone)) / max(long_prompt_len - prompt_len, 1)
    return Calibration(step_s={k: round(v, 6) for k, v in step.items()},
                       tokens_per_s={k: round(k / v, 1) for k, v in step.items()},
                       request_s=round(statistics.median(lone), 6), request_serial_s=round(statistics.median(serial), 6),
                       prefill_s_per_token=round(max(per_prompt_token, 0.0), 8), tokens=tokens, repeats=repeats,
                       load_avg=(round(load0, 2), round(os.getloadavg()[0], 2)),
                       samples={k: [round(x, 6) for x in v] for k, v in samples.items()},
                       running_mean={k: round(statistics.median(v), 2) for k, v in running.items()})


def fit_sim(cal: Calibration, *, max_running_seqs: int, base: SimConfig, scheduling_policy: str = "priority") -> SimConfig:
    """The sim fitted to ``cal`` (module docstring): the sim's line ``step(k) = a (1 + s (k -
    1))`` through the two regimes that set a step's time, the lone sequence (the tail: ``a =
    step(1)``) and the full server (``k = max_running_seqs``, or the largest measured ``k``
    below it: ``s = (step(k) / a - 1) / (k - 1)``); the points between are the check of the
    line (the JSON has them).  ``frontend_s_per_request`` = ``request_serial_s`` (the API
    server's serial cost per request: what a policy that sends many segments pays on vLLM);
    ``prefill_s_per_token`` as measured; ``prefill_s`` = the lone one-token request's latency
    minus one step, its front end and its prompt's prefill; no KV limit.  The length model and
    seed stay ``base``'s.

    Raises:
        ValueError: no measurement at 1 sequence, or none at 2 to ``max_running_seqs``.
    """
    points = sorted((k, s) for k, s in cal.step_s.items() if 1 < k <= max_running_seqs)
    if 1 not in cal.step_s or not points:
        raise ValueError(f"fit_sim needs step times at 1 and at 2 to {max_running_seqs} running sequences, "
                         f"got {sorted(cal.step_s)}")
    a = cal.step_s[1]
    serial = cal.request_serial_s or 0.0
    per_prompt_token = cal.prefill_s_per_token or 0.0
    k, step_k = points[-1]
    slowdown = max(step_k / a - 1.0, 0.0) / (k - 1)
    prefill = cal.request_s - a - serial - CALIBRATION_PROMPT_LEN * per_prompt_token
    return replace(base, per_token_s=round(a, 6), decode_slowdown_per_seq=round(slowdown, 6),
                   prefill_s=round(max(prefill, 0.0), 6), prefill_s_per_token=round(per_prompt_token, 8),
                   frontend_s_per_request=round(serial, 6), max_running_seqs=max_running_seqs, kv_token_budget=None,
                   scheduling_policy=scheduling_policy)


def scaled_config(sim: SimConfig, *, out_len_median: int = 64, cap_ratio: float = 6.0, groups_per_step: int = 8,
                  group_size: int = 8, steps: int = 12, cooldown_steps: int = 4, eta: int = 1,
                  train_step_s: float | None = None, seed: int = 0) -> TailConfig:
    """The scaled scenario (module docstring) on the fitted ``sim`` (:func:`fit_sim`):
    :data:`TAIL_SIM`'s length model with median ``out_len_median`` and cap ``cap_ratio``
    times it, prompts of 1/4 to 1 median (at most 255 distinct ids: 3-255), ``K = B x G``,
    and ``train_step_s`` (default) :data:`TRAIN_TO_GENERATION` of the server-bound
    generation time of a step at the fitted cost (``B G E[len] step(K) / K``, ``E[len] =
    median exp((sigma_d^2 + sigma^2) / 2)``, uncapped)."""
    k = groups_per_step * group_size
    sim = replace(sim, out_len_median=out_len_median, out_len_sigma=TAIL_SIM.out_len_sigma,
                  difficulty_sigma=TAIL_SIM.difficulty_sigma, draws_by_prompt=True, seed=seed, vocab_size=256,
                  first_token_id=3, eos_token_id=2, max_running_seqs=k)
    if train_step_s is None:
        mean_len = out_len_median * math.exp((sim.difficulty_sigma ** 2 + sim.out_len_sigma ** 2) / 2)
        step_k = sim.per_token_s * (1 + sim.decode_slowdown_per_seq * (k - 1))
        train_step_s = round(TRAIN_TO_GENERATION * groups_per_step * group_size * mean_len * step_k / k, 3)
    return TailConfig(steps=steps, cooldown_steps=cooldown_steps, groups_per_step=groups_per_step,
                      group_size=group_size, train_step_s=train_step_s, max_head_offpolicyness=eta,
                      max_new_tokens=round(cap_ratio * out_len_median), prompt_len_min=max(1, out_len_median // 4),
                      prompt_len_max=out_len_median, max_concurrent_rollouts=1024, sim=sim)


def policy_settings(cfg: TailConfig) -> dict[str, dict[str, Any]]:
    """Per policy, the :class:`EngineConfig` settings scaled with the lengths: the probe of
    ``length_aware`` and the chunk of ``overprovision`` at half the median (256 at 512)."""
    half = max(1, cfg.sim.out_len_median // 2)
    return {"overprovision": {"overprovision_chunk_tokens": half}, "length_aware": {"length_aware_probe_tokens": half},
            "tail_batching": {"overprovision_chunk_tokens": half}}


async def _reset(client: httpx.AsyncClient, url: str) -> None:
    """Drop the server's prefix cache (every policy gets the same prompts: the first one
    must not warm the next one's prefills); dev mode."""
    answer = await client.post(url + "/reset_prefix_cache", timeout=30)
    answer.raise_for_status()


def run_policy_vllm(cfg: TailConfig, policy: str, url: str, settings: dict[str, Any] | None = None, *,
                    poll_interval_s: float = 0.25) -> Observed:
    """Run ``policy`` on ``cfg`` against the vLLM server at ``url`` in real time (module
    docstring): :func:`observe_vllm` under ``trio.run``, with the engine's log at ERROR
    (the step policies' "prepare_batch has waited" lines are their ordinary waits).

    Raises:
        PolicyUnavailable: this engine lacks the policy's settings.
        ValueError: the run ended before ``cfg.steps`` batches.
        BackendError, httpx.HTTPError: the server failed.
    """
    engine_log = logging.getLogger("rollout")
    level = engine_log.level
    engine_log.setLevel(logging.ERROR)
    try:
        return trio.run(lambda: observe_vllm(cfg, policy, url, settings, poll_interval_s=poll_interval_s))
    finally:
        engine_log.setLevel(level)


async def observe_vllm(cfg: TailConfig, policy: str, url: str, settings: dict[str, Any] | None = None, *,
                       poll_interval_s: float = 0.25, transport: httpx.AsyncBaseTransport | None = None,
                       idle_timeout_s: float = 30.0) -> Observed:
    """:func:`run_policy_vllm`'s run, on the current trio clock: its observations, as
    :func:`.tail_run.run_policy`'s, with the server's counters in ``obs.engine["server"]``
    (``unreturned_tokens``: decoded but never answered, their split over prompts estimated;
    ``running_mean``/``waiting_mean``: the server's gauges over the window,
    ``client_in_flight_mean``: the requests the client had outstanding then).  Before the
    run the server's prefix cache is dropped and it is idle; after it, the run waits (at
    most ``idle_timeout_s``) until the server is idle again, so the aborts have landed.
    ``transport``: for the backend and the metrics reads (tests: ``httpx.MockTransport``).

    Raises:
        PolicyUnavailable: this engine lacks the policy's settings.
        ValueError: the run ended before ``cfg.steps`` batches.
        BackendError, httpx.HTTPError: the server failed.
    """
    config = engine_config_for(cfg, policy, settings)
    obs = Observed(policy, settings=dict(settings or {}))
    backend = ForcedLengthVLLM([url], sim=cfg.sim, transport=transport)
    metrics = ServerMetrics(url, interval_s=poll_interval_s)
    gconfig = GenerationHyperparameters(max_new_tokens=cfg.max_new_tokens,
                                        max_tokens=cfg.prompt_len_max + cfg.max_new_tokens)
    workflow = TailWorkflow(gconfig, cfg.sim.seed, backend.prompt_of)
    items = [{"index": i, "input_ids": cfg.prompt(i)} for i in range(cfg.prompts)]
    async with httpx.AsyncClient(transport=transport) as client:
        await _reset(client, url)
        before = await metrics.wait_idle(client, timeout_s=idle_timeout_s)
        start = trio.current_time()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(metrics.poll, client, lambda: backend.requests_running)
            async with open_rollout_engine(backend, config, reward_pool=InProcessRewardPool()) as engine:
                await train(cfg, engine, workflow, items, obs, lambda: metrics.busy_slot_s(start, trio.current_time()),
                            sync=POLICIES[policy] is None)
                stats = engine.statistics()
                backend.closing = True
            nursery.cancel_scope.cancel()
        after = await metrics.wait_idle(client, timeout_s=idle_timeout_s)
    if math.isnan(obs.window_s):
        raise ValueError(f"{policy}: the run ended after {len(obs.batches)} batches, before the {cfg.steps} "
                         "measured steps (raise cooldown_steps)")
    decoded = int(after.generation_tokens - before.generation_tokens)
    unreturned = decoded - backend.returned_tokens
    attributed = backend.attribute_unreturned(unreturned)
    obs.times = workflow.times
    obs.population = [(i, forced_draw(cfg.sim, r.input_ids, r.gconfig.seed, r.validate()).n)  # type: ignore[arg-type]
                      for (i, _), r in sorted(workflow.started.items())]
    obs.decoded_tokens = decoded
    obs.decoded_by_prompt = dict(backend.decoded)
    for prompt, n in attributed.items():
        obs.decoded_by_prompt[prompt] = obs.decoded_by_prompt.get(prompt, 0) + n
    obs.undecided = {w.prompt for w in backend.withdrawn if w.at_close and w.prompt is not None}
    obs.preemptions = int(after.preemptions - before.preemptions)
    window_end = start + obs.window_s
    obs.engine = {"submitted": stats.submitted, "queued": stats.queued, "running": stats.running,
                  "accepted": stats.accepted, "rejected": stats.rejected,
                  "failed": stats.failed, "rejected_by_reason": dict(stats.rejected_by_reason),
                  "failed_by_reason": dict(stats.failed_by_reason), "segments_resumed": stats.segments_resumed,
                  "requests_aborted": len(backend.withdrawn), "peak_kv_tokens": None,
                  "server": {"returned_tokens": backend.returned_tokens, "unreturned_tokens": unreturned,
                             "unreturned_attributed": sum(attributed.values()),
                             "prompt_tokens": int(after.prompt_tokens - before.prompt_tokens),
                             "segments_answered": len(backend.forced_segments),
                             "running_mean": _r(metrics.mean("running", start, window_end)),
                             "waiting_mean": _r(metrics.mean("waiting", start, window_end)),
                             "client_in_flight_mean": _r(metrics.mean("client", start, window_end)),
                             "metrics_samples": len(metrics.samples)}}
    return obs


def _r(x: float | None) -> float | None:
    return None if x is None else round(x, 3)

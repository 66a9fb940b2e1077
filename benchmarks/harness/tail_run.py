"""One policy's run of the tail scenario (:mod:`.tail_config`), in virtual time.

:func:`run_policy` opens a :class:`~engine.backends.sim.SimBackend` and an engine with
the policy's settings, drives a simulated trainer (:class:`TailConfig`'s steps) on trio's
:class:`~trio.testing.MockClock` with ``autojump_threshold=0`` (time jumps to the next
event whenever every task waits: a run takes CPU seconds, however many virtual hours it
spans) and returns its raw observations (:class:`Observed`); :mod:`.tail_metrics` turns
them into the reported numbers.

Same work for every policy: prompt ``i`` is :meth:`TailConfig.prompt`, and sample ``j``
of it carries ``gconfig.seed = derive_seed(seed, i, j, 0)``, so its length (the sim's
draw, :func:`engine.backends.sim._draws.request_seed_rng`) depends on ``(seed, i, j)``
only, whatever the schedule.  Trio shuffles tasks made runnable at the same moment with
an RNG of its own, and wakes the waiters of a ``trio.Event`` in the order of a set (by
memory address: different in each process); :func:`run_policy` seeds the RNG and turns
on trio's deterministic scheduling (runnable tasks sorted by creation, then shuffled) for
the run, and restores both after (private attributes, ``trio._core._run._r`` and
``_ALLOW_DETERMINISTIC_SCHEDULING``; where they are missing the run is still correct,
only not bit-for-bit repeatable).
"""

from __future__ import annotations

import collections
import dataclasses
import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import trio
import trio.testing

from engine import EngineConfig, GenerationHyperparameters, ModelRequest, SimBackend, open_rollout_engine
from engine.context import sample_index
from engine.errors import DataExhaustedError
from engine.testing import InProcessRewardPool
from engine.trajectory import Injected, Sampled, build_trajectory
from engine.types import derive_seed
from workflows import RolloutWorkflow

from .tail_config import POLICIES, TailConfig

__all__ = ["Observed", "PolicyUnavailable", "StepRecord", "TailWorkflow", "engine_config_for", "run_policy", "train"]


class PolicyUnavailable(Exception):
    """This engine has no setting the policy needs (e.g. ``EngineConfig.scheduling``)."""


@dataclass(frozen=True)
class StepRecord:
    """One batch the trainer consumed.

    Attributes:
        step: 0-based; the policy version the trainer was at when it took the batch.
        wait_s: seconds the trainer waited for it (virtual).
        taken_at_s: when it got it (seconds since the run started).
        rows: ``(prompt index, sample index, response tokens, oldest token's version)`` per row.
    """

    step: int
    wait_s: float
    taken_at_s: float
    rows: list[tuple[int, int, int, int]]


@dataclass
class Observed:
    """What one policy's run produced (times in virtual seconds since its start).

    Attributes:
        window_s: time at the end of the ``steps``-th training step (the measured window).
        busy_slot_s: server slot-seconds held within the window.
        batches: every batch consumed (the window and the cool-down).
        times: ``(prompt, sample) -> (generation start, end)`` of every finished sample.
        population: ``(prompt, drawn length)`` of every sample whose generation started,
            once per sample (tokens, capped at ``max_new_tokens``; :meth:`SimBackend.draw`
            of its first request: the length it has however it is cut into segments or re-run).
        decoded_tokens: tokens the server decoded in all (returned or lost).
        decoded_by_prompt: of those, per prompt index (segments returned, and the tokens of
            withdrawn requests: cut, cancelled, or still running when the run closed).
        undecided: prompts with a request still running (withdrawn) when the run closed.
        preemptions: sequences the server preempted for KV room.
        window_rejected: episodes (groups) rejected within the window (stale ones, mostly).
        engine: the engine's statistics at the end, as a dict.
    """

    policy: str
    settings: dict[str, Any] = field(default_factory=dict)
    window_s: float = math.nan
    busy_slot_s: float = math.nan
    batches: list[StepRecord] = field(default_factory=list)
    times: dict[tuple[int, int], tuple[float, float]] = field(default_factory=dict)
    population: list[tuple[int, int]] = field(default_factory=list)
    decoded_tokens: int = 0
    decoded_by_prompt: dict[int, int] = field(default_factory=dict)
    undecided: set[int] = field(default_factory=set)
    preemptions: int = 0
    window_rejected: int = 0
    engine: dict[str, Any] = field(default_factory=dict)


class _CountingSim(SimBackend):
    """The scenario's server: the sim, counting the tokens it decodes for each prompt
    (:attr:`prompt_of` maps a request id to its prompt; the workflow fills it)."""

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        self.prompt_of: dict[str, int] = {}
        self.decoded: collections.Counter[int] = collections.Counter()
        self.closing = False  # set when the trainer is done: what is withdrawn from then on was in flight
        self.withdrawn_at_close: set[int] = set()

    async def _generate(self, request: ModelRequest, budget: int) -> Any:
        resp = await super()._generate(request, budget)
        index = self.prompt_of.get(request.rid)
        if index is not None:
            self.decoded[index] += resp.output_len
        return resp

    def discarded(self, rid: str, tokens: int) -> None:
        super().discarded(rid, tokens)
        index = self.prompt_of.get(rid)
        if index is not None:
            self.decoded[index] += tokens
            if self.closing:
                self.withdrawn_at_close.add(index)


class TailWorkflow(RolloutWorkflow):
    """One generation per episode (no reward: the scenario measures scheduling).

    The trajectory carries ``prompt_index [1] int32`` and ``sample_index [1] int32``;
    :attr:`times` gets each sample's generation start and end (virtual seconds),
    :attr:`started` each sample's first request (a re-run sends the same one), and
    ``prompt_of`` (when given) each request id's prompt index."""

    def __init__(self, gconfig: GenerationHyperparameters, seed: int, prompt_of: dict[str, int] | None = None) -> None:
        self.gconfig = gconfig
        self.seed = seed
        self.times: dict[tuple[int, int], tuple[float, float]] = {}
        self.started: dict[tuple[int, int], ModelRequest] = {}
        self.prompt_of = {} if prompt_of is None else prompt_of

    async def arun_episode(self, engine: Any, data: dict[str, Any]) -> Any:
        index, sample = int(data["index"]), sample_index.get()
        start = trio.current_time()
        gconfig = self.gconfig.new(seed=derive_seed(self.seed, index, sample, 0))
        request = ModelRequest(input_ids=data["input_ids"], gconfig=gconfig)
        self.started.setdefault((index, sample), request)
        self.prompt_of[request.rid] = index
        resp = await engine.agenerate(request)
        first = self.times.get((index, sample), (start, start))[0]  # a re-run keeps the first start
        self.times[(index, sample)] = (first, trio.current_time())
        return build_trajectory([Injected(resp.input_tokens), Sampled(resp, 0)], 0.0,
                                extra={"prompt_index": index, "sample_index": sample})


def engine_config_for(cfg: TailConfig, policy: str, settings: dict[str, Any] | None = None) -> EngineConfig:
    """The :class:`EngineConfig` of ``policy`` (a :data:`POLICIES` row), with ``settings``
    (more ``EngineConfig`` fields, e.g. a sweep's ``overprovision_ratio``) over the row's.

    Raises:
        PolicyUnavailable: the row names a setting this engine lacks (``scheduling="fcfs"``
            on an engine without the setting is today's behaviour and is dropped).
        ValueError: ``settings`` for ``sync`` (no engine setting), or a bad value
            (:class:`EngineConfig`'s own error, naming the field).
    """
    kwargs = POLICIES[policy]
    if kwargs is None:  # sync: one batch at a time, nothing runs ahead, nothing is stale
        if settings:
            raise ValueError(f"sync takes no engine settings, got {sorted(settings)}")
        return EngineConfig(consumer_batch_size=cfg.groups_per_step, max_concurrent_rollouts=cfg.groups_per_step)
    kwargs = {**kwargs, **(settings or {})}
    names = {f.name for f in dataclasses.fields(EngineConfig)}
    if "scheduling" not in names and kwargs.get("scheduling") == "fcfs":
        kwargs.pop("scheduling")
    missing = sorted(set(kwargs) - names)
    if missing:
        raise PolicyUnavailable(f"EngineConfig has no field(s) {missing}")
    return EngineConfig(consumer_batch_size=cfg.groups_per_step, max_head_offpolicyness=cfg.max_head_offpolicyness,
                        max_concurrent_rollouts=cfg.max_concurrent_rollouts, **kwargs)


@contextmanager
def _seeded_trio_scheduler(seed: int) -> Iterator[None]:
    run: Any = getattr(getattr(trio, "_core", None), "_run", None)
    rng = getattr(run, "_r", None)
    if rng is None or not hasattr(run, "_ALLOW_DETERMINISTIC_SCHEDULING"):  # pragma: no cover - another trio
        yield  # layout: correct, not repeatable
        return
    state, deterministic = rng.getstate(), run._ALLOW_DETERMINISTIC_SCHEDULING
    rng.seed(f"bench-tail:{seed}")
    # trio's own switch (the one its Hypothesis plugin sets): each batch of runnable tasks is
    # sorted by creation before the seeded shuffle, so an order that comes from a set of tasks
    # (trio.Event wakes its waiters in set order, i.e. by address) does not reach the schedule
    run._ALLOW_DETERMINISTIC_SCHEDULING = True
    try:
        yield
    finally:
        rng.setstate(state)
        run._ALLOW_DETERMINISTIC_SCHEDULING = deterministic


def _rows(batch: Any) -> list[tuple[int, int, int, int]]:
    if batch is None or batch.batch_size[0] == 0:
        return []
    mask = batch["loss_mask"].bool()
    lengths = mask.sum(1).tolist()
    oldest = batch["versions"].masked_fill(~mask, 2**31 - 1).min(1).values.tolist()
    return list(zip(batch["prompt_index"].tolist(), batch["sample_index"].tolist(), lengths, oldest))


async def train(cfg: TailConfig, engine: Any, workflow: TailWorkflow, items: list[dict[str, Any]],
                obs: Observed, busy_slot_s: Callable[[], float], sync: bool) -> None:
    """The simulated trainer on ``engine`` (any clock): ``cfg.steps + cfg.cooldown_steps``
    batches of ``items`` (``sync``: :meth:`rollout_batch` of the next ``B`` items; else
    :meth:`prepare_batch` on one pass over them), a ``trio.sleep(cfg.train_step_s)`` and a
    version bump after each, recorded in ``obs``; at the end of the ``cfg.steps``-th step
    ``obs.window_s`` is set and ``obs.busy_slot_s = busy_slot_s()`` (the server's
    slot-seconds so far)."""
    t0 = trio.current_time()
    B, G = cfg.groups_per_step, cfg.group_size
    stream = iter(items)  # one pass: prepare_batch drains it, then raises DataExhaustedError
    step = 0
    while True:
        start = trio.current_time()
        if sync:
            chunk = items[step * B:(step + 1) * B]
            if not chunk:
                break
            batch = await engine.rollout_batch(chunk, workflow, group_size=G)
        else:
            try:
                batch = await engine.prepare_batch(stream, workflow, group_size=G)
            except DataExhaustedError:
                break
        now = trio.current_time()
        obs.batches.append(StepRecord(step, now - start, now - t0, _rows(batch)))
        await trio.sleep(cfg.train_step_s)  # the training step
        step += 1
        engine.set_version(step)
        if step == cfg.steps:
            obs.window_s = trio.current_time() - t0
            obs.busy_slot_s = busy_slot_s()
            obs.window_rejected = engine.statistics().rejected


def run_policy(cfg: TailConfig, policy: str, settings: dict[str, Any] | None = None) -> Observed:
    """Run ``policy`` (a :data:`POLICIES` name, with ``settings`` over its row:
    :func:`engine_config_for`) on ``cfg`` in virtual time; returns its observations
    (deterministic for a given ``cfg``, see the module docstring).

    Raises:
        PolicyUnavailable: this engine lacks the policy's settings.
        ValueError: the run ended before ``cfg.steps`` batches (too few prompts).
    """
    config = engine_config_for(cfg, policy, settings)
    obs = Observed(policy, settings=dict(settings or {}))

    async def main() -> None:
        backend = _CountingSim(cfg.sim)
        gconfig = GenerationHyperparameters(max_new_tokens=cfg.max_new_tokens,
                                            max_tokens=cfg.prompt_len_max + cfg.max_new_tokens)
        workflow = TailWorkflow(gconfig, cfg.sim.seed, backend.prompt_of)
        items = [{"index": i, "input_ids": cfg.prompt(i)} for i in range(cfg.prompts)]
        async with open_rollout_engine(backend, config, reward_pool=InProcessRewardPool()) as engine:
            await train(cfg, engine, workflow, items, obs, lambda: backend.statistics().busy_slot_s,
                        sync=POLICIES[policy] is None)
            stats = engine.statistics()
            backend.closing = True
        sim = backend.statistics()  # after close: what closing withdrew counts as lost
        obs.times = workflow.times
        obs.population = [(i, backend.draw(r.input_ids, r.validate(), gconfig_seed=r.gconfig.seed).n)
                          for (i, _), r in sorted(workflow.started.items())]
        obs.decoded_tokens = sim.tokens_generated + sim.tokens_discarded
        obs.decoded_by_prompt = dict(backend.decoded)
        obs.undecided = set(backend.withdrawn_at_close)
        obs.preemptions = sim.preemptions
        obs.engine = {"accepted": stats.accepted, "rejected": stats.rejected, "failed": stats.failed,
                      "rejected_by_reason": dict(stats.rejected_by_reason),
                      "failed_by_reason": dict(stats.failed_by_reason), "segments_resumed": stats.segments_resumed,
                      "requests_aborted": sim.requests_aborted, "peak_kv_tokens": sim.peak_kv_tokens}

    with _seeded_trio_scheduler(cfg.sim.seed):
        trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    if math.isnan(obs.window_s):
        raise ValueError(f"{policy}: the run ended after {len(obs.batches)} batches, before the {cfg.steps} "
                         "measured steps (raise cooldown_steps)")
    return obs

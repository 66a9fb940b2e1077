"""``EngineConfig``: the engine's settings, frozen and validated in one place."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from rewards import RewardPoolOptions

__all__ = ["EngineConfig", "SCHEDULING_POLICIES", "STALENESS_POLICIES"]

STALENESS_POLICIES = ("drop", "flag")
#: ``EngineConfig.scheduling``: the policies of :mod:`engine._scheduling` (docs/guide/scheduling.md)
SCHEDULING_POLICIES = ("fcfs", "length_aware", "overprovision", "tail_batching")
REWARD_BACKENDS = ("local", "ray")
_REWARD_DEFAULTS = RewardPoolOptions()  # the reward_* fields' defaults: the pool's own


@dataclass(frozen=True, kw_only=True)
class EngineConfig:
    """Engine settings (units in the names); validated on construction.

    Attributes:
        max_concurrent_rollouts: episodes running at once (AReaL's ``C``).
        consumer_batch_size: episodes per training batch (AReaL's ``B``); the
            batch size of :meth:`RolloutEngine.prepare_batch`.
        max_head_offpolicyness: AReaL's ``eta``: how many versions generation
            may run ahead of training; ``None`` disables the staleness bound.
        buffer_capacity: trajectories the result buffer holds before finished
            episodes wait to deposit (``None``: ``max(1024, 4 * C)``).
        staleness_policy: for a trajectory whose oldest generated token is more
            than ``eta`` versions behind the current version: ``"drop"`` (the
            episode is rejected, reason ``"stale"``) or ``"flag"`` (kept, with
            ``is_stale [B] bool`` set).  Checked on deposit and on each
            ``set_version``.
        drop_incomplete_group: reject a group with any rejected or failed member
            (reason ``"incomplete_group"``).
        reward_normalization: z-score ``rewards`` within a complete group
            (population std + 1e-8, AReaL) and keep raw values as ``original_rewards``.
        should_accept_timeout_s: deadline of ``should_accept_fn`` (seconds).
        episode_timeout_s: a whole episode's deadline (seconds, from admission to its
            result, the filter included; not the wait for room in the result buffer):
            past it the episode is cancelled (its generation requests withdrawn, its
            reward jobs killed) and fails with reason ``"episode_timeout"``
            (:class:`~engine.errors.EpisodeTimeoutError`).  ``None`` (the default): no
            whole-episode deadline, since every wait inside one already has its own
            (the backend's request and no-server deadlines, the reward timeout and
            retries, the filter's, a proxy session's idle timeout) and a fixed default
            would cut legitimately long agentic episodes; set it to budget episodes.
        dump_dir: when set, every accepted trajectory is also written as a JSONL
            record under ``dump_dir/<version>/`` (:mod:`engine.dump`).
        reward_timeout_seconds, reward_max_retries, reward_max_workers,
        reward_worker_type, reward_batch_size, reward_max_batch_delay_s: the
            reward pool's policy and micro-batching: the fields of
            :class:`rewards.RewardPoolOptions` (its defaults and validation;
            :attr:`reward_options` gathers them), see :func:`rewards.open_reward_pool`.
            Batching is on by default and adapts to the load: a reward that finds
            a worker free runs at once, alone; under load a worker job takes what
            waits (at most ``reward_batch_size``, and ~20 ms of measured reward
            work, so slow rewards run alone); ``reward_batch_size=1`` turns it off.
        reward_backend: ``"local"`` (worker processes of this machine) or ``"ray"``
            (Ray actors, :func:`rewards.open_ray_reward_pool`; needs the
            ``ray`` extra; ``reward_worker_type`` is then unused).
        reward_ray_address: the Ray cluster of ``reward_backend="ray"``; None: the
            Ray this process already initialised, else a local one.
        failure_breaker_consecutive, failure_breaker_window, failure_breaker_rate:
            bounded failure (:mod:`engine._breaker`): stop refilling
            :meth:`RolloutEngine.prepare_batch`'s pipeline, and make it raise
            :class:`~engine.errors.EpisodeFailuresError`, after this many failed
            episodes in a row, or when at least ``failure_breaker_rate`` of the last
            ``failure_breaker_window`` ended episodes failed (``None`` disables a rule).
            Rejections and cancellations are not failures.
        gc_tuning: opt-in (the GC is process-wide): while the engine is open,
            freeze the objects alive at open (``gc.freeze``, only if the host froze
            nothing) and raise the young generation's threshold to 10000; the
            host's previous state is restored exactly at close (:mod:`engine._gc`;
            -25% to -30% CPU per episode at zero latency, ``make bench``'s ``ours_gc``
            row).  ``rollout run`` turns it on; the benchmarks report it as a separate side.
        scheduling: how episodes and their generation segments are scheduled
            (:mod:`engine._scheduling`, docs/guide/scheduling.md): ``"fcfs"`` (the
            default: first come, first served, as AReaL), ``"overprovision"`` (APRIL,
            arXiv 2509.18521), ``"length_aware"`` (Seer's context-aware scheduling, arXiv
            2511.14617, without its KV pool) or ``"tail_batching"`` (RollPacker, arXiv
            2509.21009).  ``"overprovision"`` and ``"tail_batching"`` shape
            ``prepare_batch``'s pipeline only, and biases the trained data towards short
            answers (overprovision) or reorders it (tail batching): read the guide first.
        overprovision_ratio: ``r`` of ``"overprovision"`` and ``"tail_batching"`` (>0):
            each step runs ``ceil((1 + r) * B)`` groups and hands out the first ``B``
            complete ones; the staleness capacity grows by ``ceil((1 + r) * B) - B``
            episodes (what is trained on is still checked against
            ``max_head_offpolicyness``).  APRIL's over-sampling is typically 0.2-1.0.
        overprovision_chunk_tokens: ``"overprovision"`` sends each generation segment of
            its episodes with at most this many new tokens (tokens, >= 1), so that a cut
            takes effect at the next chunk boundary (each chunk re-sends prompt + partial
            output: a prefill, cheap with a prefix cache); ``None``: no chunks, a cut
            episode finishes the segment in flight first.
        length_aware_probe_tokens: ``"length_aware"``: the new-token budget of a group's
            probe segment (tokens, >= 1): its siblings wait for it, then go with a
            priority from its length (its full budget if it did not finish).
        scheduling_max_segments: at most this many generation segments are in flight at
            once (>= 1); waiting ones are sent lowest ``priority`` first (arrival order
            among equals: all of them under ``"fcfs"``).  It is the admission order for
            backends without server priorities (``hf``), and it keeps what the server
            cannot run yet in the engine, unsent: a segment's tokens carry the version at
            which it is sent, so a server queue makes them look older than they are (set
            it to the server's running-sequence limit, e.g. vLLM's ``--max-num-seqs``);
            ``"server"``: that limit as the backend reads it once it is open, summed over
            its servers (:meth:`~engine.backends.base.InferenceBackend.running_sequence_limit`;
            unknown: no bound, and one INFO line says so); ``None`` (the default): no
            engine-side bound.
    """

    max_concurrent_rollouts: int = 256
    consumer_batch_size: int = 1
    max_head_offpolicyness: int | None = None
    buffer_capacity: int | None = None
    staleness_policy: str = "drop"
    drop_incomplete_group: bool = False
    reward_normalization: bool = False
    should_accept_timeout_s: float = 30.0
    episode_timeout_s: float | None = None
    dump_dir: str | None = None
    reward_timeout_seconds: float = _REWARD_DEFAULTS.timeout_seconds
    reward_max_retries: int = _REWARD_DEFAULTS.max_retries
    reward_max_workers: int | None = _REWARD_DEFAULTS.max_workers
    reward_worker_type: str = _REWARD_DEFAULTS.worker_type
    reward_batch_size: int = _REWARD_DEFAULTS.batch_size
    reward_max_batch_delay_s: float = _REWARD_DEFAULTS.max_batch_delay_s
    reward_backend: str = "local"
    reward_ray_address: str | None = None
    gc_tuning: bool = False
    failure_breaker_consecutive: int | None = 32
    failure_breaker_window: int = 256
    failure_breaker_rate: float | None = 0.9
    scheduling: str = "fcfs"
    overprovision_ratio: float = 0.5
    overprovision_chunk_tokens: int | None = 256
    length_aware_probe_tokens: int = 256
    scheduling_max_segments: int | Literal["server"] | None = None

    def __post_init__(self) -> None:
        for name in ("max_concurrent_rollouts", "consumer_batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_head_offpolicyness is not None and self.max_head_offpolicyness < 0:
            raise ValueError(f"max_head_offpolicyness must be >= 0 or None, got {self.max_head_offpolicyness}")
        if self.buffer_capacity is not None and self.buffer_capacity < 1:
            raise ValueError(f"buffer_capacity must be >= 1 trajectory, got {self.buffer_capacity}")
        if self.staleness_policy not in STALENESS_POLICIES:
            raise ValueError(f"staleness_policy must be one of {STALENESS_POLICIES}, got {self.staleness_policy!r}")
        value = self.should_accept_timeout_s
        if not (isinstance(value, (int, float)) and value > 0 and not math.isnan(value)):
            raise ValueError(f"should_accept_timeout_s must be a number > 0, got {value!r}")
        episode = self.episode_timeout_s
        if episode is not None and not (isinstance(episode, (int, float)) and not isinstance(episode, bool)
                                        and math.isfinite(episode) and episode > 0):
            raise ValueError(f"episode_timeout_s must be a finite number of seconds > 0 or None, got {episode!r}")
        _ = self.reward_options  # validates the reward_* fields (a ValueError names the field)
        if self.reward_backend not in REWARD_BACKENDS:
            raise ValueError(f"reward_backend must be one of {REWARD_BACKENDS}, got {self.reward_backend!r}")
        if self.failure_breaker_consecutive is not None and self.failure_breaker_consecutive < 1:
            raise ValueError(f"failure_breaker_consecutive must be >= 1 or None, got {self.failure_breaker_consecutive}")
        if self.failure_breaker_window < 1:
            raise ValueError(f"failure_breaker_window must be >= 1, got {self.failure_breaker_window}")
        rate = self.failure_breaker_rate
        if rate is not None and not (isinstance(rate, (int, float)) and 0 < rate <= 1):
            raise ValueError(f"failure_breaker_rate must be in (0, 1] or None, got {rate!r}")
        self._check_scheduling()

    def _check_scheduling(self) -> None:
        """The ``scheduling`` fields (each ValueError names its field and the fix)."""
        if self.scheduling not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling must be one of {SCHEDULING_POLICIES}, got {self.scheduling!r}")
        ratio = self.overprovision_ratio
        if isinstance(ratio, bool) or not (isinstance(ratio, (int, float)) and math.isfinite(ratio) and ratio > 0):
            raise ValueError(f"overprovision_ratio must be a finite number > 0 (each step runs ceil((1 + r) * B) "
                             f"groups), got {ratio!r}")
        if isinstance(self.scheduling_max_segments, str) and self.scheduling_max_segments != "server":
            raise ValueError(f"scheduling_max_segments must be an int >= 1, 'server' (the backend's running-sequence "
                             f"limit) or None, got {self.scheduling_max_segments!r}")
        for name, allow_none in (("overprovision_chunk_tokens", True), ("length_aware_probe_tokens", False),
                                 ("scheduling_max_segments", True)):
            value = getattr(self, name)
            if value == "server" and name == "scheduling_max_segments":
                continue
            if value is None and allow_none:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1{' or None' if allow_none else ''}, got {value!r}")
        if self.scheduling == "overprovision" and self.max_head_offpolicyness == 0:
            raise ValueError("max_head_offpolicyness must be >= 1 (or None) with scheduling='overprovision': it "
                             "resumes cut episodes in the next step, so their oldest tokens are a version behind "
                             "and max_head_offpolicyness=0 would reject every one as stale")

    @property
    def reward_options(self) -> RewardPoolOptions:
        """The ``reward_*`` fields as the reward pool's options (what the engine opens its pool with).

        Raises:
            ValueError: a ``reward_*`` field is out of range (the message names it).
        """
        try:
            return RewardPoolOptions(
                max_workers=self.reward_max_workers, timeout_seconds=self.reward_timeout_seconds,
                max_retries=self.reward_max_retries, worker_type=self.reward_worker_type,
                batch_size=self.reward_batch_size, max_batch_delay_s=self.reward_max_batch_delay_s,
            )
        except ValueError as exc:  # its message begins with the option's name: name our field
            raise ValueError(f"reward_{exc}") from None

"""One benchmark point (:class:`BenchConfig`) and the sides that run it.

Standard library at import, plus :class:`engine.backends.sim.SimConfig` (whose
module imports nothing else): the AReaL peer rebuilds a :class:`BenchConfig`
under its own interpreter.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace
from typing import Any

from engine.backends.sim import SimConfig

__all__ = ["DEFAULT_SIM", "EXTRA_SIDES", "SIDES", "SIM_OPTIONS", "BenchConfig", "parse_sides"]

SIDES = ("ours", "areal", "naive")
#: Sides run on request only: ``ours_gc`` is ours with ``EngineConfig.gc_tuning`` on
#: (what the opt-in GC tuning is worth, side by side with the default).
EXTRA_SIDES = ("ours_gc",)

#: The :class:`SimConfig` fields a benchmark point sets (``rollout bench --prefill-s`` ...);
#: ``seed`` also seeds the workload.  ``vocab_size`` and ``eos_token_id`` come from the
#: tokenizer (:meth:`BenchConfig.sim_for`), ``draws_by_prompt`` from ``record``.
SIM_OPTIONS = ("prefill_s", "prefill_s_per_token", "per_token_s", "out_len_median", "out_len_sigma",
               "max_running_seqs", "decode_slowdown_per_seq", "straggler_fraction", "straggler_multiplier",
               "error_fraction", "abort_fraction", "seed")

#: The benchmark's server: lognormal lengths around 256 tokens, zero latency, draws by prompt.
DEFAULT_SIM = SimConfig(out_len_median=256, out_len_sigma=0.3, first_token_id=0, draws_by_prompt=True)


@dataclass(frozen=True, kw_only=True, init=False)
class BenchConfig:
    """One benchmark point (units in the names).

    ``sim``: the simulated server (:class:`~engine.backends.sim.SimConfig`; default
    :data:`DEFAULT_SIM`).  Its :data:`SIM_OPTIONS` may also be given flat, as
    ``rollout bench`` does: ``BenchConfig(prefill_s=0.05)`` is
    ``BenchConfig(sim=replace(DEFAULT_SIM, prefill_s=0.05))``, and
    ``dataclasses.replace(cfg, per_token_s=0.002)`` changes that field of ``cfg.sim``.
    ``sim.draws_by_prompt`` always equals ``record``.

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

    Raises:
        ValueError: a count below 1 (``warmup`` below 0), ``window`` below
            ``concurrency``, ``sample_every_s`` not > 0, or a bad sim field
            (:class:`~engine.errors.InvalidRequestError` from ``SimConfig``).
        TypeError: an option that is neither a field nor in :data:`SIM_OPTIONS`.
    """

    episodes: int = 2000
    concurrency: int = 256
    batch_size: int = 256
    warmup: int = 64
    max_new_tokens: int = 1024
    max_head_offpolicyness: int | None = None
    tokenizer: str = "auto"
    reward_workers: int | None = None
    reward_batch_size: int | None = None
    gc_tuning: bool = False
    window: int | None = None
    record: bool = True
    sample_every_s: float = 0.25
    sim: SimConfig = DEFAULT_SIM

    def __init__(self, *, sim: SimConfig | None = None, **options: Any) -> None:
        sim_changes = {name: options.pop(name) for name in SIM_OPTIONS if name in options}
        own = {f.name: f.default for f in fields(BenchConfig) if f.name != "sim"}
        unknown = sorted(set(options) - set(own))
        if unknown:
            raise TypeError(f"BenchConfig got unknown option(s) {unknown}")
        for name, default in own.items():
            object.__setattr__(self, name, options.get(name, default))
        sim = replace(DEFAULT_SIM if sim is None else sim, draws_by_prompt=self.record, **sim_changes)
        object.__setattr__(self, "sim", sim)
        self._validate()

    def _validate(self) -> None:
        for name in ("episodes", "concurrency", "batch_size", "max_new_tokens", "reward_batch_size"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.warmup < 0:
            raise ValueError(f"warmup must be >= 0, got {self.warmup}")
        if self.window is not None and self.window < self.concurrency:
            raise ValueError(f"window must be >= concurrency ({self.concurrency}), got {self.window}")
        if not self.sample_every_s > 0:
            raise ValueError(f"sample_every_s must be > 0, got {self.sample_every_s}")

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> BenchConfig:
        """The inverse of ``dataclasses.asdict`` (``sim`` as a nested dict)."""
        raw = dict(raw)
        sim = raw.pop("sim", None)
        return cls(sim=None if sim is None else SimConfig(**sim), **raw)

    def to_dict(self) -> dict[str, Any]:
        """``dataclasses.asdict``: plain JSON types, ``sim`` nested."""
        return asdict(self)

    @property
    def seed(self) -> int:
        """Seeds the workload (:func:`~benchmarks.harness.workload.bench_item`) and the sim."""
        return self.sim.seed

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

    def sim_for(self, tokenizer: Any) -> SimConfig:
        """:attr:`sim` with the tokenizer's vocabulary size and EOS id."""
        return replace(self.sim, vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id)

    def areal_unsupported(self) -> str | None:
        """Why the AReaL side cannot run this point (None if it can)."""
        if self.sim.shared_clock:
            return "the shared-step server model (max_running_seqs / decode_slowdown_per_seq)"
        if self.sim.error_fraction > 0 or self.sim.abort_fraction > 0:
            return "injected failures (error_fraction / abort_fraction)"
        return None


def parse_sides(text: str) -> tuple[str, ...]:
    """``"ours,areal"`` -> ``("ours", "areal")``: duplicates dropped, order kept.

    Raises:
        ValueError: a name that is not in :data:`SIDES` or :data:`EXTRA_SIDES`, or none at all.
    """
    sides = tuple(dict.fromkeys(s.strip() for s in text.split(",") if s.strip()))
    bad = [s for s in sides if s not in SIDES + EXTRA_SIDES]
    if bad or not sides:
        raise ValueError(f"unknown side(s) {bad or [text]}; choose from {', '.join(SIDES + EXTRA_SIDES)}")
    return sides

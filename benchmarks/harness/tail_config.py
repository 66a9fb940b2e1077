"""The long-tail scenario (``rollout bench --scenario tail``, issue 27): the simulated
server fitted to a published tail shape, the trainer, and the policies compared.

Standard library at import (plus :class:`engine.backends.sim.SimConfig`, itself
standard library only).

The length model (:mod:`engine.backends.sim._draws`): a prompt's difficulty
``d = exp(difficulty_sigma * z)``, ``z ~ N(0, 1)`` per prompt; each of its ``G`` samples
is lognormal around ``out_len_median * d`` with shape ``out_len_sigma``, capped at
``max_new_tokens`` (``"length"``).  :data:`TAIL_SIM` fits it to Seer (arXiv
2511.14617, sec. 2 and abstract): in a synchronous rollout step "the last 10% of
requests take up to 50% of the step", and samples of one prompt have similar lengths.
The numbers chosen and what they give:

* ``out_len_median = 512`` tokens, ``max_new_tokens = 3072`` (6x the median; the ratio,
  not the scale, sets the shape: scaled down from Seer's 40-98k-token caps so a run
  stays cheap on 2 cores);
* ``difficulty_sigma = 0.65``, ``out_len_sigma = 0.45``: log-length s.d. 0.79, an
  intra-group correlation of log-lengths of 0.65^2 / (0.65^2 + 0.45^2) = 0.68
  (Seer's observation, no number published that we could read; a free parameter
  here), P(length > cap) = 1.2% (the reference run cuts 0.8% of its samples);
* with 16 groups of 8 per step all running at once at a near-flat step cost, the
  expected share of the step after 90% of its requests finished is 0.48
  (:func:`expected_sync_tail_share`, 2000 draws: 0.485); the reference run's ``sync``
  row measures 0.483 (``tail_share``, 20 steps, prefill and queueing included).

GPU: ``max_running_seqs = 128`` (one step's 16 x 8 sequences at once), 25 ms per
decode step, +0.05% per extra running sequence (x1.06 at 128: "nearly flat"), a
KV budget of 128 x 768 tokens (a synchronous step peaks at ~80k: only more in
flight preempts) with vLLM's recompute preemption past it, 20 ms +
0.2 ms/token prefill, ``scheduling_policy="priority"`` (vLLM ``--scheduling-policy
priority``: requests' ``priority`` is honoured; all-zero priorities are FCFS).
"""

from __future__ import annotations

import math
import random
from dataclasses import asdict, dataclass, field
from typing import Any

from engine.backends.sim import SimConfig

__all__ = ["POLICIES", "TAIL_SIM", "TailConfig", "expected_sync_tail_share", "parse_policies"]

#: The server of the tail scenario (the fit is in the module docstring).
TAIL_SIM = SimConfig(
    out_len_median=512, out_len_sigma=0.45, difficulty_sigma=0.65,
    per_token_s=0.025, decode_slowdown_per_seq=0.0005, prefill_s=0.02, prefill_s_per_token=0.0002,
    max_running_seqs=128, kv_token_budget=128 * 768, scheduling_policy="priority",
    vocab_size=32000, first_token_id=3, eos_token_id=2, draws_by_prompt=True, seed=0,
)

#: The policies compared, one row each: ``name -> EngineConfig keyword arguments``
#: (``None``: the synchronous baseline, which is no engine setting: generate a whole
#: batch, wait for its slowest group, train, repeat).  The scheduling names and their
#: parameters are the engine's (``EngineConfig.scheduling``, issue 27); a row whose
#: settings this engine does not have is reported as skipped.
POLICIES: dict[str, dict[str, Any] | None] = {
    "sync": None,
    "fcfs": {"scheduling": "fcfs"},
    # fcfs with the engine-side dispatch bound at the server's 128 slots: what the server cannot
    # run yet waits in the engine, unsent, so its tokens are not stamped with an old version
    "fcfs_bounded": {"scheduling": "fcfs", "scheduling_max_segments": 128},
    "overprovision": {"scheduling": "overprovision", "overprovision_ratio": 0.5},
    "length_aware": {"scheduling": "length_aware"},
    "tail_batching": {"scheduling": "tail_batching"},
}


@dataclass(frozen=True, kw_only=True)
class TailConfig:
    """One run of the tail scenario (units in the names).

    A simulated trainer takes ``groups_per_step`` groups (``B``) of ``group_size``
    samples (``G``) per step, trains for ``train_step_s`` (virtual seconds), bumps the
    policy version, and repeats.  Every policy gets the same ``(steps +
    cooldown_steps) * B`` prompts (one pass, in order) and the same draws; time metrics
    cover the first ``steps`` steps, token and prompt accounting the whole run (the
    cool-down lets everything in flight end: trained or thrown away).
    ``max_head_offpolicyness`` (``eta``) is every asynchronous policy's staleness bound;
    ``prompt_len_min``/``prompt_len_max`` bound the prompt lengths (tokens, uniform).

    Raises:
        ValueError: a count below 1 (``cooldown_steps`` below 0), a negative time, an
            empty prompt-length range, or a bad ``sim`` field.
    """

    steps: int = 20
    cooldown_steps: int = 6
    groups_per_step: int = 16
    group_size: int = 8
    train_step_s: float = 10.0
    max_head_offpolicyness: int = 1
    max_new_tokens: int = 3072
    prompt_len_min: int = 64
    prompt_len_max: int = 512
    max_concurrent_rollouts: int = 1024
    sim: SimConfig = field(default=TAIL_SIM)

    def __post_init__(self) -> None:
        for name in ("steps", "groups_per_step", "group_size", "max_new_tokens", "prompt_len_min",
                     "max_concurrent_rollouts"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("cooldown_steps", "max_head_offpolicyness"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if not (math.isfinite(self.train_step_s) and self.train_step_s >= 0):
            raise ValueError(f"train_step_s must be a finite number of seconds >= 0, got {self.train_step_s!r}")
        if self.prompt_len_max < self.prompt_len_min:
            raise ValueError(f"prompt_len_max ({self.prompt_len_max}) must be >= prompt_len_min ({self.prompt_len_min})")

    @property
    def prompts(self) -> int:
        """Prompts every policy gets: ``(steps + cooldown_steps) * groups_per_step``."""
        return (self.steps + self.cooldown_steps) * self.groups_per_step

    def prompt(self, index: int) -> list[int]:
        """Prompt ``index``'s token ids (a pure function of the sim's seed and ``index``)."""
        rng = random.Random(f"tail-prompt:{self.sim.seed}:{index}")
        n = rng.randint(self.prompt_len_min, self.prompt_len_max)
        return [rng.randrange(self.sim.first_token_id, self.sim.vocab_size) for _ in range(n)]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def parse_policies(text: str) -> tuple[str, ...]:
    """``"sync,fcfs"`` -> ``("sync", "fcfs")`` (duplicates dropped, order kept).

    Raises:
        ValueError: a name not in :data:`POLICIES`, or none.
    """
    names = tuple(dict.fromkeys(s.strip() for s in text.split(",") if s.strip()))
    bad = [n for n in names if n not in POLICIES]
    if bad or not names:
        raise ValueError(f"unknown policy(ies) {bad or [text]}; choose from {', '.join(POLICIES)}")
    return names


def expected_sync_tail_share(sim: SimConfig, *, groups: int, group_size: int, max_new_tokens: int,
                             trials: int = 2000, seed: int = 12345) -> float:
    """The fit's target, in closed form per draw: the mean, over ``trials`` synchronous
    steps of ``groups`` x ``group_size`` samples all decoding at once at a flat step
    cost, of ``(L_max - L_q90) / L_max`` (the share of the step after 90% of its
    requests finished; prefill and queueing ignored).  Dimensionless, in [0, 1]."""
    rng = random.Random(seed)
    mu = math.log(sim.out_len_median)
    n = groups * group_size
    k90 = math.ceil(0.9 * n) - 1
    total = 0.0
    for _ in range(trials):
        lengths = []
        for _ in range(groups):
            mu_p = mu + sim.difficulty_sigma * rng.gauss(0.0, 1.0)
            lengths += [min(max_new_tokens, max(1, round(math.exp(mu_p + sim.out_len_sigma * rng.gauss(0.0, 1.0)))))
                        for _ in range(group_size)]
        lengths.sort()
        total += (lengths[-1] - lengths[k90]) / lengths[-1]
    return total / trials

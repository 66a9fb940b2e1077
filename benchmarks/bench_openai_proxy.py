#!/usr/bin/env python3
"""The OpenAI-compatible proxy's added latency per call (engine.openai).

Every scenario runs ``--sessions`` agents at once, each one session of
``--turns`` chat completions (each turn extends the last: the token-exact
path), on the simulated server with zero latency (prefill 0 s, 0 s per token,
``--out-len`` tokens per completion): whatever a call costs is client, proxy
and engine overhead, not generation.

* ``in-process``: :class:`engine.openai.EngineOpenAI` called directly (chat
  template, token delta, ``engine.agenerate``, tool parser, ``ChatCompletion``).
* ``proxy``: the same calls through ``open_openai_proxy`` from agents in
  another process, with the real ``openai`` SDK (``AsyncOpenAI`` under trio)
  on 127.0.0.1: HTTP, JSON both ways, the SDK's own overhead; sessions started
  and ended over HTTP, each an episode of the engine, all accounted.

Per call: the wall time of ``chat.completions.create`` as the agent sees it,
and the CPU time per call of the engine's process (proxy + engine + sim) and of
the agents' process (the SDK; imports excluded).
The proxy's added latency is ``proxy - in-process`` at the same percentile
(p50, p99) and the same concurrency.  At high concurrency the calls queue for
the CPU (zero-latency generation makes every call pure overhead): the
in-process agents share the engine's thread; the proxy's agents have their own
process, and the SDK's client-side cost is part of what they measure.

Run from the repository root::

    .venv/bin/python benchmarks/bench_openai_proxy.py            # sessions 1, 16, 256 (~1 min)

Prints one table and writes ``benchmarks/results/bench_openai_proxy.json``::

    {"schema": "bench_openai_proxy/1", "config": {...},
     "scenarios": [{"sessions": 256, "mode": "proxy", "calls": 768, "p50_ms": ..., "p99_ms": ...,
                    "mean_ms": ..., "wall_s": ..., "accepted": 256}, ...],
     "added_latency": [{"sessions": 256, "p50_ms": ..., "p99_ms": ...}, ...]}
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "bench_openai_proxy.json"
sys.path.insert(0, str(ROOT))


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


async def _turns(create: Any, i: int, turns: int, out_len: int, latencies: list[float]) -> None:
    msgs: list[Any] = [{"role": "user", "content": f"Agent {i}: what is {i} + {i}?"}]
    for t in range(turns):
        t0 = time.perf_counter()
        c = await create(model="default", messages=msgs, max_tokens=out_len + 1)
        latencies.append(time.perf_counter() - t0)
        msgs += [c.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": f"go on {t}"}]


async def _agents(url: str, sessions: int, turns: int, out_len: int) -> dict[str, Any]:
    """The agents of the proxy mode (run in their own process): the real SDK over HTTP.
    Returns the per-call latencies and the CPU seconds of the run (imports excluded)."""
    import httpx
    import openai
    import trio

    latencies: list[float] = []
    cpu0 = time.process_time()
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    # agents in groups of 16 per connection pool: an httpx pool's cost per request grows with its
    # connections, and real agents live in many processes
    pools = [(httpx.AsyncClient(base_url=url, limits=limits, timeout=300),
              openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0,
                                 http_client=openai.DefaultAsyncHttpxClient(
                                     limits=limits, timeout=300)))  # type: ignore[arg-type]  # (openai types httpx2)
             for _ in range(max(1, sessions // 16))]

    async def agent(i: int) -> None:
        http, base = pools[i % len(pools)]
        s = (await http.post("/rl/start_session", json={"data": {"i": i}})).json()
        await _turns(base.with_options(api_key=s["api_key"]).chat.completions.create, i, turns, out_len, latencies)
        auth = {"Authorization": f"Bearer {s['api_key']}"}
        await http.post("/rl/set_reward", json={"reward": 1.0}, headers=auth)
        await http.post("/rl/end_session", json={"style": "concat"}, headers=auth)

    async with trio.open_nursery() as nursery:
        for i in range(sessions):
            nursery.start_soon(agent, i)
    for http, base in pools:
        await http.aclose()
        await base.close()
    return {"latencies": latencies, "cpu_s": time.process_time() - cpu0}


async def _scenario(mode: str, sessions: int, turns: int, out_len: int) -> dict[str, Any]:
    import trio

    from engine import EngineConfig, SimBackend, SimConfig, open_rollout_engine
    from engine.openai import EngineOpenAI, open_openai_proxy
    from engine.testing import TINY_EOS_ID, build_tiny_tokenizer

    tok = build_tiny_tokenizer()
    sim = SimBackend(SimConfig(vocab_size=len(tok), eos_token_id=TINY_EOS_ID, first_token_id=5,
                               out_len_median=out_len, out_len_sigma=0.0, seed=0))
    latencies: list[float] = []
    config = EngineConfig(max_concurrent_rollouts=max(sessions, 1), reward_max_workers=1)
    child_cpu = 0.0
    async with open_rollout_engine(sim, config) as engine:
        start, cpu0 = time.perf_counter(), time.process_time()
        if mode == "in-process":
            async with trio.open_nursery() as nursery:
                for i in range(sessions):
                    nursery.start_soon(_turns, EngineOpenAI(engine, tok).chat.completions.create, i, turns, out_len,
                                       latencies)
            accepted = sessions  # nothing to account: no episodes
        else:
            async with open_openai_proxy(engine, tok) as proxy:
                cmd = [sys.executable, __file__, "--agents", proxy.url, str(sessions), str(turns), str(out_len)]
                done = json.loads((await trio.run_process(cmd, capture_stdout=True)).stdout)
                latencies, child_cpu = done["latencies"], done["cpu_s"]
                results = await engine.wait_results(sessions)
                accepted = sum(r.status == "accepted" for r in results)
        wall, cpu = time.perf_counter() - start, time.process_time() - cpu0
    ms = [x * 1000 for x in latencies]
    return {"sessions": sessions, "mode": mode, "calls": len(ms), "p50_ms": _pct(ms, 0.5), "p99_ms": _pct(ms, 0.99),
            "mean_ms": sum(ms) / len(ms), "wall_s": wall, "accepted": accepted,
            "engine_cpu_ms_per_call": 1000 * cpu / len(ms), "agents_cpu_ms_per_call": 1000 * child_cpu / len(ms)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    parser.add_argument("--sessions", type=int, nargs="+", default=[1, 16, 256])
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--out-len", type=int, default=16)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--agents", nargs=4, metavar=("URL", "SESSIONS", "TURNS", "OUT_LEN"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    import trio

    if args.agents:  # the agents' process of the proxy mode: print the latencies
        url, sessions, turns, out_len = args.agents
        print(json.dumps(trio.run(_agents, url, int(sessions), int(turns), int(out_len))))
        return 0

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    for mode in ("in-process", "proxy"):  # warm-up (templates compiled, first connections), not reported
        trio.run(_scenario, mode, 2, 2, args.out_len)
    rows = []
    for sessions in args.sessions:
        for mode in ("in-process", "proxy"):
            rows.append(trio.run(_scenario, mode, sessions, args.turns, args.out_len))
    added = []
    print(f"{'sessions':>8} {'mode':>10} {'calls':>6} {'p50 ms':>8} {'p99 ms':>8} {'mean ms':>8} {'wall s':>7} "
          f"{'accepted':>8} {'engine cpu ms/call':>18} {'agents cpu ms/call':>18}")
    for r in rows:
        print(f"{r['sessions']:>8} {r['mode']:>10} {r['calls']:>6} {r['p50_ms']:>8.2f} {r['p99_ms']:>8.2f} "
              f"{r['mean_ms']:>8.2f} {r['wall_s']:>7.2f} {r['accepted']:>8} {r['engine_cpu_ms_per_call']:>18.2f} "
              f"{r['agents_cpu_ms_per_call']:>18.2f}")
    for inproc, proxy in zip(rows[::2], rows[1::2]):
        added.append({"sessions": proxy["sessions"], "p50_ms": proxy["p50_ms"] - inproc["p50_ms"],
                      "p99_ms": proxy["p99_ms"] - inproc["p99_ms"]})
    print("added by the proxy (proxy - in-process): " +
          "; ".join(f"{a['sessions']} sessions: p50 {a['p50_ms']:+.2f} ms, p99 {a['p99_ms']:+.2f} ms" for a in added))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "schema": "bench_openai_proxy/1",
        "config": {"turns": args.turns, "out_len": args.out_len, "python": platform.python_version(),
                   "cpus": os.cpu_count()},
        "scenarios": rows, "added_latency": added}, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

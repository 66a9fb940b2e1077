#!/usr/bin/env python3
"""The long-tail comparison on a real vLLM CPU server, beside the sim at the same scale
(issue 27: "the sim's ranking of policies must hold on the real server").

    .venv/bin/python benchmarks/bench_tail_vllm.py          # make bench-tail-vllm: starts and stops the servers
    .venv/bin/python benchmarks/bench_tail_vllm.py --vllm-url http://127.0.0.1:8000 --fcfs-policies ""
    .venv/bin/python benchmarks/bench_tail_vllm.py --seeds 0 --steps 8 --policies sync,fcfs   # a quick look

What it does (the scenario and its scaling: :mod:`benchmarks.harness.tail_vllm`):

1. starts a vLLM CPU server with the tools' tiny model (``serve_vllm_cpu.sh``; venv
   ``$TRIO_ROLLOUT_VLLM_VENV``, default ``.venv-vllm``; tools ``$TRIO_ROLLOUT_SHARED_TOOLS``,
   default ``../shared/tools``) with ``--scheduling-policy priority`` and ``--max-num-seqs
   B*G``, unless ``--vllm-url`` names a running one;
2. measures its decode step time at 1, 16, 64 and 128 running sequences
   (:func:`~benchmarks.harness.tail_vllm.calibrate`), fits the sim to it and derives the
   scaled scenario (:func:`~benchmarks.harness.tail_vllm.scaled_config`): every row of
   both backends runs that one scenario;
3. runs every policy once per seed in real time (the policy order rotates with the seed),
   measures the server again, stops it; then, for ``--fcfs-policies``, the same on a server
   with vLLM's default ``fcfs`` policy (request priorities are not sent there);
4. runs the sim with the same scenario, policies and seeds (virtual time), and compares the
   rankings (:mod:`benchmarks.harness.tail_vllm_report`).

Every server it starts is stopped, whatever happens (also on SIGTERM); logs and pid files
are in ``--run-dir``.  ~15 minutes on a 2-core box with the defaults (one seed).

JSON (``--out``, schema ``bench_tail_vllm/1``)::

    {"schema", "created", "machine", "config": {TailConfig, "seeds", "policies", "fcfs_policies",
     "settings", "server_args", "vllm_version"},
     "calibration": {"before": Calibration, "after": Calibration | null, "fitted_sim": {...}},
     "results": [{"policy", "backend": "vllm" | "sim", "server_policy": "priority" | "fcfs",
                  ...a bench_tail row: "steps_per_hour", "length_bias_ks", "thrown_away_token_fraction",
                  "staleness_mean", "tail_share", ..., "per_seed": [...]}, ...],
     "comparison": {... benchmarks.harness.tail_vllm_report.compare ...},
     "comparison_fcfs_server": {label: {"vllm_vs_priority", "sim_vs_priority"}} }
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, NoReturn

if sys.version_info < (3, 11):  # pragma: no cover
    from exceptiongroup import BaseExceptionGroup

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402
import trio  # noqa: E402

from benchmarks.harness.cpu_share import CpuShare  # noqa: E402
from benchmarks.harness.report import write_json  # noqa: E402
from engine import EngineConfig  # noqa: E402
from engine.errors import BackendError  # noqa: E402
from benchmarks.harness.tail_cli import aggregate, parse_seeds  # noqa: E402
from benchmarks.harness.tail_cli import run_tail  # noqa: E402
from benchmarks.harness.tail_config import TAIL_SIM, TailConfig, parse_policies  # noqa: E402
from benchmarks.harness.tail_metrics import summarize  # noqa: E402
from benchmarks.harness.tail_run import PolicyUnavailable, engine_config_for  # noqa: E402
from benchmarks.harness.tail_vllm import calibrate, fit_sim, policy_settings, run_policy_vllm, scaled_config  # noqa: E402
from benchmarks.harness.tail_vllm_report import compare, format_side_by_side, ranking  # noqa: E402

DEFAULT_POLICIES = "sync,fcfs,overprovision,length_aware,tail_batching"
REFERENCE = ROOT / "benchmarks" / "reference" / "bench_tail.json"


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="bench_tail_vllm.py", allow_abbrev=False,
                description="the tail scenario's policies on a real vLLM CPU server and on the sim fitted to it")
    p.add_argument("--vllm-url", help="a running vLLM server (dev mode, processed logprobs, no chunked prefill, "
                                      "--max-num-seqs B*G); default: start one")
    p.add_argument("--policies", default=DEFAULT_POLICIES, help=f"compared policies (default {DEFAULT_POLICIES})")
    p.add_argument("--fcfs-policies", default="length_aware",
                   help="policies also run on a server with vLLM's fcfs policy, where no priority is sent (the "
                        "two that set priorities: recycled segments first, longer groups first); '' for none "
                        "(default length_aware; ignored with --vllm-url)")
    p.add_argument("--seeds", default="0", help="comma-separated seeds, each a run of every policy (default 0; "
                                                "each more seed adds ~12 min here)")
    p.add_argument("--steps", type=int, default=10, help="measured trainer steps (default 10)")
    p.add_argument("--cooldown-steps", type=int, default=3, help="extra batches of prompts (default 3)")
    p.add_argument("--groups-per-step", type=int, default=8, help="B (default 8)")
    p.add_argument("--group-size", type=int, default=8, help="G (default 8); the server runs B*G sequences at most")
    p.add_argument("--out-len-median", type=int, default=64, help="median response length, tokens (default 64)")
    p.add_argument("--cap-ratio", type=float, default=6.0, help="max_new_tokens / median (default 6, as the sim's)")
    p.add_argument("--train-step-s", type=float, help="trainer step, seconds (default: derived from the calibration)")
    p.add_argument("--max-head-offpolicyness", type=int, default=1, help="eta (default 1)")
    p.add_argument("--policy-settings", default="{}",
                   help='JSON {policy: {EngineConfig field: value}} over the scaled defaults (probe and chunk at half '
                        'the median), e.g. \'{"overprovision": {"overprovision_chunk_tokens": null}}\'; both backends')
    p.add_argument("--calibration-tokens", type=int, default=64, help="tokens per calibration request (default 64)")
    p.add_argument("--calibration-repeats", type=int, default=3, help="repeats per calibration point, their median "
                                                                         "is used (default 3)")
    p.add_argument("--out", default="benchmarks/results/bench_tail_vllm.json", help="JSON output")
    p.add_argument("--run-dir", default="rollout-out/bench_tail_vllm", help="the tiny model, server logs, pid files")
    p.add_argument("--venv", default=os.environ.get("TRIO_ROLLOUT_VLLM_VENV", str(ROOT / ".venv-vllm")),
                   help="the vLLM CPU venv (default $TRIO_ROLLOUT_VLLM_VENV or .venv-vllm)")
    p.add_argument("--tools", default=os.environ.get("TRIO_ROLLOUT_SHARED_TOOLS", str(ROOT.parent / "shared" / "tools")),
                   help="serve_vllm_cpu.sh and make_tiny_model.py (default $TRIO_ROLLOUT_SHARED_TOOLS or ../shared/tools)")
    return p


def _say(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')} load {os.getloadavg()[0]:.2f}] {message}", file=sys.stderr, flush=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    """One vLLM CPU server started by ``serve_vllm_cpu.sh`` (a context manager: stopped on exit)."""

    def __init__(self, args: argparse.Namespace, model: Path, policy: str, max_num_seqs: int) -> None:
        self.args, self.model, self.policy = args, model, policy
        self.port = _free_port()
        self.env = {**os.environ, "VLLM_CPU_RUN_DIR": str(Path(args.run_dir).resolve())}
        self.serve_args = ["--enforce-eager", "--dtype", "float32", "--logprobs-mode", "processed_logprobs",
                           "--max-model-len", "2048", "--no-enable-chunked-prefill", "--max-num-seqs", str(max_num_seqs)]
        if policy == "priority":
            self.serve_args += ["--scheduling-policy", "priority"]
        self.url = ""
        self.pid = 0

    def __enter__(self) -> Server:
        _say(f"starting a vLLM server ({self.policy}) on port {self.port}")
        try:
            started = subprocess.run(["bash", str(Path(self.args.tools) / "serve_vllm_cpu.sh"), self.args.venv,
                                      str(self.model), str(self.port), *self.serve_args],
                                     capture_output=True, text=True, env=self.env, timeout=420)
        except BaseException:
            self.stop()
            raise
        if started.returncode != 0:
            self.stop()
            raise RuntimeError(f"vLLM did not start: {started.stderr.strip().splitlines()[-1:]}")
        self.url = started.stdout.strip()
        self.pid = int((Path(self.env["VLLM_CPU_RUN_DIR"]) / f"vllm-cpu-{self.port}.pid").read_text())  # = its pgid
        return self

    def stop(self) -> None:
        subprocess.run(["bash", str(Path(self.args.tools) / "serve_vllm_cpu.sh"), "stop", str(self.port)],
                       env=self.env, capture_output=True, timeout=120)

    def __exit__(self, *exc: Any) -> None:
        _say(f"stopping the vLLM server on port {self.port}")
        self.stop()


def _server_facts(url: str) -> dict[str, Any]:
    with httpx.Client(timeout=30) as client:
        version = client.get(url + "/version").json().get("version")
        info = client.get(url + "/server_info", params={"config_format": "json"}).json()["vllm_config"]
    scheduler = info.get("scheduler_config") or {}
    return {"vllm_version": version, "scheduling_policy": scheduler.get("policy"),
            "max_num_seqs": scheduler.get("max_num_seqs"), "device": (info.get("device_config") or {}).get("device")}


def _tiny_model(args: argparse.Namespace) -> Path:
    folder = Path(args.run_dir) / "tiny-llama"
    if not (folder / "config.json").exists():
        subprocess.run([str(Path(args.venv) / "bin" / "python"), str(Path(args.tools) / "make_tiny_model.py"), str(folder)],
                       check=True, capture_output=True, timeout=300)
    return folder


def _vllm_rows(cfg: TailConfig, policies: tuple[str, ...], seeds: tuple[int, ...], url: str, server_policy: str,
               settings: dict[str, dict[str, Any]], pgids: set[int]) -> list[dict[str, Any]]:
    records: dict[str, list[dict[str, Any]]] = {p: [] for p in policies}
    skipped: dict[str, str] = {}
    for n, seed in enumerate(seeds):
        run_cfg = replace(cfg, sim=replace(cfg.sim, seed=seed))
        order = policies[n % len(policies):] + policies[:n % len(policies)]  # rotate: order effects alternate
        for policy in order:
            if policy in skipped:
                continue
            load0, started, cpu = os.getloadavg(), time.monotonic(), CpuShare(pgids)
            cpu.start()
            try:
                obs = run_policy_vllm(run_cfg, policy, url, settings.get(policy))
            except PolicyUnavailable as exc:
                skipped[policy] = str(exc)
                continue
            record = summarize(run_cfg, obs)
            record.update(cpu.stop())
            server = record.pop("server")
            record.update({f"server_{k}": v for k, v in server.items()})
            record.update(time_base="real", seed=seed, wall_s=round(time.monotonic() - started, 2),
                          load_avg_1m_before=round(load0[0], 2), load_avg_1m_after=round(os.getloadavg()[0], 2))
            records[policy].append(record)
            _say(f"vllm/{server_policy} seed {seed} {policy}: {record['steps_per_hour']:.0f} steps/h "
                 f"(wall {record['wall_s']:.0f} s)")
    rows = []
    for policy in policies:
        if policy in skipped:
            rows.append({"policy": policy, "skipped": skipped[policy]})
            continue
        row = aggregate(records[policy])
        row["per_seed"] = [{k: r[k] for k in ("seed", "steps_per_hour", "tail_share", "wall_s", "load_avg_1m_before",
                                               "load_avg_1m_after", "cpu_others_share")} for r in records[policy]]
        rows.append(row)
    return [{**r, "backend": "vllm", "server_policy": server_policy} for r in rows]


def _parse_settings(text: str) -> dict[str, dict[str, Any]]:
    try:
        value = json.loads(text)
    except ValueError:
        raise ValueError(f"--policy-settings must be a JSON object, got {text!r}") from None
    if not isinstance(value, dict) or not all(isinstance(v, dict) for v in value.values()):
        raise ValueError(f"--policy-settings must be a JSON object of objects ({{policy: {{field: value}}}}), got {text!r}")
    parse_policies(",".join(value) or "sync")  # names known
    return value


def _merge(base: dict[str, dict[str, Any]], extra: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {p: {**base.get(p, {}), **extra.get(p, {})} for p in {*base, *extra}}


#: a row one of whose runs had other processes use more than this share of the machine's CPU time is noisy
NOISY_OTHERS_SHARE = 0.10


def _noisy(rows: list[dict[str, Any]]) -> list[str]:
    out = []
    for r in rows:
        shares = [s["cpu_others_share"] for s in r.get("per_seed", []) if s.get("cpu_others_share") is not None]
        if shares and max(shares) > NOISY_OTHERS_SHARE:
            out.append(f"{r['policy']}@{r['server_policy']}")
    return out


def _reference_ranking(policies: tuple[str, ...]) -> list[str] | None:
    try:
        return ranking(json.loads(REFERENCE.read_text())["results"], policies)
    except (OSError, ValueError, KeyError):
        return None


class UsageError(ValueError):
    """A bad option, found before any server starts (exit status 2, as ``rollout bench``)."""


def _check_options(args: argparse.Namespace) -> None:
    """Every option's value, before a server starts (one :class:`UsageError` naming the option)."""
    for name in ("groups_per_step", "group_size", "steps", "out_len_median", "calibration_tokens",
                 "calibration_repeats"):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    for name in ("cooldown_steps", "max_head_offpolicyness"):
        if getattr(args, name) < 0:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}")
    if not (math.isfinite(args.cap_ratio) and args.cap_ratio > 0 and round(args.cap_ratio * args.out_len_median) >= 1):
        raise UsageError(f"--cap-ratio must be a finite number > 0 with --cap-ratio x --out-len-median >= 1 "
                         f"(the cap, tokens), got {args.cap_ratio}")
    if args.train_step_s is not None and not (math.isfinite(args.train_step_s) and args.train_step_s > 0):
        raise UsageError(f"--train-step-s must be a finite number of seconds > 0, got {args.train_step_s}")


def _check_settings(cfg: TailConfig, policies: tuple[str, ...], settings: dict[str, dict[str, Any]]) -> None:
    """Each policy's engine settings build an :class:`EngineConfig` (its error, naming the field)."""
    for policy in policies:
        try:
            engine_config_for(cfg, policy, settings.get(policy))
        except PolicyUnavailable:
            pass  # reported as a skipped row
        except (TypeError, ValueError) as exc:
            raise UsageError(f"--policy-settings {policy}: {exc}") from None


def run(args: argparse.Namespace) -> int:
    _check_options(args)
    try:
        policies = parse_policies(args.policies)
        fcfs_policies: tuple[str, ...] = ()
        if args.fcfs_policies.strip() and not args.vllm_url:
            fcfs_policies = parse_policies(args.fcfs_policies)
        seeds = parse_seeds(args.seeds)
        extra_settings = _parse_settings(args.policy_settings)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    known = {f.name for f in dataclasses.fields(EngineConfig)}
    for policy, fields in extra_settings.items():
        unknown = sorted(set(fields) - known)
        if unknown:
            raise UsageError(f"--policy-settings {policy}: {', '.join(unknown)} is not an EngineConfig field")
    k = args.groups_per_step * args.group_size
    scale = {"out_len_median": args.out_len_median, "cap_ratio": args.cap_ratio, "groups_per_step": args.groups_per_step,
             "group_size": args.group_size, "steps": args.steps, "cooldown_steps": args.cooldown_steps,
             "eta": args.max_head_offpolicyness, "train_step_s": args.train_step_s, "seed": seeds[0]}
    probe = scaled_config(TAIL_SIM, **{**scale, "train_step_s": args.train_step_s or 1.0})  # before a server starts
    _check_settings(probe, (*policies, *fcfs_policies), _merge(policy_settings(probe), extra_settings))
    if not args.vllm_url and not (Path(args.tools) / "serve_vllm_cpu.sh").is_file():
        raise UsageError(f"--tools {args.tools} has no serve_vllm_cpu.sh (the folder of ../shared/tools)")
    if not args.vllm_url and not (Path(args.venv) / "bin" / "vllm").exists():
        raise ValueError(f"no vLLM CPU venv at {args.venv} (run {args.tools}/setup_vllm_cpu.sh {args.venv}, or set "
                         "TRIO_ROLLOUT_VLLM_VENV)")
    Path(args.run_dir).mkdir(parents=True, exist_ok=True)
    model = None if args.vllm_url else _tiny_model(args)
    results: list[dict[str, Any]] = []
    calibration: dict[str, Any] = {}
    facts: dict[str, Any] = {}
    cfg: TailConfig | None = None
    settings: dict[str, dict[str, Any]] = {}
    server_args: dict[str, list[str]] = {}
    for server_policy, names in (("priority", policies), ("fcfs", fcfs_policies)):
        if not names:
            continue
        server = None if args.vllm_url else Server(args, model, server_policy, k)  # type: ignore[arg-type]
        with server if server is not None else contextlib.nullcontext():
            url = args.vllm_url or server.url  # type: ignore[union-attr]
            facts[server_policy] = _server_facts(url)
            if server is not None:
                server_args[server_policy] = server.serve_args
            if cfg is None:  # one scenario for every row: fitted on the first server
                _say("calibrating")
                before = trio.run(lambda: calibrate(url, tokens=args.calibration_tokens, repeats=args.calibration_repeats))
                sim = fit_sim(before, max_running_seqs=k, base=TAIL_SIM,
                              scheduling_policy=facts[server_policy]["scheduling_policy"] or "fcfs")
                cfg = scaled_config(sim, **scale)
                settings = _merge(policy_settings(cfg), extra_settings)
                calibration["before"] = before.to_dict()
                calibration["fitted_sim"] = {f: getattr(sim, f) for f in ("per_token_s", "decode_slowdown_per_seq",
                                                                         "prefill_s", "prefill_s_per_token", "frontend_s_per_request",
                                                                         "max_running_seqs")}
                _say(f"fitted: {calibration['fitted_sim']}, train_step_s {cfg.train_step_s}")
            results += _vllm_rows(cfg, names, seeds, url, server_policy, settings,
                                  set() if server is None else {server.pid})
            if server_policy == "priority":
                _say("calibrating again (drift)")
                calibration["after"] = trio.run(lambda: calibrate(url, tokens=args.calibration_tokens,
                                                                  repeats=args.calibration_repeats)).to_dict()
    assert cfg is not None
    _say("the sim, same scenario and seeds")
    for server_policy, names in (("priority", policies), ("fcfs", fcfs_policies)):
        if names:
            sim_cfg = replace(cfg, sim=replace(cfg.sim, scheduling_policy=server_policy))
            results += [{**r, "backend": "sim", "server_policy": server_policy}
                        for r in run_tail(sim_cfg, names, seeds=seeds, settings=settings)]
    main_rows = [r for r in results if r["server_policy"] == "priority"]
    vllm_rows = [r for r in main_rows if r["backend"] == "vllm"]
    sim_rows = [r for r in main_rows if r["backend"] == "sim"]
    comparison = compare(vllm_rows, sim_rows, policies, reference=_reference_ranking(policies))
    fcfs_cmp = {}
    for name in fcfs_policies:
        pair = {b: {r["server_policy"]: r for r in results if r["backend"] == b and r["policy"] == name
                    and not r.get("skipped")} for b in ("vllm", "sim")}
        fcfs_cmp[f"{name}@fcfs"] = {f"{b}_vs_priority": round(p["fcfs"]["steps_per_hour"] / p["priority"]["steps_per_hour"], 3)
                                    for b, p in pair.items() if "fcfs" in p and "priority" in p}
    vllm_all = [r for r in results if r["backend"] == "vllm"]
    sim_all = [r for r in results if r["backend"] == "sim"]
    print(format_side_by_side(vllm_all, sim_all, title=(
        f"bench_tail_vllm: {cfg.steps} steps of {cfg.groups_per_step} groups x {cfg.group_size}, median "
        f"{cfg.sim.out_len_median} / cap {cfg.max_new_tokens} tokens, train {cfg.train_step_s} s/step, eta "
        f"{cfg.max_head_offpolicyness}, seeds {list(seeds)}; vLLM real time / sim virtual time")))
    print(f"ranking vllm: {' > '.join(comparison['ranking']['vllm'])}")
    print(f"ranking sim:  {' > '.join(comparison['ranking']['sim'])}")
    if comparison["ranking"]["reference_sim"]:
        print(f"ranking full-scale sim (reference): {' > '.join(comparison['ranking']['reference_sim'])}")
    print(f"kendall tau {comparison['kendall_tau']}, same order: {comparison['same_order']}, every disagreement "
          f"within the seeds' noise: {comparison['agree_beyond_noise']}")
    noisy = _noisy(vllm_all)
    if noisy:
        print(f"warning: other processes used more than {NOISY_OTHERS_SHARE:.0%} of the CPUs during {', '.join(noisy)} "
              "(cpu_others_share): wall-clock numbers of a shared box, re-run on a quiet one")
    config = {**cfg.to_dict(), "seeds": list(seeds), "policies": list(policies), "fcfs_policies": list(fcfs_policies),
              "settings": settings, "server_args": server_args, "servers": facts,
              "vllm_version": next(iter(facts.values()))["vllm_version"] if facts else None}
    path = write_json(args.out, "bench_tail_vllm", config, results, calibration=calibration, comparison=comparison,
                      comparison_fcfs_server=fcfs_cmp, noisy_rows=noisy,
                      noisy_rule=f"cpu_others_share > {NOISY_OTHERS_SHARE} in a run (the machine's CPU time used by "
                                 "processes other than this script and its server)",
                      load_avg_end=[round(x, 2) for x in os.getloadavg()])
    print(f"wrote {path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)

    def terminated(signum: int, frame: Any) -> None:  # make's SIGTERM: unwind, so every server is stopped
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, terminated)
    try:
        return run(args)
    except BaseException as exc:  # one line for what we expect, also out of a trio nursery's group
        leaf = _leaf(exc)
        if isinstance(leaf, KeyboardInterrupt):
            print("bench_tail_vllm: interrupted (servers stopped)", file=sys.stderr)
            return 130
        if isinstance(leaf, UsageError):
            print(f"bench_tail_vllm: error: {leaf}", file=sys.stderr)
            return 2
        if isinstance(leaf, _EXPECTED):
            print(f"bench_tail_vllm: error: {leaf}", file=sys.stderr)
            return 1
        raise


_EXPECTED = (ValueError, RuntimeError, BackendError, httpx.HTTPError, subprocess.SubprocessError)


def _leaf(exc: BaseException) -> BaseException:
    """The first exception inside (nested) exception groups."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return exc


if __name__ == "__main__":
    sys.exit(main())

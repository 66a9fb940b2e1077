"""Contract tier: the ``sglang`` backend against real ``rollout serve`` processes
(``python -m engine.serve``) on 127.0.0.1, serving the tiny random Llama of
``engine.testing`` on CPU.

Real processes and sockets: no virtual time here; each test is bounded by a real-time
``trio.fail_after``.  One module-wide set of three servers is started once (about 10 s);
the failover test kills one of them, so it runs last.
"""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest
import torch
import trio

from engine import EngineConfig, ModelRequest, open_rollout_engine
from engine.backends.remote import make_remote_backend
from engine.trajectory import trajectory_from_response
from engine.testing import build_tiny_model
from engine.types import GenerationHyperparameters as G
from workflows import RolloutWorkflow

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
PROMPT = [3, 10, 20, 30, 40, 50]


class ServeProcess:
    """One ``rollout serve`` subprocess; ``url`` once it printed its ready line."""

    def __init__(self, model_dir: str, log_path: Path, *extra: str) -> None:
        self.log_path = log_path
        with log_path.open("w") as log:  # the child keeps its own copy of the descriptor
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "engine.serve", "--model", model_dir, "--port", "0", "--torch-threads", "1",
                 "--max-batch-size", "32", *extra],
                cwd=ROOT, stdout=subprocess.PIPE, stderr=log, text=True,
                env={**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"},
            )
        self.url: str | None = None
        self.terminated = False

    def wait_ready(self, timeout_s: float = 180.0) -> str:
        watchdog = threading.Timer(timeout_s, self.proc.kill)
        watchdog.start()
        try:
            for line in self.proc.stdout:
                if "ready on " in line:
                    self.url = line.split("ready on ", 1)[1].split()[0]
                    return self.url
        finally:
            watchdog.cancel()
        raise RuntimeError(f"rollout serve exited before it was ready:\n{self.log_path.read_text()[-3000:]}")

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=30)
        self.proc.stdout.close()

    def terminate(self) -> None:
        """SIGTERM once: a clean stop (a second SIGTERM during shutdown would kill it)."""
        if self.proc.poll() is None and not self.terminated:
            self.proc.terminate()
            self.terminated = True

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        code = self.proc.wait(timeout=30)
        self.proc.stdout.close()
        return code


@pytest.fixture(scope="module")
def servers_and_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve")
    seed0 = build_tiny_model(root / "seed0", seed=0)
    procs = [ServeProcess(seed0, root / f"serve{i}.log") for i in range(3)]
    try:
        seed1 = build_tiny_model(root / "seed1", seed=1)  # while the servers start
        for p in procs:
            p.wait_ready()
        yield procs, (seed0, seed1)
    finally:
        for p in procs:
            p.terminate()  # all at once
        codes = [p.stop() for p in procs]
    assert codes[1:] == [0, 0], "SIGTERM should stop rollout serve cleanly"


@pytest.fixture
def servers(servers_and_models):
    return servers_and_models[0]


@pytest.fixture
def models(servers_and_models):
    return servers_and_models[1]


def teacher_forced(model_dir, prompt, output):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + output])).logits[0]  # [T, V]
    logp = torch.log_softmax(logits.float(), dim=-1)
    positions = torch.arange(len(prompt) - 1, len(prompt) + len(output) - 1)
    return logp[positions, torch.tensor(output)], logp[positions].argmax(-1)  # [n], [n]


def backend_for(urls, **opts):
    opts = {"health_interval_s": 0.5, "request_timeout_s": 120.0, "backoff_initial_s": 0.05, **opts}
    return make_remote_backend("sglang", urls, **opts)


async def test_tokens_and_logprobs_match_teacher_forcing(servers, models, reward_pool):
    backend = backend_for([servers[0].url])
    with trio.fail_after(60):
        async with open_rollout_engine(backend, reward_pool=reward_pool) as engine:
            greedy = await engine.agenerate(ModelRequest(input_ids=PROMPT, gconfig=G(greedy=True, max_new_tokens=12,
                                                                                      ignore_eos=True)))
            sampled = await engine.agenerate(ModelRequest(input_ids=PROMPT, gconfig=G(max_new_tokens=12, seed=5,
                                                                                       ignore_eos=True)))
            stop_at = greedy.output_tokens[2]
            stopped = await engine.agenerate(ModelRequest(
                input_ids=PROMPT, gconfig=G(greedy=True, max_new_tokens=12, stop_token_ids=[stop_at], ignore_eos=True)))
            info = await backend.get_model_info()
    lp, argmax = teacher_forced(models[0], PROMPT, greedy.output_tokens)
    assert greedy.output_tokens == argmax.tolist() and greedy.stop_reason == "length"
    assert torch.allclose(torch.tensor(greedy.output_logprobs), lp, atol=1e-4)
    lp, _ = teacher_forced(models[0], PROMPT, sampled.output_tokens)  # temperature 1: processed == raw
    assert torch.allclose(torch.tensor(sampled.output_logprobs), lp, atol=1e-4)
    first = greedy.output_tokens.index(stop_at) + 1
    assert stopped.output_tokens == greedy.output_tokens[:first] and stopped.stop_reason == "stop"
    assert info["weight_version"] == "0" and info["model_path"] == models[0]
    assert backend.statistics().servers[0].weight_version == "0"


async def test_cancel_and_disconnect_stop_server_work(servers, reward_pool):
    url = servers[1].url
    backend = backend_for([url])
    long = G(max_new_tokens=1500, ignore_eos=True)

    async def load():
        return (await backend.call(url, "GET", "/get_load"))["num_running_reqs"]

    async def counters():
        return (await backend.call(url, "GET", "/get_server_info"))["counters"]

    async def wait_load(pred):
        while not pred(await load()):
            await trio.sleep(0.02)  # polling a real process

    with trio.fail_after(60):
        async with open_rollout_engine(backend, reward_pool=reward_pool) as engine:
            async with trio.open_nursery() as nursery:  # 1. a cancelled episode: shielded /abort_request
                nursery.start_soon(engine.agenerate, ModelRequest(rid="cancel-me", input_ids=PROMPT, gconfig=long))
                await wait_load(lambda n: n == 1)
                nursery.cancel_scope.cancel()
            await wait_load(lambda n: n == 0)
            assert backend.statistics().aborts_sent == 1
            before = await counters()
            async with httpx.AsyncClient() as client:  # 2. a bare client that goes away: no abort call
                body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 1500, "ignore_eos": True}}
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(functools.partial(client.post, url + "/generate", json=body))
                    await wait_load(lambda n: n == 1)
                    nursery.cancel_scope.cancel()
            await wait_load(lambda n: n == 0)
            after = await counters()
    assert after.get("cancelled", 0) == before.get("cancelled", 0) + 1


class LongEpisode(RolloutWorkflow):
    """One long sampled generation (temperature 1: processed == raw logprobs)."""

    def __init__(self, responses):
        self.responses = responses

    async def arun_episode(self, engine, data):
        resp = await engine.agenerate(ModelRequest(rid=f"long{data['i']}", input_ids=data["ids"],
                                                   gconfig=G(max_new_tokens=data["n"], ignore_eos=True)))
        self.responses[data["i"]] = resp
        return trajectory_from_response(resp, reward=1.0)


async def test_engine_update_weights_mid_generation_on_two_servers(servers, models, reward_pool):
    """``engine.update_weights(folder, version=1)`` while 6 episodes generate on two ``rollout
    serve`` processes: every episode completes, per-token versions show the boundary, the
    tokens before it come from the old weights and those after it from the new ones
    (teacher-forced with each), and both servers loaded the new weights."""
    urls = [servers[1].url, servers[2].url]
    backend = backend_for(urls)
    n = 600
    responses = {}
    items = [{"i": i, "ids": PROMPT + [7 + i], "n": n} for i in range(6)]

    async def loads():
        return [(await backend.call(u, "GET", "/get_load"))["num_running_reqs"] for u in urls]

    with trio.fail_after(180):
        async with open_rollout_engine(backend, EngineConfig(max_concurrent_rollouts=6),
                                       reward_pool=reward_pool) as engine:
            for item in items:
                engine.submit(item, LongEpisode(responses))
            while not all(await loads()):  # both servers are decoding
                await trio.sleep(0.02)  # polling real processes
            await trio.sleep(0.3)  # let them produce some tokens with the old weights
            await engine.update_weights(models[1], version=1)
            results = await engine.wait_results(6)
            infos = [await backend.call(u, "GET", "/get_model_info") for u in urls]
            stats = backend.statistics()
    assert sorted(r.task_id for r in results) == list(range(6)) and all(r.status == "accepted" for r in results)
    assert [i["weight_version"] for i in infos] == ["1", "1"] and [i["model_path"] for i in infos] == [models[1]] * 2
    assert stats.weight_updates == 1 and all(s.requests > 0 for s in stats.servers), stats
    mid = 0
    for item in items:
        resp = responses[item["i"]]
        assert resp.output_len == n
        k = resp.output_versions.count(0)
        assert resp.output_versions == [0] * k + [1] * (n - k)
        lp = torch.tensor(resp.output_logprobs)
        old, _ = teacher_forced(models[0], item["ids"], resp.output_tokens)
        new, _ = teacher_forced(models[1], item["ids"] + resp.output_tokens[:k], resp.output_tokens[k:])
        if k:
            assert (lp[:k] - old[:k]).abs().max() < 1e-3  # before the boundary: the old weights
        if k < n:
            assert (lp[k:] - new).abs().max() < 1e-3  # after it: the new weights (re-prefilled)
            assert (lp[k:] - old[k:]).abs().max() > 1e-2
        mid += 0 < k < n
    assert mid >= 1  # the update landed in the middle of running generations
    assert stats.weight_version_mismatches == 0, stats


class OneShot(RolloutWorkflow):
    async def arun_episode(self, engine, data):
        resp = await engine.agenerate(ModelRequest(rid=f"ep{data['i']}", input_ids=data["ids"],
                                                   gconfig=G(max_new_tokens=24, ignore_eos=True)))
        assert resp.output_len == 24
        return trajectory_from_response(resp, reward=float(data["i"]))


async def test_three_servers_one_killed_mid_run(servers, models, reward_pool):
    """100 episodes over 3 servers; one is SIGKILLed with requests in flight: every episode
    still ends accepted exactly once, and load was spread by outstanding tokens."""
    urls = [p.url for p in servers]
    backend = backend_for(urls)
    items = [{"i": i, "ids": PROMPT + [5 + i % 200] * (1 + i % 7)} for i in range(100)]
    with trio.fail_after(180):
        async with open_rollout_engine(backend, EngineConfig(max_concurrent_rollouts=30),
                                       reward_pool=reward_pool) as engine:
            for item in items:
                engine.submit(item, OneShot())
            results = []
            killed = False
            while len(results) < 100:
                results += await engine.wait_results(1)
                if not killed and len(results) >= 20 and backend.pool[urls[0]].in_flight > 0:
                    in_flight_at_kill = backend.pool[urls[0]].in_flight
                    servers[0].kill()
                    killed = True
            stats = backend.statistics()
    assert killed and in_flight_at_kill > 0
    assert sorted(r.task_id for r in results) == list(range(100))  # none lost, none twice
    assert all(r.status == "accepted" for r in results), [r for r in results if r.status != "accepted"][:3]
    rewards = sorted(float(r.trajectory["rewards"][0]) for r in results)
    assert rewards == [float(i) for i in range(100)]
    per_server = {s.url: s for s in stats.servers}
    assert not per_server[urls[0]].healthy and per_server[urls[0]].ejections == 1, stats
    # the interrupted requests were re-sent elsewhere (an answer already on the wire at the kill is not)
    assert stats.retries >= 1 and stats.requests_failed == 0, stats
    requests = [per_server[u].requests for u in urls]
    assert min(requests[1:]) >= 25, stats  # spread over the survivors
    assert requests[0] >= 5, stats  # the killed one had its share before it died


def test_serve_cli_rejects_a_bad_port(capsys):
    from engine.serve import main

    assert main(["--port", "-1"]) == 2
    assert "--port" in capsys.readouterr().err

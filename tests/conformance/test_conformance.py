"""Conformance tier: one ``agenerate`` contract, run over every backend.

Backends: ``mock`` (MockBackend), ``sim``, ``hf-static``, ``hf-continuous`` (the tiny random
Llama of ``engine.testing``), ``fake-sglang`` and ``fake-vllm`` (``tests/fixtures/fake_servers.py``
behind ``httpx.MockTransport``), and ``serve`` (``rollout serve``'s app, in-process, on a real
socket on 127.0.0.1, reached by the ``sglang`` client).  Each test checks, per backend:

* evidence: as many logprobs and versions as tokens, valid values, the budget honoured;
* version tagging: every token carries the version set before the segment was sent;
* withdraw on cancel: cancelling the episode stops the backend's work on the request;
* abort and resume: an interrupted generation is re-sent and completes, and the per-token
  versions show the boundary; where the backend implements ``WeightSync`` the interruption
  is ``engine.update_weights`` and the tokens after the boundary come from the new weights
  (teacher-forced with the new weights, or the fakes' toy model); elsewhere
  ``engine.update_weights`` fails naming the backend;
* one logprob semantics: at temperature 0.7 the logprobs are those of the processed
  distribution (``log_softmax(logits / 0.7)``) on hf, serve, fake SGLang and fake vLLM.

Real threads and sockets (hf, serve): real time, bounded by ``trio.fail_after``; waits poll
the backend's own state (a model-forward counter, the fakes' running requests).
"""

from __future__ import annotations

import pickle
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import trio

from engine import BackendError, EngineConfig, MockBackend, ModelRequest, ModelResponse, open_rollout_engine
from engine.backends.base import WeightSync, validate_response
from engine.backends.remote import make_remote_backend
from engine.backends.remote.vllm import LogprobsModeError
from engine.types import GenerationHyperparameters as G
from fake_servers import FakeSGLang, FakeVLLM, fake_logprob, fake_tokens, mock_transport

BACKENDS = ["mock", "sim", "hf-static", "hf-continuous", "fake-sglang", "fake-vllm", "serve"]
WEIGHT_SYNC = {"hf-static", "hf-continuous", "fake-sglang", "fake-vllm", "serve"}
URL = "http://fake:1"
PROMPT = [3, 10, 20, 30, 40, 50]
LONG = 1500  # tokens of a generation that is still running when the test acts


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from engine.testing import build_tiny_model

    root = tmp_path_factory.mktemp("conformance")
    return build_tiny_model(root / "a", seed=0), build_tiny_model(root / "b", seed=1)


def _load(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def teacher_forced(model, prompt, output, temperature=1.0):
    """``log_softmax(logits / temperature)`` at each output token, teacher-forced: ``[n]``."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + output])).logits[0].float()  # [T, V]
    logp = torch.log_softmax(logits / temperature, dim=-1)
    positions = torch.arange(len(prompt) - 1, len(prompt) + len(output) - 1)
    return logp[positions, torch.tensor(output)]


@dataclass
class Rig:
    """One backend under test and the hooks the contract needs."""

    backend: Any
    #: returns once the next long generation has produced tokens (or hangs at the server)
    progressed: Callable[[], Awaitable[None]]
    #: the next long generation hangs until aborted (servers) / takes LONG tokens (models)
    hang: Callable[[], None]
    #: returns once the backend no longer works on a withdrawn request
    idle: Callable[[], Awaitable[None]]
    #: weight-sync source of other weights, and a check that tokens came from them
    new_weights: Any = None
    from_new_weights: Callable[[list[int], list[int], list[float]], None] | None = None
    #: reference logprobs of ``tokens`` after ``prompt`` at ``temperature`` (processed semantics)
    reference: Callable[[list[int], list[int], float], list[float]] | None = None


async def _until(pred: Callable[[], bool]) -> None:
    while not pred():
        await trio.sleep(0.002)


@asynccontextmanager
async def rig_for(name: str, models) -> AsyncIterator[Rig]:
    if name == "mock":
        state = {"hang": False, "running": 0}

        async def handler(req, budget):
            state["running"] += 1
            try:
                if state.pop("hang_once", False):
                    await trio.sleep_forever()
                n = budget
                tokens, lps = fake_tokens(list(req.input_ids), n)
                return ModelResponse(input_tokens=list(req.input_ids), output_tokens=tokens, output_logprobs=lps,
                                     output_versions=[backend.version] * n, stop_reason="length")
            finally:
                state["running"] -= 1

        backend = MockBackend(handler)
        yield Rig(backend, progressed=lambda: _until(lambda: state["running"] > 0),
                  hang=lambda: state.update(hang_once=True), idle=lambda: _until(lambda: state["running"] == 0))
    elif name == "sim":
        from engine import SimBackend

        backend = SimBackend(per_token_s=0.001, prefill_s=0.0, out_len_median=100_000, out_len_sigma=0.0,
                             max_running_seqs=4)
        yield Rig(backend, progressed=lambda: _until(lambda: backend.statistics().sequences_decoding > 0),
                  hang=lambda: None,
                  idle=lambda: _until(lambda: backend.statistics().sequences_running == 0))
    elif name in ("hf-static", "hf-continuous", "serve"):
        async with _model_rig(name, models) as rig:
            yield rig
    else:
        fake = FakeSGLang(length=LONG) if name == "fake-sglang" else FakeVLLM(length=LONG)
        fake.partial_on_abort = 3
        backend = make_remote_backend(name.removeprefix("fake-"), [URL], transport=mock_transport({URL: fake}),
                                      health_interval_s=60.0)

        def from_new(prompt, tokens, logprobs):
            assert fake.weights == "/ckpt/b"
            assert (tokens, logprobs) == fake_tokens(prompt, len(tokens), weights="/ckpt/b")

        def reference(prompt, tokens, temperature):
            return [fake_logprob(prompt + tokens[:i], t, temperature) for i, t in enumerate(tokens)]

        yield Rig(backend, progressed=lambda: _until(lambda: bool(fake.running)),
                  hang=lambda: fake.script.append("hang"), idle=lambda: _until(lambda: not fake.running),
                  new_weights="/ckpt/b", from_new_weights=from_new, reference=reference)


@asynccontextmanager
async def _model_rig(name: str, models) -> AsyncIterator[Rig]:
    from transformers import AutoTokenizer

    from engine import HFBackend

    path_a, path_b = models
    model, tok = _load(path_a), AutoTokenizer.from_pretrained(path_a)
    reference_a, reference_b = _load(path_a), _load(path_b)
    forwards, stepping = [0], threading.Event()
    original = model.forward

    def counting_forward(*args, **kwargs):  # the signal that decoding is under way
        forwards[0] += 1
        if forwards[0] >= 4:
            stepping.set()
        return original(*args, **kwargs)

    model.forward = counting_forward
    mode = "continuous" if name == "hf-continuous" else "static"
    hf = HFBackend(model, tok, batch_window_s=0.0, mode=mode, max_batch_size=8)

    def hang():
        forwards[0] = 0
        stepping.clear()

    async def progressed():
        await trio.to_thread.run_sync(stepping.wait)

    def from_new(prompt, tokens, logprobs):
        lp_b = teacher_forced(reference_b, prompt, tokens)
        assert (torch.tensor(logprobs) - lp_b).abs().max() < 1e-3
        assert (torch.tensor(logprobs) - teacher_forced(reference_a, prompt, tokens)).abs().max() > 1e-2

    def reference(prompt, tokens, temperature):
        return teacher_forced(reference_a, prompt, tokens, temperature).tolist()

    if name != "serve":
        yield Rig(hf, progressed=progressed, hang=hang,
                  idle=lambda: _until(lambda: hf.statistics().requests_running == 0),
                  new_weights=path_b, from_new_weights=from_new, reference=reference)
        return
    from engine.serve import SGLangServer, serve_asgi

    server = SGLangServer(hf, model_path=path_a)
    async with trio.open_nursery() as nursery:
        port = await nursery.start(serve_asgi, server.app, "127.0.0.1", 0)
        await nursery.start(server.run)
        client = make_remote_backend("sglang", [f"http://127.0.0.1:{port}"], health_interval_s=60.0)
        yield Rig(client, progressed=progressed, hang=hang,
                  idle=lambda: _until(lambda: not server._running and hf.statistics().requests_running == 0),
                  new_weights=path_b, from_new_weights=from_new, reference=reference)
        nursery.cancel_scope.cancel()


def _long(**kw) -> G:
    return G(max_new_tokens=LONG, ignore_eos=True, **kw)


@pytest.mark.parametrize("name", BACKENDS)
async def test_evidence_and_version_tagging(name, models, reward_pool):
    with trio.fail_after(60):
        async with rig_for(name, models) as rig, open_rollout_engine(rig.backend, reward_pool=reward_pool) as engine:
            engine.set_version(3)
            req = ModelRequest(input_ids=PROMPT, gconfig=G(max_new_tokens=8, ignore_eos=True))
            resp = await engine.agenerate(req)
            validate_response(resp, req)
            assert resp.output_len == 8 and resp.stop_reason == "length"
            assert resp.output_versions == [3] * 8  # the version read before the segment was sent
            assert rig.backend.statistics().version == 3 and rig.backend.version == 3
            stats = rig.backend.statistics()
            assert stats.requests_served >= 1 and stats.tokens_generated >= 8 and stats.logprob_semantics == "processed"


@pytest.mark.parametrize("name", BACKENDS)
async def test_cancelling_the_episode_withdraws_its_generation(name, models, reward_pool):
    with trio.fail_after(60):
        async with rig_for(name, models) as rig, open_rollout_engine(rig.backend, reward_pool=reward_pool) as engine:
            rig.hang()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(engine.agenerate, ModelRequest(rid="gone", input_ids=PROMPT, gconfig=_long()))
                await rig.progressed()
                nursery.cancel_scope.cancel()
            await rig.idle()  # the backend stopped working on it
            assert rig.backend.statistics().requests_running == 0
            if name.startswith("fake-") or name == "serve":
                assert rig.backend.statistics().aborts_sent == 1  # the server was told (shielded)
            # and the backend still serves
            resp = await engine.agenerate(ModelRequest(input_ids=PROMPT, gconfig=G(max_new_tokens=4, ignore_eos=True)))
            assert resp.output_len == 4


@pytest.mark.parametrize("name", BACKENDS)
async def test_abort_and_resume_across_a_weight_update(name, models, reward_pool):
    """The interrupted generation completes; versions show the boundary; with WeightSync
    the tokens after it come from the new weights."""
    with trio.fail_after(120):
        async with rig_for(name, models) as rig, open_rollout_engine(
                rig.backend, EngineConfig(max_concurrent_rollouts=4), reward_pool=reward_pool) as engine:
            if name not in WEIGHT_SYNC:
                assert not isinstance(rig.backend, WeightSync)
                with pytest.raises(BackendError, match=f"{type(rig.backend).__name__} does not support weight"):
                    await engine.update_weights("/ckpt/b", version=1)
                assert engine.version == 0 and not engine.paused
                return
            assert isinstance(rig.backend, WeightSync)
            rig.hang()
            result = {}

            async def episode():
                result["resp"] = await engine.agenerate(ModelRequest(input_ids=PROMPT, gconfig=_long()))

            async with trio.open_nursery() as nursery:
                nursery.start_soon(episode)
                await rig.progressed()
                await engine.update_weights(rig.new_weights, version=1)
            assert engine.version == 1 and not engine.paused
    resp = result["resp"]
    assert resp.output_len == LONG and resp.stop_reason == "length"
    k = resp.output_versions.index(1)
    assert 0 < k < LONG and resp.output_versions == [0] * k + [1] * (LONG - k)
    rig.from_new_weights(PROMPT + resp.output_tokens[:k], resp.output_tokens[k:], resp.output_logprobs[k:])


@pytest.mark.parametrize("name", ["hf-static", "hf-continuous", "serve", "fake-sglang", "fake-vllm"])
async def test_logprobs_are_processed_at_temperature_0_7(name, models, reward_pool):
    with trio.fail_after(60):
        async with rig_for(name, models) as rig, open_rollout_engine(rig.backend, reward_pool=reward_pool) as engine:
            resp = await engine.agenerate(ModelRequest(input_ids=PROMPT, gconfig=G(
                max_new_tokens=12, temperature=0.7, ignore_eos=True)))
    processed = torch.tensor(rig.reference(PROMPT, resp.output_tokens, 0.7))
    raw = torch.tensor(rig.reference(PROMPT, resp.output_tokens, 1.0))
    got = torch.tensor(resp.output_logprobs)
    assert (got - processed).abs().max() < 1e-3  # after the temperature ...
    assert (got - raw).abs().max() > 1e-2  # ... which this check can tell from before it


@pytest.mark.parametrize("fake, match", [
    (FakeVLLM(logprobs_mode="raw_logprobs"), "runs --logprobs-mode raw_logprobs"),
    (FakeVLLM(dev_mode=False), "cannot read the logprobs mode"),
])
async def test_vllm_client_refuses_servers_without_processed_logprobs(fake, match, reward_pool):
    backend = make_remote_backend("vllm", [URL], transport=mock_transport({URL: fake}))
    with pytest.raises(BackendError, match=match) as info:
        async with backend.open():  # what open_rollout_engine enters first
            pass  # pragma: no cover
    assert "--logprobs-mode processed_logprobs" in str(info.value)
    assert "check_logprobs_mode=False" in str(info.value)  # the Python API's way to skip the check
    assert isinstance(info.value, LogprobsModeError) and info.value.url == URL
    copy = pickle.loads(pickle.dumps(info.value))  # (a sharded engine's shard sends it whole)
    assert type(copy) is LogprobsModeError and str(copy) == str(info.value)
    trusting = make_remote_backend("vllm", [URL], transport=mock_transport({URL: fake}), check_logprobs_mode=False)
    async with open_rollout_engine(trusting, reward_pool=reward_pool) as engine:
        assert (await engine.agenerate(ModelRequest(input_ids=PROMPT, gconfig=G(max_new_tokens=2)))).output_len == 2


async def test_remote_weight_update_refuses_in_place_and_state_dicts(reward_pool):
    fake = FakeSGLang()
    backend = make_remote_backend("sglang", [URL], transport=mock_transport({URL: fake}))
    async with open_rollout_engine(backend, reward_pool=reward_pool) as engine:
        with pytest.raises(BackendError, match="mode 'in_place' is not supported"):
            await engine.update_weights("/ckpt/b", version=1, mode="in_place")
        with pytest.raises(BackendError, match="needs a checkpoint folder"):
            await engine.update_weights({"w": torch.zeros(1)}, version=1)
        assert engine.version == 0 and not engine.paused and not backend.paused
        assert fake.weights == "" and ("continue", {}) in fake.control  # resumed after each failure


async def test_vllm_weight_update_without_dev_mode_says_so(reward_pool):
    fake = FakeVLLM()
    backend = make_remote_backend("vllm", [URL], transport=mock_transport({URL: fake}))
    async with open_rollout_engine(backend, reward_pool=reward_pool) as engine:
        fake.dev_mode = False
        with pytest.raises(BackendError, match="VLLM_SERVER_DEV_MODE=1"):
            await engine.update_weights("/ckpt/b", version=1)
        assert engine.version == 0

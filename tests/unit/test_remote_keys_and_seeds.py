"""Issue 24, classes 2 and 8, against fake servers behind ``httpx.MockTransport`` (virtual time).

Class 8: servers started with ``--api-key``.  The remote backends send ``Authorization:
Bearer <key>`` on every call (``api_key=``); without the key, or with a wrong one, start-up
fails at once (vLLM guards only ``/v1/...`` and SGLang everything but ``/health``, so the
health probe alone would pass and every request would fail later), and the key never shows in
a repr or a message.

Class 2: a vLLM server on CPU with chunked prefill crashes on the first seeded prompt it
splits (``RuntimeError: CPU Generator does not use offset``); the backend reads
``/server_info`` at start-up and refuses such a server (:class:`SeededSamplingError`), unless
``check_seeded_sampling=False``.  The real-server evidence is
``tests/contract/test_remote_vllm_run.py``.
"""

from __future__ import annotations

import pickle

import pytest
import trio

from engine import BackendError, InvalidRequestError, ModelRequest, open_rollout_engine
from engine.backends.remote import ApiKey, make_remote_backend
from engine.backends.remote.vllm import LogprobsModeError, SeededSamplingError
from engine.types import GenerationHyperparameters as G
from fake_servers import FakeSGLang, FakeVLLM, mock_transport

A, B = "http://a:1", "http://b:1"
KEY = "k3y-0f-the-servers"
FAKES = {"sglang": FakeSGLang, "vllm": FakeVLLM}


def make(fakes, kind, **opts):
    return make_remote_backend(kind, list(fakes), transport=mock_transport(fakes), seed=0, **opts)


def req(seed=None):
    return ModelRequest(rid="r", input_ids=[3, 10, 20], gconfig=G(max_new_tokens=4, seed=seed))


# -- class 8: API keys -----------------------------------------------------------------------


def test_an_api_key_never_shows_in_a_repr_or_a_message():
    key = ApiKey(KEY)
    assert repr(key) == str(key) == f"{key}" == "ApiKey('***')"
    assert key.authorization == f"Bearer {KEY}" and pickle.loads(pickle.dumps(key)) == key
    backend = make_remote_backend("vllm", [A], api_key=KEY)
    assert backend.api_key == key
    assert KEY not in repr(vars(backend)) and KEY not in repr(vars(backend.http))
    assert KEY not in repr(backend.http.client.headers)  # httpx masks it
    assert backend.http.client.headers["authorization"] == f"Bearer {KEY}"
    for bad in ("", "two words", "line\nbreak", 42):
        with pytest.raises(InvalidRequestError, match="api_key must be a non-empty string of visible ASCII") as info:
            ApiKey(bad)
        assert str(bad) not in str(info.value) or bad == ""
    with pytest.raises(InvalidRequestError, match="api_key or an Authorization header in headers, not both"):
        make_remote_backend("sglang", [A], api_key=KEY, headers={"authorization": "Bearer other"})


@pytest.mark.parametrize("kind", ["sglang", "vllm"])
async def test_the_key_goes_with_every_call(kind, reward_pool):
    fake = FAKES[kind](api_key=KEY)
    async with open_rollout_engine(make({A: fake}, kind, api_key=KEY), reward_pool=reward_pool) as engine:
        resp = await engine.agenerate(req())
    assert resp.output_len == 4 and len(fake.generate_calls) == 1
    assert fake.authorizations and set(fake.authorizations) == {f"Bearer {KEY}"}  # probes and control calls too


@pytest.mark.parametrize("kind", ["sglang", "vllm"])
@pytest.mark.parametrize("given", [None, "wrong-key"])
async def test_without_the_right_key_start_up_fails_at_once(kind, given, autojump_clock, reward_pool):
    """Regression: the health probe passed (the real servers leave /health open), then every
    request failed -- vLLM's first /v1/models answer 401 was a traceback-worthy error
    naming nothing, SGLang's /get_model_info was read as "the servers do not say"."""
    fake = FAKES[kind](api_key=KEY)
    backend = make({A: fake}, kind, api_key=given)
    start = trio.current_time()
    with pytest.raises(BackendError, match=r"every server refused access.*HTTP 401") as info:
        async with open_rollout_engine(backend, reward_pool=reward_pool):
            pytest.fail("the engine must not open")
    assert trio.current_time() - start < 1  # not after startup_timeout_s (300 s)
    assert backend.pool.all_denied and fake.generate_calls == []
    assert "wrong-key" not in str(info.value)


async def test_a_server_that_refuses_the_key_leaves_the_rotation_the_others_serve(reward_pool):
    good, other = FakeVLLM(api_key=KEY), FakeVLLM(api_key="another-key")
    backend = make({A: good, B: other}, "vllm", api_key=KEY)
    async with open_rollout_engine(backend, reward_pool=reward_pool) as engine:
        assert [s.url for s in backend.pool.healthy] == [A]
        for _ in range(3):
            assert (await engine.agenerate(req())).output_len == 4
    assert len(good.generate_calls) == 3 and other.generate_calls == []
    stats = {s.url: s for s in backend.statistics().servers}
    assert stats[B].access_denied and not stats[A].access_denied


# -- class 2: vLLM on CPU with chunked prefill ---------------------------------------------


@pytest.mark.parametrize("chunked", [True, None])  # None: the server does not say (vLLM's default is on)
async def test_a_cpu_vllm_server_with_chunked_prefill_is_refused_at_start_up(chunked, reward_pool):
    fake = FakeVLLM(device="cpu", chunked_prefill=chunked)
    with pytest.raises(SeededSamplingError) as info:
        async with open_rollout_engine(make({A: fake}, "vllm"), reward_pool=reward_pool):
            pytest.fail("the engine must not open")
    message = str(info.value)
    assert message.startswith(f"vllm backend: {A} is a vLLM server on CPU with chunked prefill on")
    assert "CPU Generator does not use offset" in message and "max_num_batched_tokens" in message
    assert "restart it with --no-enable-chunked-prefill" in message and "check_seeded_sampling=False" in message
    assert info.value.url == A and fake.generate_calls == []
    assert isinstance(pickle.loads(pickle.dumps(info.value)), SeededSamplingError)
    assert not isinstance(info.value, LogprobsModeError)


@pytest.mark.parametrize(("fake", "opts"), [
    (FakeVLLM(device="cpu", chunked_prefill=False), {}),  # --no-enable-chunked-prefill
    (FakeVLLM(device="cuda", chunked_prefill=True), {}),  # CUDA generators rewind
    (FakeVLLM(device=None, chunked_prefill=True), {}),  # the device is not reported: trusted
    (FakeVLLM(device="cpu", chunked_prefill=True), {"check_seeded_sampling": False}),
    (FakeVLLM(device="cpu", chunked_prefill=True, dev_mode=False),  # nothing to read, nothing checked
     {"check_seeded_sampling": False, "check_logprobs_mode": False}),
])
async def test_servers_that_serve_seeded_requests_or_a_user_who_opts_out_start(fake, opts, reward_pool):
    async with open_rollout_engine(make({A: fake}, "vllm", **opts), reward_pool=reward_pool) as engine:
        resp = await engine.agenerate(req(seed=7))
    assert resp.output_len == 4 and fake.generate_calls[0]["seed"] == 7

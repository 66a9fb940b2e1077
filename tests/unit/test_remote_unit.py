"""Unit tier: the remote backends (``sglang``, ``vllm``) against scripted fakes behind
``httpx.MockTransport`` -- no network, virtual time (``autojump_clock``), quiescence via
``trio.testing.wait_all_tasks_blocked``.

Covers request mapping, answer parsing, retries with backoff, ejection and re-admission,
least-outstanding-tokens routing with stickiness, failover resuming from partial tokens,
deadlines, shielded aborts, pause/continue, weight-update replay, configuration checks.
"""

from __future__ import annotations

import math

import httpx
import pytest
import trio
from trio.testing import wait_all_tasks_blocked

from engine import BackendError, InvalidRequestError, ModelRequest, open_rollout_engine
from engine.backends import remote
from engine.backends.remote import (
    RemoteCallError,
    RemoteTimeouts,
    RetryPolicy,
    make_remote_backend,
    map_exceptions,
)
from engine.types import GenerationHyperparameters as G
from fake_servers import FakeSGLang, FakeVLLM, fake_tokens, mock_transport

A, B, C = "http://a:1", "http://b:1", "http://c:1"
PROMPT = [3, 10, 20, 30]


def make(fakes, kind="sglang", **opts):
    return make_remote_backend(kind, list(fakes), transport=mock_transport(fakes), seed=0, **opts)


def req(rid="r", n_prompt=4, **g):
    return ModelRequest(rid=rid, input_ids=PROMPT[:n_prompt] if n_prompt <= 4 else [1] * n_prompt, gconfig=G(**g))


def wire_rids(fake):
    return [c.get("rid") or c.get("request_id") for c in fake.generate_calls]


# -- mapping and parsing ------------------------------------------------------------------


def test_sglang_payload_maps_generation_hyperparameters():
    b = make({A: FakeSGLang()})
    g = G(max_new_tokens=50, min_new_tokens=80, temperature=0.7, top_p=0.9, top_k=20, stop_token_ids=[4, 2],
          stop=["\n\n"], ignore_eos=True, skip_special_tokens=False, frequency_penalty=0.5, seed=7)
    p = b.wire.build_payload(ModelRequest(rid="x", input_ids=PROMPT, gconfig=g), 40, "x@00000001")
    assert p == {
        "input_ids": PROMPT, "rid": "x@00000001", "return_logprob": True, "stream": False,
        "sampling_params": {"max_new_tokens": 40, "temperature": 0.7, "top_p": 0.9, "top_k": 20, "min_new_tokens": 40,
                            "stop_token_ids": [4, 2], "ignore_eos": True, "skip_special_tokens": False,
                            "frequency_penalty": 0.5, "stop": ["\n\n"], "sampling_seed": 7}}
    greedy = b.wire.build_payload(ModelRequest(input_ids=PROMPT, gconfig=G(greedy=True, temperature=0.3)), 5, "y")
    sp = greedy["sampling_params"]
    assert sp["temperature"] == 0.0 and sp["top_k"] == -1 and sp["top_p"] == 1.0
    assert "stop" not in sp and "sampling_seed" not in sp
    assert b.wire.build_payload(ModelRequest(input_ids=PROMPT), 5, "z")["sampling_params"]["top_k"] == -1


def test_sglang_parse_answer():
    b = make({A: FakeSGLang()})
    body = {"output_ids": [7, 8], "meta_info": {"finish_reason": {"type": "stop", "matched": 8},
                                                "weight_version": "3",
                                                "output_token_logprobs": [[-0.5, 7, None], [-1.5, 8, None]]}}
    parsed = b.wire.parse_generation(body)
    assert (parsed.tokens, parsed.logprobs, parsed.stop_reason, parsed.weight_version) == ([7, 8], [-0.5, -1.5], "stop", "3")
    body["meta_info"]["finish_reason"] = {"type": "length", "length": 2}
    assert b.wire.parse_generation([body]).stop_reason == "length"
    body["output_ids"] = [7, 9]  # same count, different ids: evidence broken
    with pytest.raises(RemoteCallError, match="disagree"):
        b.wire.parse_generation(body)
    body["output_ids"] = [7, 8, 9]  # count mismatch: tokens from output_ids, the engine's check reports it
    assert b.wire.parse_generation(body).tokens == [7, 8, 9]
    reject = {"meta_info": {"finish_reason": {"type": "abort", "message": "too long", "status_code": 400}}}
    with pytest.raises(RemoteCallError, match="too long") as info:
        b.wire.parse_generation(reject)
    assert not info.value.retryable
    with pytest.raises(ValueError, match="finish_reason"):
        b.wire.parse_generation({"meta_info": {"finish_reason": {"type": "weird"}}})
    none_lp = {"meta_info": {"finish_reason": {"type": "stop"}, "output_token_logprobs": [[None, 5, None]]}}
    assert math.isnan(b.wire.parse_generation(none_lp).logprobs[0])  # NaN: rejected by validate_response


def test_vllm_payload_and_parse():
    b = make({A: FakeVLLM()}, kind="vllm", model="tiny")
    g = G(max_new_tokens=50, temperature=1.2, top_k=100_000_000, stop_token_ids=[4], min_new_tokens=2, seed=3)
    p = b.wire.build_payload(ModelRequest(input_ids=PROMPT, gconfig=g), 9, "w@1")
    assert p["model"] == "tiny" and p["prompt"] == PROMPT and p["max_tokens"] == 9 and p["top_k"] == -1
    assert p["logprobs"] == 0 and p["return_token_ids"] and p["return_tokens_as_token_ids"]
    assert p["request_id"] == "w@1" and p["seed"] == 3 and p["min_tokens"] == 2 and p["stop_token_ids"] == [4]
    assert b.wire.abort_call("w@1") == ("POST", "/abort_requests", {"request_ids": ["cmpl-w@1-0"]}, None)
    choice = {"finish_reason": "repetition", "logprobs": {"token_logprobs": [-1.0, -2.0],
                                                          "tokens": ["token_id:11", "token_id:12"]}}
    parsed = b.wire.parse_generation({"choices": [choice]})  # ids from "token_id:N" strings
    assert parsed.tokens == [11, 12] and parsed.stop_reason == "stop" and parsed.logprobs == [-1.0, -2.0]
    choice["token_ids"] = [11, 13]
    with pytest.raises(RemoteCallError, match="disagree"):
        b.wire.parse_generation({"choices": [choice]})
    with pytest.raises(RemoteCallError, match="error") as info:
        b.wire.parse_generation({"choices": [{"finish_reason": "error"}]})
    assert info.value.retryable
    assert b.logprob_semantics == "processed" and make({A: FakeSGLang()}).logprob_semantics == "processed"


def test_map_exceptions_classifies_transport_errors():
    r = httpx.Request("POST", "http://a:1/generate")
    cases = [(httpx.ConnectError("refused", request=r), True, True),
             (httpx.ReadTimeout("slow", request=r), True, False),
             (httpx.RemoteProtocolError("gone", request=r), True, False),
             (httpx.ReadError("reset", request=r), True, False),
             (httpx.UnsupportedProtocol("ftp", request=r), False, False)]
    for exc, retryable, down in cases:
        with pytest.raises(RemoteCallError) as info:
            with map_exceptions("http://a:1"):
                raise exc
        assert (info.value.retryable, info.value.server_down) == (retryable, down), exc
        assert isinstance(info.value, BackendError) and info.value.url == "http://a:1"


# -- the engine round trip -------------------------------------------------------------------


async def test_sglang_through_engine(reward_pool, autojump_clock):
    fake = FakeSGLang(length=3)
    backend = make({A: fake})
    async with open_rollout_engine(backend, reward_pool=reward_pool) as engine:
        engine.set_version(2)
        resp = await engine.agenerate(req("ep1", max_new_tokens=8))
    tokens, lps = fake_tokens(PROMPT, 3)
    assert resp.output_tokens == tokens and resp.output_logprobs == lps
    assert resp.output_versions == [2, 2, 2] and resp.stop_reason == "stop"
    (call,) = fake.generate_calls
    assert call["rid"].startswith("ep1@") and call["sampling_params"]["max_new_tokens"] == 8
    stats = backend.statistics()
    assert stats.requests_served == 1 and stats.servers[0].weight_version == "0"
    assert stats.weight_version_mismatches == 1  # the server says "0", tokens are tagged 2


async def test_vllm_through_engine_discovers_model_and_aborts_by_choice_id(reward_pool, autojump_clock):
    fake = FakeVLLM(length=5)
    backend = make({A: fake}, kind="vllm")
    async with open_rollout_engine(backend, reward_pool=reward_pool) as engine:
        resp = await engine.agenerate(req("v1", max_new_tokens=4))
        assert resp.output_tokens == fake_tokens(PROMPT, 4)[0] and resp.stop_reason == "length"
        assert fake.generate_calls[0]["model"] == "tiny"
        fake.script = ["hang"]
        with trio.move_on_after(1):
            await engine.agenerate(req("v2", max_new_tokens=4))
        await wait_all_tasks_blocked()
        wire = fake.generate_calls[1]["request_id"]
        assert fake.aborts == [{"request_ids": [f"cmpl-{wire}-0"]}]
        fake.script = ["hang"]
        fake.partial_on_abort = 2
        result = {}

        async def episode():
            result["resp"] = await engine.agenerate(req("v3", max_new_tokens=4))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(episode)
            await wait_all_tasks_blocked()
            await backend.pause_generation("abort")  # the server returns it with 2 tokens
            await wait_all_tasks_blocked()
            assert len(fake.generate_calls) == 3  # the resumed segment waits for continue
            await backend.continue_generation()
        await backend.pause_generation("keep")
        await backend.continue_generation()
    resp = result["resp"]
    assert fake.generate_calls[3]["prompt"] == PROMPT + fake_tokens(PROMPT, 2)[0]
    assert ("pause", {"mode": ["keep"]}) in fake.control and ("resume", None) in fake.control
    assert len(resp.output_tokens) == 4


# -- retries, ejection, routing ---------------------------------------------------------------


async def test_retries_5xx_with_capped_exponential_backoff(autojump_clock):
    fake = FakeSGLang()
    fake.script = ["503", "500", "malformed", "ok"]
    backend = make({A: fake}, eject_after_failures=10)
    t0 = trio.current_time()
    resp = await backend.generate(req(max_new_tokens=4), 4)
    elapsed = trio.current_time() - t0
    assert len(fake.generate_calls) == 4 and resp.output_len == 4
    lo = 0.25 * 0.5 + 0.5 * 0.5 + 1.0 * 0.5  # three retries, jitter takes at most half
    assert lo <= elapsed <= 0.25 + 0.5 + 1.0
    assert backend.statistics().retries == 3
    fake.script = ["503"] * 10
    with pytest.raises(RemoteCallError, match="attempt 6 on http://a:1.*HTTP 503"):
        await backend.generate(req(max_new_tokens=4), 4)
    assert len(fake.generate_calls) == 4 + 6
    policy = RetryPolicy(backoff_max_s=2.0)
    rng = __import__("random").Random(0)
    assert all(1.0 <= policy.backoff_s(k, rng) <= 2.0 for k in range(4, 500))  # capped


async def test_refused_connection_fails_over_at_once_and_ejects(autojump_clock):
    fa, fb = FakeSGLang(), FakeSGLang()
    fa.refuse = True
    backend = make({A: fa, B: fb})
    t0 = trio.current_time()
    resp = await backend.generate(req(max_new_tokens=4), 4)
    assert trio.current_time() == t0  # no backoff: a fresh healthy server was available
    assert resp.output_len == 4 and len(fb.generate_calls) == 1
    stats = {s.url: s for s in backend.statistics().servers}
    assert not stats[A].healthy and stats[A].ejections == 1 and "cannot connect" in stats[A].last_error
    assert backend.statistics().failovers == 1


async def test_dropped_connection_fails_over_with_the_same_input(autojump_clock):
    fa, fb = FakeSGLang(), FakeSGLang()
    fa.script = ["drop"]
    backend = make({A: fa, B: fb})
    resp = await backend.generate(req(max_new_tokens=4), 4)
    assert resp.output_len == 4
    assert fa.generate_calls[0]["input_ids"] == fb.generate_calls[0]["input_ids"] == PROMPT
    assert backend.pool[A].healthy  # one lost connection does not eject


async def test_health_checks_eject_and_readmit(reward_pool, autojump_clock):
    fa, fb = FakeSGLang(), FakeSGLang()
    backend = make({A: fa, B: fb}, health_interval_s=1.0, eject_after_failures=2)
    async with open_rollout_engine(backend, reward_pool=reward_pool):
        fa.health = 503
        await trio.sleep(1.5)
        assert backend.pool[A].healthy  # one failed probe: still in
        await trio.sleep(1.0)
        assert not backend.pool[A].healthy
        resp = await backend.generate(req(max_new_tokens=4), 4)  # routed around A
        assert resp.output_len == 4 and not fa.generate_calls
        fa.health = 200
        await trio.sleep(1.0)
        assert backend.pool[A].healthy
    assert backend.statistics().health_failures == 2


async def test_all_servers_down_waits_for_readmission(reward_pool, autojump_clock):
    fa = FakeSGLang()
    backend = make({A: fa}, health_interval_s=2.0)
    async with open_rollout_engine(backend, reward_pool=reward_pool) as engine:
        fa.refuse = True

        async def revive():
            await trio.sleep(7)
            fa.refuse = False

        async with trio.open_nursery() as nursery:
            nursery.start_soon(revive)
            resp = await engine.agenerate(req(max_new_tokens=4))
        assert resp.output_len == 4 and 7 <= trio.current_time() <= 9
        assert backend.statistics().waits_for_server >= 1


async def test_routing_least_outstanding_tokens_and_sticky(autojump_clock):
    fakes = {u: FakeSGLang(length=100) for u in (A, B, C)}
    for f in fakes.values():
        f.script = ["hang"] * 5
    backend = make(fakes)

    async def go(rid, n_prompt, budget, key=None):
        r = ModelRequest(rid=rid, input_ids=[1] * n_prompt, gconfig=G(max_new_tokens=budget),
                         metadata={"routing_key": key} if key else {})
        await backend.generate(r, budget)

    def placed():
        return {rid.split("@")[0]: url for url, f in fakes.items() for rid in wire_rids(f)}

    async with trio.open_nursery() as nursery:
        for rid, n_prompt, budget, key in [("r1", 10, 90, "session"), ("r2", 10, 10, None), ("r3", 10, 40, None),
                                           ("r4", 10, 10, None)]:
            nursery.start_soon(go, rid, n_prompt, budget, key)
            await wait_all_tasks_blocked()
        # costs (prompt + budget): r1 100 -> A (all idle), r2 20 -> B, r3 50 -> C, r4 20 -> B (B 20 < C 50 < A 100)
        assert placed() == {"r1": A, "r2": B, "r3": C, "r4": B}
        assert [s.outstanding_tokens for s in backend.pool.servers] == [100, 40, 50]
        nursery.start_soon(go, "r5", 10, 10, "session")  # sticky: A, though A carries the most
        nursery.start_soon(go, "r6", 10, 10, None)  # not sticky: the least loaded, B (40 < C 50 < A 120)
        await wait_all_tasks_blocked()
        assert placed()["r5"] == A and placed()["r6"] == B
        for f in fakes.values():
            f.hold.set()
    assert all(s.outstanding_tokens == 0 and s.in_flight == 0 for s in backend.pool.servers)
    assert backend.pool.sticky_server("session") == A


async def test_sticky_server_unhealthy_routes_elsewhere_and_rebinds(autojump_clock):
    fa, fb = FakeSGLang(), FakeSGLang()
    backend = make({A: fa, B: fb})
    await backend.generate(req("ep", max_new_tokens=4), 4)
    assert backend.pool.sticky_server("ep") == A
    backend.pool.eject(backend.pool[A], "test")
    await backend.generate(req("ep", max_new_tokens=4), 4)
    assert backend.pool.sticky_server("ep") == B and len(fb.generate_calls) == 1


async def test_failover_resumes_from_partial_tokens(reward_pool, autojump_clock):
    fa, fb = FakeSGLang(length=10), FakeSGLang(length=10)
    fa.script = [("abort", 3, "die")]  # 3 tokens, then the server is gone
    backend = make({A: fa, B: fb})
    async with open_rollout_engine(backend, reward_pool=reward_pool) as engine:
        resp = await engine.agenerate(req("ep", max_new_tokens=8))
    partial = fake_tokens(PROMPT, 3)[0]
    (b_call,) = fb.generate_calls
    assert b_call["input_ids"] == PROMPT + partial  # resumed from the tokens it had
    assert b_call["sampling_params"]["max_new_tokens"] == 5
    assert resp.output_tokens == partial + fake_tokens(PROMPT + partial, 5)[0]
    assert resp.stop_reason == "length" and len(resp.output_logprobs) == 8
    assert not backend.pool[A].healthy and backend.pool.sticky_server("ep") == B


# -- deadlines, cancellation, aborts ---------------------------------------------------------


async def test_deadline_bounds_a_request_and_aborts_it(reward_pool, autojump_clock):
    fa = FakeSGLang()
    fa.script = ["hang"]
    backend = make({A: fa}, request_timeout_s=30.0)
    async with open_rollout_engine(backend, reward_pool=reward_pool) as engine:
        t0 = trio.current_time()
        with pytest.raises(BackendError, match="request_timeout_s=30.0"):
            await engine.agenerate(req("slow", max_new_tokens=4))
        assert trio.current_time() - t0 == pytest.approx(30.0)
    assert fa.aborts == [{"rid": fa.generate_calls[0]["rid"]}]
    assert backend.statistics().deadline_exceeded == 1


async def test_cancelled_episode_sends_a_shielded_abort(reward_pool, autojump_clock):
    fa = FakeSGLang()
    fa.script = ["hang"]
    backend = make({A: fa})
    async with open_rollout_engine(backend, reward_pool=reward_pool) as engine:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(engine.agenerate, req("ep", max_new_tokens=4))
            await wait_all_tasks_blocked()
            assert fa.running  # in flight on the server
            nursery.cancel_scope.cancel()
        await wait_all_tasks_blocked()
        assert fa.aborts == [{"rid": fa.generate_calls[0]["rid"]}] and not fa.running
        assert backend.statistics().aborts_sent == 1
    # a direct caller whose scope is cancelled: the abort still goes out (shielded)
    fa.script = ["hang"]
    with trio.CancelScope() as scope:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(backend.generate, req("direct", max_new_tokens=4), 4)
            await wait_all_tasks_blocked()
            scope.cancel()
    assert fa.aborts[-1] == {"rid": fa.generate_calls[-1]["rid"]}


async def test_attempt_timeout_aborts_and_retries_elsewhere(autojump_clock):
    fa, fb = FakeSGLang(), FakeSGLang()
    fa.script = ["hang"]
    backend = make({A: fa, B: fb}, attempt_timeout_s=10.0)
    t0 = trio.current_time()
    resp = await backend.generate(req(max_new_tokens=4), 4)
    assert resp.output_len == 4 and trio.current_time() - t0 == pytest.approx(10.0)
    assert fa.aborts == [{"rid": fa.generate_calls[0]["rid"]}] and len(fb.generate_calls) == 1
    assert backend.statistics().attempt_timeouts == 1


async def test_ejection_cancels_in_flight_attempts_which_fail_over(reward_pool, autojump_clock):
    fa, fb = FakeSGLang(), FakeSGLang()
    fa.script = ["hang"]
    backend = make({A: fa, B: fb}, health_interval_s=1.0, eject_after_failures=2)
    async with open_rollout_engine(backend, reward_pool=reward_pool) as engine:
        fa.health = 503  # the server hangs and stops answering health probes
        resp = await engine.agenerate(req("ep", max_new_tokens=4))
        assert 2.0 <= trio.current_time() <= 3.0
    assert resp.output_len == 4 and len(fb.generate_calls) == 1
    assert fa.aborts == []  # an ejected server is not sent an abort


async def test_non_retryable_errors_fail_at_once(autojump_clock):
    fa, fb = FakeSGLang(), FakeSGLang()
    fa.script = ["400"]
    backend = make({A: fa, B: fb})
    with pytest.raises(RemoteCallError, match="HTTP 400") as info:
        await backend.generate(req(max_new_tokens=4), 4)
    assert not info.value.retryable and len(fa.generate_calls) == 1 and not fb.generate_calls
    assert backend.pool[A].healthy  # a 4xx is not the server's fault
    fa.script = [("reject", 400)]
    with pytest.raises(RemoteCallError, match="rejected the request"):
        await backend.generate(req(max_new_tokens=4), 4)


async def test_empty_abort_is_retried_never_returned(autojump_clock):
    fa = FakeSGLang()
    fa.script = ["abort_empty", "ok"]
    backend = make({A: fa})
    resp = await backend.generate(req(max_new_tokens=4), 4)
    assert resp.output_len == 4 and resp.stop_reason == "length" and len(fa.generate_calls) == 2
    fa.script = ["abort_empty"] * 10
    with pytest.raises(RemoteCallError, match="aborted before any token"):
        await backend.generate(req(max_new_tokens=4), 4)


async def test_evidence_errors_fail_the_request_clearly(reward_pool, autojump_clock):
    fa = FakeSGLang()
    backend = make({A: fa})
    async with open_rollout_engine(backend, reward_pool=reward_pool) as engine:
        fa.script = ["mismatch"]
        with pytest.raises(BackendError, match="4 output_tokens but 3 output_logprobs"):
            await engine.agenerate(req(max_new_tokens=4))
        fa.script = ["sentinel"]
        with pytest.raises(BackendError, match="-9999"):
            await engine.agenerate(req(max_new_tokens=4))


# -- pause, continue, weights ----------------------------------------------------------------


async def test_pause_aborts_and_resumes_with_new_version(reward_pool, autojump_clock):
    fa = FakeSGLang(length=6)
    fa.script = ["hang"]
    fa.partial_on_abort = 2
    backend = make({A: fa})
    async with open_rollout_engine(backend, reward_pool=reward_pool) as engine:
        result = {}

        async def episode():
            result["resp"] = await engine.agenerate(req("ep", max_new_tokens=6))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(episode)
            await wait_all_tasks_blocked()
            await backend.pause_generation()  # the server aborts the request: 2 partial tokens
            engine.set_version(1)
            await wait_all_tasks_blocked()
            assert len(fa.generate_calls) == 1 and backend.paused  # nothing sent while paused
            await backend.continue_generation()
    resp = result["resp"]
    assert resp.output_versions == [0, 0, 1, 1, 1, 1] and resp.stop_reason == "length"
    assert fa.control == [("pause", {}), ("continue", {})]
    with pytest.raises(InvalidRequestError, match="pause mode"):
        await backend.pause_generation("keep")  # a vLLM mode


async def test_empty_abort_during_our_pause_waits_without_counting(autojump_clock):
    fa = FakeSGLang()
    fa.script = ["hang"]
    backend = make({A: fa}, max_attempts=1)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(backend.generate, req(max_new_tokens=4), 4)
        await wait_all_tasks_blocked()
        await backend.pause_generation()
        await wait_all_tasks_blocked()
        await backend.continue_generation()
    assert len(fa.generate_calls) == 2  # re-sent after continue, not failed (max_attempts=1)


async def test_weight_update_is_replayed_to_a_server_that_missed_it(reward_pool, autojump_clock):
    fa, fb = FakeSGLang(), FakeSGLang()
    fb.refuse = True
    backend = make({A: fa, B: fb}, health_interval_s=1.0)
    async with open_rollout_engine(backend, reward_pool=reward_pool) as engine:
        assert not backend.pool[B].healthy  # down at start-up
        await engine.update_weights("/ckpt/step3", version=3)  # WeightSync: pause, load, version, resume
        assert backend.version == 3 and fa.weight_version == "3" and backend.pool[B].stale_weights
        update = ("update", {"model_path": "/ckpt/step3", "weight_version": "3", "abort_all_requests": True})
        assert fa.control == [("pause", {}), update, ("continue", {})] and fa.weights == "/ckpt/step3"
        fb.refuse = False
        await trio.sleep(1.5)
        assert backend.pool[B].healthy and fb.weight_version == "3"
        assert fb.control == [update]  # replayed before its re-admission
        resp = await backend.generate(req(max_new_tokens=2), 2)
        assert resp.output_versions == [3, 3]


async def test_startup_fails_clearly_when_no_server_answers(reward_pool, autojump_clock):
    fa = FakeSGLang()
    fa.refuse = True
    backend = make({A: fa}, startup_timeout_s=5.0)
    with pytest.raises(BackendError, match="no server answered /health within"):
        async with open_rollout_engine(backend, reward_pool=reward_pool):
            pass


# -- configuration -----------------------------------------------------------------------------


def test_config_validation_names_the_field():
    with pytest.raises(InvalidRequestError, match="request_timeout_s"):
        RemoteTimeouts(request_timeout_s=-1)
    with pytest.raises(InvalidRequestError, match="health_interval_s"):
        RemoteTimeouts(health_interval_s=float("nan"))
    with pytest.raises(InvalidRequestError, match="request_timeout_s"):
        RemoteTimeouts(request_timeout_s=math.inf)  # every request has a deadline
    assert RemoteTimeouts(attempt_timeout_s=None).attempt_timeout_s is None
    with pytest.raises(InvalidRequestError, match="max_attempts"):
        RetryPolicy(max_attempts=0)
    with pytest.raises(InvalidRequestError, match="jitter_fraction"):
        RetryPolicy(jitter_fraction=1.5)
    with pytest.raises(InvalidRequestError, match="kind"):
        make_remote_backend("tgi", [A])
    with pytest.raises(InvalidRequestError, match="http://"):
        make_remote_backend("sglang", ["localhost:30000"])
    with pytest.raises(InvalidRequestError, match="duplicate"):
        make_remote_backend("sglang", [A, A + "/"])
    with pytest.raises(InvalidRequestError, match="at least one"):
        make_remote_backend("vllm", [])
    b = make_remote_backend("vllm", [A], request_timeout_s=60, max_attempts=2, model="m", max_concurrency=None)
    assert b.timeouts.request_timeout_s == 60 and b.retry.max_attempts == 2 and b.model == "m"
    assert isinstance(b, remote.VLLMBackend)


@pytest.mark.parametrize("module", [remote, "engine.serve"])
def test_public_names_are_sorted_and_exist(module):
    import importlib

    if isinstance(module, str):
        module = importlib.import_module(module)
    assert module.__all__ == sorted(module.__all__)
    for name in module.__all__:
        assert hasattr(module, name), name

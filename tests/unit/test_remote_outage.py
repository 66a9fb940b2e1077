"""Unit tier: issue 24 class 1, the deadlines of a remote pool with no healthy server, and
the generation and episode deadlines (mock transports, virtual time: ``autojump_clock``).

* the only server dies and never comes back: requests wait ``no_server_timeout_s`` from the
  moment the last healthy server was lost, then the episodes in flight and those still queued
  fail ``backend_unavailable`` (counted in ``statistics()`` and the metrics), with a warning at
  least every 30 s meanwhile naming each down server and its last error;
* it comes back inside the window: it is used again and every episode completes;
* a server that accepts a request and never answers: ``attempt_timeout_s`` fails it over, or
  with one server the request fails ``backend_timeout``;
* ``episode_timeout_s`` fails an episode ``episode_timeout``;
* every new deadline is validated (negative, NaN: an error naming the field).
"""

from __future__ import annotations

import logging
import math
from urllib.parse import parse_qs

import httpx
import pytest
import trio

from engine import BackendError, EngineConfig, ModelRequest, open_rollout_engine
from engine.backends.remote import RemoteTimeouts, make_remote_backend
from engine.trajectory import trajectory_from_response
from engine.errors import InvalidRequestError, failure_reason
from engine.serve import HTTPRequest
from engine.testing import MockBackend
from engine.types import GenerationHyperparameters as G
from engine.types import ModelResponse
from fake_servers import FakeSGLang, mock_transport
from workflows import RolloutWorkflow

A, B = "http://a:1", "http://b:1"
PROMPT = [3, 10, 20, 30]


class Killable:
    """A fake server that can die like a SIGKILLed process: its requests in flight lose
    their connection, new connections are refused; :meth:`revive` starts it again."""

    def __init__(self, fake: FakeSGLang) -> None:
        self.fake = fake
        self.dead = False
        self.scopes: set[trio.CancelScope] = set()

    def kill(self) -> None:
        self.dead = True
        for scope in list(self.scopes):
            scope.cancel()

    def revive(self) -> None:
        self.dead = False


def killable_transport(servers: dict[str, Killable]) -> httpx.MockTransport:
    async def handler(request: httpx.Request) -> httpx.Response:
        server = servers[f"{request.url.scheme}://{request.url.host}:{request.url.port}"]
        if server.dead:
            raise httpx.ConnectError("[Errno 111] Connection refused", request=request)
        scope = trio.CancelScope()
        server.scopes.add(scope)
        try:
            with scope:
                resp = await server.fake.handle(HTTPRequest(request.method, request.url.path,
                                                            parse_qs(request.url.query.decode()),
                                                            dict(request.headers), request.content))
        finally:
            server.scopes.discard(scope)
        if scope.cancelled_caught:
            raise httpx.RemoteProtocolError("Server disconnected without sending a response.", request=request)
        return httpx.Response(resp.status, content=resp.body, headers={"content-type": resp.content_type})

    return httpx.MockTransport(handler)


class OneShot(RolloutWorkflow):
    async def arun_episode(self, engine, data):
        resp = await engine.agenerate(ModelRequest(rid=f"ep{data}", input_ids=PROMPT, gconfig=G(max_new_tokens=4)))
        return trajectory_from_response(resp, reward=1.0)


class WarningTimes(logging.Handler):
    """The ``rollout`` loggers' warnings with the trio time each was logged at."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.records: list[tuple[float, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append((trio.current_time(), record.getMessage()))

    def __enter__(self) -> WarningTimes:
        logging.getLogger("rollout").addHandler(self)
        return self

    def __exit__(self, *exc: object) -> None:
        logging.getLogger("rollout").removeHandler(self)

    def about(self, text: str) -> list[tuple[float, str]]:
        return [(t, m) for t, m in self.records if text in m]


def one_server(**opts):
    server = Killable(FakeSGLang(delay_s=1.0))  # each generation takes 1 s
    backend = make_remote_backend("sglang", [A], transport=killable_transport({A: server}), seed=0,
                                  health_interval_s=5.0, **opts)
    return server, backend


async def test_the_only_server_killed_fails_in_flight_and_queued_episodes_at_the_window(reward_pool, autojump_clock):
    from engine.cli._metrics import snapshot_metrics
    from engine.cli._monitor import RunMonitor

    server, backend = one_server(no_server_timeout_s=60.0)
    with WarningTimes() as warnings:
        async with open_rollout_engine(backend, EngineConfig(max_concurrent_rollouts=2),
                                       reward_pool=reward_pool) as engine:
            for i in range(6):
                engine.submit(i, OneShot())
            first = await engine.wait_results(2)  # at t=1; the next two are in flight
            await trio.sleep(0.5)
            killed_at = trio.current_time()
            server.kill()
            rest = await engine.wait_results(4)
            ended_at = trio.current_time()
            stats = engine.statistics()
            families = snapshot_metrics(RunMonitor(engine, total=6).snapshot())
            server.revive()  # after the window, a server that comes back is used again
            await trio.sleep(5.0)
            assert (await engine.agenerate(ModelRequest(input_ids=PROMPT, gconfig=G(max_new_tokens=4)))).output_len == 4
    assert [r.status for r in first] == ["accepted"] * 2
    assert [(r.status, r.reason, r.error_type) for r in rest] == [("failed", "backend_unavailable",
                                                                   "BackendUnavailableError")] * 4
    assert all(A in r.error_message and "no_server_timeout_s=60" in r.error_message for r in rest)
    assert all("cannot connect" in r.error_message for r in rest)  # the server's last error
    # the window counts from the loss of the last healthy server (just after the kill), not per request
    assert killed_at + 60.0 <= ended_at <= killed_at + 61.0
    assert stats.failed_by_reason == {"backend_unavailable": 4} and stats.accepted == 2 and stats.running == 0
    ended = next(f for f in families if f.name == "rollout_episodes_ended")
    assert [s.value for s in ended.samples if s.labels == {"status": "failed", "reason": "backend_unavailable"}] == [4]
    assert backend.statistics().requests_unavailable == 4  # two waited; the two queued failed at once
    down = warnings.about("no healthy sglang server")
    times = [t for t, _ in down if t <= ended_at]
    assert times and times[0] - killed_at <= 1.0  # said at once
    assert all(b - a <= 30.0 for a, b in zip([killed_at, *times], [*times, ended_at]))  # then at least every 30 s
    assert all(A in m and "cannot connect" in m for _, m in down)
    assert any("backend_unavailable" in m for _, m in down)


async def test_a_server_back_inside_the_window_is_used_again(reward_pool, autojump_clock):
    server, backend = one_server(no_server_timeout_s=60.0)
    async with open_rollout_engine(backend, EngineConfig(max_concurrent_rollouts=2),
                                   reward_pool=reward_pool) as engine:
        for i in range(6):
            engine.submit(i, OneShot())
        await trio.sleep(1.5)
        killed_at = trio.current_time()
        server.kill()

        async def revive():
            await trio.sleep(40.0)
            server.revive()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(revive)
            results = await engine.wait_results(6)
        ended_at = trio.current_time()
    assert [r.status for r in results] == ["accepted"] * 6
    assert killed_at + 40.0 <= ended_at <= killed_at + 50.0  # the next probe re-admits it


async def test_with_the_defaults_a_request_waits_300_s_for_a_server_then_fails_backend_unavailable(autojump_clock):
    fake = FakeSGLang()
    fake.refuse = True
    backend = make_remote_backend("sglang", [A], transport=mock_transport({A: fake}), seed=0)
    t0 = trio.current_time()
    with pytest.raises(BackendError, match=r"no healthy sglang server .*http://a:1: cannot connect") as info:
        await backend.generate(ModelRequest(input_ids=PROMPT, gconfig=G(max_new_tokens=4)), 4)
    assert failure_reason(info.value) == "backend_unavailable"
    assert trio.current_time() - t0 == pytest.approx(300.0, abs=1.0)  # not the hour of request_timeout_s
    t1 = trio.current_time()  # past the window: the next request fails at once
    with pytest.raises(BackendError, match="no healthy sglang server"):
        await backend.generate(ModelRequest(input_ids=PROMPT, gconfig=G(max_new_tokens=4)), 4)
    assert trio.current_time() - t1 < 1.0


async def test_a_server_that_never_answers_fails_over_or_fails_backend_timeout(reward_pool, autojump_clock):
    hung, good = FakeSGLang(), FakeSGLang()
    hung.script = ["hang"] * 100  # accepts each request and never answers; /health still answers
    two = make_remote_backend("sglang", [A, B], transport=mock_transport({A: hung, B: good}), seed=0,
                              attempt_timeout_s=10.0)
    async with open_rollout_engine(two, reward_pool=reward_pool) as engine:
        t0 = trio.current_time()
        resp = await engine.agenerate(ModelRequest(rid="x", input_ids=PROMPT, gconfig=G(max_new_tokens=4)))
        assert resp.output_len == 4 and trio.current_time() - t0 == pytest.approx(10.0, abs=0.5)
    hung = FakeSGLang()
    hung.script = ["hang"] * 100
    one = make_remote_backend("sglang", [A], transport=mock_transport({A: hung}), seed=0, attempt_timeout_s=10.0,
                              health_interval_s=5.0)
    async with open_rollout_engine(one, reward_pool=reward_pool) as engine:
        with pytest.raises(BackendError, match=r"no answer within attempt_timeout_s=10.0 s") as info:
            await engine.agenerate(ModelRequest(rid="y", input_ids=PROMPT, gconfig=G(max_new_tokens=4)))
    assert failure_reason(info.value) == "backend_timeout"
    assert len(hung.generate_calls) == 6 and len(hung.aborts) == 6  # max_attempts, each aborted
    assert RemoteTimeouts().attempt_timeout_s == 1800.0  # bounded by default (was: only the hour of the request)


async def test_episode_timeout_fails_the_episode_with_its_reason(reward_pool, autojump_clock):
    async def handler(req, budget):
        if req.rid.startswith("hang"):
            await trio.sleep_forever()
        return ModelResponse(input_tokens=list(req.input_ids), output_tokens=[7], output_logprobs=[-0.1],
                             output_versions=[0], stop_reason="stop")

    class Episode(RolloutWorkflow):
        async def arun_episode(self, engine, data):
            resp = await engine.agenerate(ModelRequest(rid=data, input_ids=PROMPT, gconfig=G(max_new_tokens=4)))
            return trajectory_from_response(resp, reward=1.0)

    config = EngineConfig(episode_timeout_s=10.0)
    async with open_rollout_engine(MockBackend(handler), config, reward_pool=reward_pool) as engine:
        engine.submit("hang-1", Episode())
        engine.submit("ok", Episode(), group_size=2)
        engine.submit("hang-2", Episode(), group_size=2)
        results = sorted(await engine.wait_results(3), key=lambda r: r.task_id)
        ended_at = trio.current_time()
        stats = engine.statistics()
    assert [(r.status, r.reason) for r in results] == [("failed", "episode_timeout"), ("accepted", None),
                                                       ("failed", "episode_timeout")]
    assert results[0].error_type == "EpisodeTimeoutError" and "episode_timeout_s=10.0" in results[0].error_message
    assert ended_at == pytest.approx(10.0) and stats.failed_by_reason == {"episode_timeout": 2}
    assert EngineConfig().episode_timeout_s is None  # off by default


@pytest.mark.parametrize("value", [-1.0, math.nan, 0.0, math.inf])
def test_the_new_deadlines_are_validated_naming_the_field(value):
    with pytest.raises(InvalidRequestError, match="RemoteTimeouts.no_server_timeout_s"):
        RemoteTimeouts(no_server_timeout_s=value)
    with pytest.raises(InvalidRequestError, match="RemoteTimeouts.attempt_timeout_s"):
        RemoteTimeouts(attempt_timeout_s=value)
    with pytest.raises(ValueError, match="episode_timeout_s"):
        EngineConfig(episode_timeout_s=value)

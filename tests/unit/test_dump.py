"""Unit tier: trajectory dumps (mock backend, real files under tmp_path)."""

from __future__ import annotations

import json

from engine import EngineConfig, MockBackend, ModelRequest, ModelResponse, open_rollout_engine
from engine.trajectory import trajectory_from_response
from engine.testing import build_tiny_tokenizer
from workflows import RolloutWorkflow


async def test_dump_records_have_areal_fields_per_version(tmp_path, reward_pool):
    tok = build_tiny_tokenizer()
    backend = None
    calls = 0

    async def handler(req, budget):  # first segment aborted after 2 tokens, then a weight update
        nonlocal calls
        calls += 1
        ids = tok.encode("ok" if calls % 2 else "go", add_special_tokens=False)
        reason = "abort" if calls % 2 else "stop"
        out = ModelResponse(input_tokens=list(req.input_ids), output_tokens=ids, output_logprobs=[-1.0] * len(ids),
                            output_versions=[backend.version] * len(ids), stop_reason=reason)
        if reason == "abort":
            engine.set_version(backend.version + 1)
        return out

    class Flow(RolloutWorkflow):
        async def arun_episode(self, engine, data):
            prompt = tok.encode(data["q"], add_special_tokens=False)
            resp = await engine.agenerate(ModelRequest(input_ids=prompt))
            return trajectory_from_response(resp, data["r"])

    backend = MockBackend(handler)
    config = EngineConfig(dump_dir=str(tmp_path / "dumps"), max_concurrent_rollouts=1)
    async with open_rollout_engine(backend, config, reward_pool=reward_pool, tokenizer=tok) as engine:
        await engine.rollout_batch([{"q": "hi", "r": 1.0}, {"q": "yo!", "r": 0.0}], Flow())
    files = sorted(p.relative_to(tmp_path / "dumps").as_posix() for p in (tmp_path / "dumps").rglob("*.jsonl"))
    assert files == ["1/trajectories.jsonl", "2/trajectories.jsonl"]  # version when each episode ended
    first = json.loads((tmp_path / "dumps/1/trajectories.jsonl").read_text())
    assert first["task_id"] == 0 and first["sample_idx"] == 0
    assert (first["prompt"], first["completion"]) == ("hi", "okgo")
    assert (first["seqlen"], first["prompt_len"]) == (6, 2)
    assert (first["head_version"], first["tail_version"]) == (0, 1)
    assert first["version_rle"] == [[0, 2], [1, 2]]
    assert first["segments"] == [[0, 2, 0], [2, 6, 1]]
    assert first["reward"] == 1.0

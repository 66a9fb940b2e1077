"""Contract tier: our ``sglang`` client's LoRA adapters on real ``rollout serve --enable-lora``
processes (``python -m engine.serve``) on 127.0.0.1, tiny model on CPU (issue 29).

Shown: rollouts under adapter v0; an update to v1 mid-generation (the request's tokens carry
0 then 1 at the boundary, those before it peft(v0)'s and those after it peft(v1)'s, within
1e-4); v0's name unloaded once drained and its folder removed; every name unloaded when the
client closes, the server alive.  Two tenants (``lora_name`` ``tenant-a`` and ``tenant-b``,
each its own engine and versions) on one server: each tenant's tokens from its own adapter.
``rollout run --backend sglang --lora PATH`` against it, and each refusal one line (a
server without LoRA, a rank above ``--max-lora-rank``, another base model, a name in use).

Real processes: no virtual time; each test is bounded by a real-time ``trio.fail_after``.
The waits for "some tokens decoded" poll the server's live ``decode_steps``.
"""

from __future__ import annotations

import httpx
import pytest
import trio

pytest.importorskip("peft")

from conftest import run_cli  # noqa: E402
from engine import BackendError, ModelRequest, open_rollout_engine  # noqa: E402
from engine.backends.remote import make_remote_backend  # noqa: E402
from engine.testing import build_tiny_lora, build_tiny_model  # noqa: E402
from engine.types import GenerationHyperparameters as G  # noqa: E402
from test_cli_remote import RUN, _error_lines  # noqa: E402
from test_remote_serve import ServeProcess  # noqa: E402
from test_serve_lora_routes import TOLERANCE, max_diff  # noqa: E402

pytestmark = pytest.mark.slow
PROMPT = [3, 10, 20, 30, 40, 50]


@pytest.fixture(scope="module")
def lora_server(tmp_path_factory):
    """One ``rollout serve --enable-lora --max-lora-rank 8`` and one plain ``rollout serve``."""
    root = tmp_path_factory.mktemp("serve-lora")
    model = build_tiny_model(root / "tiny", seed=0)
    procs = [ServeProcess(model, root / "lora.log", "--enable-lora", "--max-lora-rank", "8",
                          "--served-model-name", "tiny", "--batch-window-ms", "20"),
             ServeProcess(model, root / "plain.log")]
    try:
        urls = [p.wait_ready() for p in procs]
        yield urls[0], urls[1], model, root
    finally:
        for p in procs:
            p.terminate()
        codes = [p.stop() for p in procs]
    assert codes == [0, 0], "SIGTERM should stop rollout serve cleanly"


async def _get(url, path):
    async with httpx.AsyncClient(timeout=30) as client:
        answer = await client.get(url + path)
    assert answer.status_code == 200, answer.text
    return answer.json()


async def _served(url):
    ids = [m["id"] for m in (await _get(url, "/v1/models"))["data"]]
    return ids[:1] + sorted(ids[1:])  # the base model first, then the adapters


async def _steps(url):
    return (await _get(url, "/get_server_info"))["backend"]["decode_steps"]


async def _wait_steps(url, at_least, timeout_s=120.0):
    """Poll the server's live decoding-step count until it reaches ``at_least``."""
    with trio.move_on_after(timeout_s):
        while await _steps(url) < at_least:
            await trio.sleep(0.02)
        return
    pytest.fail(f"the server did not decode {at_least} steps within {timeout_s} s")


def _client(url, source, served_dir, **opts):
    return make_remote_backend("sglang", [url], lora=source, lora_dir=str(served_dir), health_interval_s=1.0,
                               request_timeout_s=300.0, **opts)


async def test_adapter_versions_through_our_client(lora_server, tmp_path, reward_pool):
    url, _, model, _ = lora_server
    a = build_tiny_lora(model, tmp_path / "a", seed=1)
    b = build_tiny_lora(model, tmp_path / "b", seed=2)
    served_dir = tmp_path / "served"
    backend = _client(url, a, served_dir)
    short = G(max_new_tokens=24, temperature=1.0, seed=5, ignore_eos=True)
    result = {}
    with trio.fail_after(600):
        async with open_rollout_engine(backend, reward_pool=reward_pool) as engine:
            assert await _served(url) == ["tiny", "lora-v0"]
            first = await engine.agenerate(ModelRequest(input_ids=PROMPT, gconfig=short))

            async def long_request():
                result["r"] = await engine.agenerate(ModelRequest(input_ids=PROMPT, gconfig=G(
                    max_new_tokens=400, temperature=1.0, seed=7, ignore_eos=True)))

            async with trio.open_nursery() as nursery:
                start = await _steps(url)
                nursery.start_soon(long_request)
                await _wait_steps(url, start + 40)  # some tokens under v0 first: the boundary falls inside
                await engine.update_weights(b, version=1)  # pause(abort), load lora-v1, resume
            await backend.adapters.drained()
            assert await _served(url) == ["tiny", "lora-v1"]  # v0 unloaded once drained ...
            assert [p.name.startswith("lora-v1-") for p in served_dir.iterdir()] == [True]  # ... its folder gone
            after = await engine.agenerate(ModelRequest(input_ids=PROMPT, gconfig=short))
            with pytest.raises(BackendError, match="rank 16 is above the --max-lora-rank 8"):
                await engine.update_weights(build_tiny_lora(model, tmp_path / "r16", seed=3, rank=16), version=2)
            lora = engine.statistics().backend.lora
    assert lora.loaded == ("lora-v1",) and lora.unloads == 1 and lora.unload_failures == 0
    assert await _served(url) == ["tiny"] and list(served_dir.iterdir()) == []  # every name unloaded, every folder gone
    info = await _get(url, "/get_server_info")
    assert info["backend"]["lora"]["loaded"] == [] and info["backend"]["lora"]["unloads"] >= 2  # dropped from the model
    async with httpx.AsyncClient(timeout=30) as client:
        assert (await client.get(url + "/health")).status_code == 200  # the server alive at the end

    r = result["r"]
    # An adapter update aborts this client's own requests by id (no server-wide pause: other tenants
    # run on), and rollout serve's /abort_request answers with no token (SGLang's answers with the
    # partial ones): the request is sent again from its start, under v1.
    assert r.output_len == 400 and r.output_versions == [1] * 400
    diffs = {
        "v0": max_diff(model, a, PROMPT, first.output_tokens, first.output_logprobs),
        "the long request, re-sent": max_diff(model, b, PROMPT, r.output_tokens, r.output_logprobs),
        "v1": max_diff(model, b, PROMPT, after.output_tokens, after.output_logprobs),
    }
    assert max(diffs.values()) < TOLERANCE, diffs
    assert first.output_versions == [0] * 24 and after.output_versions == [1] * 24
    assert max_diff(model, a, PROMPT, after.output_tokens, after.output_logprobs) > 1e-2  # v1 is not v0


async def test_two_tenants_on_one_server_each_sample_their_own_adapter(lora_server, tmp_path, reward_pool):
    url, _, model, _ = lora_server
    a0, a1, b0 = (build_tiny_lora(model, tmp_path / n, seed=s) for n, s in (("a0", 11), ("a1", 12), ("b0", 13)))
    tenant_a = _client(url, a0, tmp_path / "served-a", lora_name="tenant-a")
    tenant_b = _client(url, b0, tmp_path / "served-b", lora_name="tenant-b")
    g = G(max_new_tokens=200, temperature=1.0, ignore_eos=True)
    results = {}
    with trio.fail_after(600):
        async with open_rollout_engine(tenant_a, reward_pool=reward_pool) as engine_a, \
                open_rollout_engine(tenant_b, reward_pool=reward_pool) as engine_b:
            assert await _served(url) == ["tiny", "tenant-a-v0", "tenant-b-v0"]

            async def one(key, engine, prompt):
                results[key] = await engine.agenerate(ModelRequest(input_ids=prompt, gconfig=g))

            async with trio.open_nursery() as nursery:
                start = await _steps(url)
                nursery.start_soon(one, "a", engine_a, PROMPT)
                await _wait_steps(url, start + 40)  # tenant a's batch decodes ...
                for i in range(2):  # ... tenant b's requests wait for their own batch
                    nursery.start_soon(one, f"b{i}", engine_b, PROMPT + [60 + i])
                await engine_a.update_weights(a1, version=1)  # aborts a's own request only
            await tenant_a.adapters.drained()
            assert await _served(url) == ["tiny", "tenant-a-v1", "tenant-b-v0"]  # a's v0 unloaded once drained
            stats_a, stats_b = engine_a.statistics(), engine_b.statistics()
    assert await _served(url) == ["tiny"]
    assert stats_a.failed == stats_b.failed == 0 and stats_b.backend.requests_failed == 0
    r = results["a"]
    # An adapter update aborts this client's own requests by id (no server-wide pause: other tenants
    # run on), and rollout serve's /abort_request answers with no token (SGLang's answers with the
    # partial ones): the request is sent again from its start, under v1.
    assert r.output_versions == [1] * 200
    assert max_diff(model, a1, PROMPT, r.output_tokens, r.output_logprobs) < TOLERANCE
    assert stats_b.backend.aborts_sent == 0  # tenant a's update aborted none of tenant b's requests
    for i in range(2):  # tenant b: its own adapter, its own version, whatever tenant a did
        rb = results[f"b{i}"]
        assert rb.output_len == 200 and rb.output_versions == [0] * 200
        assert max_diff(model, b0, PROMPT + [60 + i], rb.output_tokens, rb.output_logprobs) < TOLERANCE
        assert max_diff(model, a0, PROMPT + [60 + i], rb.output_tokens, rb.output_logprobs) > 1e-2


async def test_an_update_storm_fails_no_request_and_leaves_one_name(lora_server, tmp_path, reward_pool):
    """An adapter update every ~0.3 s, 12 of them, while 3 request loops run: no request
    fails, every response's versions only go up, one name is loaded at the end, and the
    server's model holds no adapter once the client closed."""
    url, _, model, _ = lora_server
    sources = [build_tiny_lora(model, tmp_path / f"s{i}", seed=20 + i) for i in range(2)]
    backend = _client(url, sources[0], tmp_path / "served")
    updates, responses, stop = 12, [], trio.Event()
    with trio.fail_after(600):
        async with open_rollout_engine(backend, reward_pool=reward_pool) as engine:
            async def requests(i):
                while not stop.is_set():
                    responses.append(await engine.agenerate(ModelRequest(input_ids=PROMPT + [i], gconfig=G(
                        max_new_tokens=32, temperature=1.0, ignore_eos=True))))

            async with trio.open_nursery() as nursery:
                for i in range(3):
                    nursery.start_soon(requests, i)
                for version in range(1, updates + 1):
                    await trio.sleep(0.3)  # the storm's pace
                    await engine.update_weights(sources[version % 2], version=version)
                stop.set()
            await backend.adapters.drained()
            assert await _served(url) == ["tiny", f"lora-v{updates}"]
            stats = engine.statistics()
    assert stats.failed == 0 and stats.backend.requests_failed == 0 and len(responses) >= 3
    assert all(r.output_versions == sorted(r.output_versions) for r in responses)
    assert stats.backend.lora.loaded == (f"lora-v{updates}",) and stats.backend.lora.unloads == updates
    assert await _served(url) == ["tiny"]
    assert (await _get(url, "/get_server_info"))["backend"]["lora"]["loaded"] == []


def test_rollout_run_with_lora_on_rollout_serve_and_each_refusal_in_one_line(lora_server, tmp_path, capsys):
    url, plain, model, _ = lora_server
    adapter = build_tiny_lora(model, tmp_path / "adapter", seed=1)
    code, _, err = run_cli([*RUN, "--server", url, "--lora", str(adapter), "--out", str(tmp_path / "ok")], capsys)
    assert code == 0, err
    cases = {
        "no LoRA": (plain, adapter, "runs without LoRA: restart it with --enable-lora --max-lora-rank 8"),
        "rank": (url, build_tiny_lora(model, tmp_path / "r16", seed=2, rank=16),
                 "rank 16 is above the --max-lora-rank 8"),
        "base": (url, build_tiny_lora(model, tmp_path / "other", seed=3, base_model_name_or_path="org/OtherModel"),
                 "trained on base model 'org/OtherModel'"),
        "taken": (url, adapter, "is in use on"),
    }
    taken = httpx.post(url + "/load_lora_adapter", json={"lora_name": "lora-v0", "lora_path": str(adapter)}, timeout=60)
    assert taken.status_code == 200, taken.text  # another client of the server holds lora-v0
    lines = {}
    try:
        for case, (server, source, what) in cases.items():
            code, _, err = run_cli([*RUN, "--server", server, "--lora", str(source), "--out", str(tmp_path / case)],
                                   capsys)
            lines[case] = _error_lines(err)
            assert code == 2 and len(lines[case]) == 1 and what in lines[case][0], (case, err)
    finally:
        httpx.post(url + "/unload_lora_adapter", json={"lora_name": "lora-v0"}, timeout=60)
    assert "give each tenant its own lora_name" in lines["taken"][0]  # the name in use: the fix named
    assert httpx.get(url + "/health", timeout=30).status_code == 200
    assert [m["id"] for m in httpx.get(url + "/v1/models", timeout=30).json()["data"]] == ["tiny"]

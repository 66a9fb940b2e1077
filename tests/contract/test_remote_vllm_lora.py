"""Contract tier: LoRA adapters on a real vLLM 0.32 CPU server on 127.0.0.1 (issue 29).

Marked ``vllm`` (and ``slow``): ``pytest --vllm``; fails (never skips) without the vLLM CPU
venv (``$TRIO_ROLLOUT_VLLM_VENV``, as ``test_remote_vllm.py``).  The module starts its own
server with the tools' tiny model and ``--enable-lora --max-lora-rank 8 --max-loras 2``
(``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``: the load/unload routes), besides the options of
``test_remote_vllm.py``; ``TRIO_ROLLOUT_VLLM_LORA_URL`` + ``TRIO_ROLLOUT_VLLM_LORA_MODEL_DIR``
reuse a server already running make_tiny_model.py's model with those options.  Adapters are
rank-8 peft folders built here (:func:`engine.testing.build_tiny_lora`); the backend writes
each version to its own folder under a temporary ``lora_dir`` the server reads.

Shown: rollouts under adapter v0, whose logprobs are transformers + peft's (teacher-forced);
an update to v1 mid-generation: the request's tokens carry 0 then 1 at the boundary, those
before it peft(v0)'s and those after it peft(v1)'s; v0's name unloaded once drained and its
folder removed after; every name this client loaded unloaded at the end, the server alive.
An update storm: an update every ~0.3 s for a minute under 4 request loops, no request
failed, one name left.  Tenants: three engines, each its own ``lora_name``, on the one
server (three adapters above ``--max-loras 2``: vLLM swaps them in its LoRA slots), two of
them updating at their own pace: each tenant's tokens carry its own versions and are
peft's for that version; no tenant's update aborts another's requests; two tenants with one
name are one error.  The tolerance is measured here (TOOLING_NOTES.md: 5e-5 to 6e-5 on
this box).
"""

from __future__ import annotations

import contextlib
import functools
import os
import statistics
import warnings
from collections import defaultdict

import httpx
import pytest
import torch
import trio

pytest.importorskip("peft")

from engine import BackendError, ModelRequest, open_rollout_engine  # noqa: E402
from engine.backends.remote import make_remote_backend  # noqa: E402
from engine.testing import build_tiny_lora  # noqa: E402
from engine.types import GenerationHyperparameters as G  # noqa: E402
from test_remote_vllm import server_state, wait_for  # noqa: E402
from vllm_server import MAX_MODEL_LEN, PROMPT, TIER_OPTIONS, make_tiny_model, require_vllm, vllm_server  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

#: |vLLM logprob - transformers + peft|, float32 on both sides (measured: below 1e-4)
TOLERANCE = 1e-3
#: the issue's bound, for the tenants' tokens (each tenant's version teacher-forced)
TENANT_TOLERANCE = 1e-4
STORM_S = 60.0  # the issue: "an update every few hundred ms for a minute"
STORM_PERIOD_S = 0.3  # an update starts every 0.3 s (at once when the last one took longer)
TENANTS_S = 30.0  # how long the tenants generate and update


@pytest.fixture(scope="module")
def vllm_lora(tmp_path_factory):
    if os.environ.get("TRIO_ROLLOUT_VLLM_LORA_URL"):  # a server already running with this module's options
        yield os.environ["TRIO_ROLLOUT_VLLM_LORA_URL"].rstrip("/"), os.environ["TRIO_ROLLOUT_VLLM_LORA_MODEL_DIR"]
        return
    require_vllm()
    root = tmp_path_factory.mktemp("vllm-lora")
    model_dir = make_tiny_model(root / "tiny-llama")
    with vllm_server(root, model_dir, *TIER_OPTIONS, "--max-model-len", str(MAX_MODEL_LEN),
                     "--no-enable-chunked-prefill", "--enable-lora", "--max-lora-rank", "8", "--max-loras", "2",
                     env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}) as server:
        yield server.url, str(model_dir)


class TimedTransport(httpx.AsyncBaseTransport):
    """httpx's own transport, timing the LoRA load and unload calls: ``ms[path]``."""

    def __init__(self) -> None:
        self.inner = httpx.AsyncHTTPTransport(limits=httpx.Limits(max_connections=None, max_keepalive_connections=256))
        self.ms: dict[str, list[float]] = defaultdict(list)

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        start = trio.current_time()
        response = await self.inner.handle_async_request(request)
        if request.url.path.endswith("_lora_adapter"):  # (its answer comes once the server is done)
            self.ms[request.url.path.rsplit("/", 1)[-1]].append((trio.current_time() - start) * 1e3)
        return response

    async def aclose(self) -> None:
        await self.inner.aclose()


def _p50_max(values):
    return f"p50 {statistics.median(values):.1f} / max {max(values):.1f}" if values else "none"


@functools.lru_cache(maxsize=8)
def _peft(model_dir, adapter):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with warnings.catch_warnings():  # transformers' is_gradient_checkpointing deprecation, inside peft
        warnings.simplefilter("ignore", FutureWarning)
        return PeftModel.from_pretrained(base, adapter).eval()


def _teacher_forced(model, prompt, output):
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + output])).logits[0].float()  # [T, V]
    logp = torch.log_softmax(logits, dim=-1)
    return logp[torch.arange(len(prompt) - 1, len(prompt) + len(output) - 1), torch.tensor(output)]  # [n]


async def _served(url):
    async with httpx.AsyncClient(timeout=30) as client:
        return sorted(m["id"] for m in (await client.get(url + "/v1/models")).json()["data"])


async def test_adapter_versions_on_a_real_server(vllm_lora, tmp_path, reward_pool):
    url, model_dir = vllm_lora
    a = build_tiny_lora(model_dir, tmp_path / "a", seed=1)
    b = build_tiny_lora(model_dir, tmp_path / "b", seed=2)
    served_dir = tmp_path / "served"
    backend = make_remote_backend("vllm", [url], health_interval_s=1.0, health_timeout_s=60.0,
                                  request_timeout_s=300.0, lora=a, lora_dir=str(served_dir))
    with trio.fail_after(600):
        async with open_rollout_engine(backend, reward_pool=reward_pool) as engine:
            assert await _served(url) == ["lora-v0", "tiny"]
            short = G(max_new_tokens=24, temperature=1.0, seed=5, ignore_eos=True)
            first = await engine.agenerate(ModelRequest(input_ids=PROMPT, gconfig=short))
            result = {}

            async def long_request():
                result["r"] = await engine.agenerate(ModelRequest(input_ids=PROMPT, gconfig=G(
                    max_new_tokens=400, temperature=1.0, seed=7, ignore_eos=True)))

            async with trio.open_nursery() as nursery:
                start = (await server_state(url))["generated"]
                nursery.start_soon(long_request)
                # some tokens under v0 first, so that the boundary falls inside the request
                await wait_for(url, lambda s: s["generated"] >= start + 40, "tokens of the long request")
                await engine.update_weights(b, version=1)  # pause(abort), load lora-v1, resume
            await backend.adapters.drained()
            assert await _served(url) == ["lora-v1", "tiny"]  # v0 unloaded once drained ...
            assert [p.name.startswith("lora-v1-") for p in served_dir.iterdir()] == [True]  # ... its folder gone
            after = await engine.agenerate(ModelRequest(input_ids=PROMPT, gconfig=short))
            with pytest.raises(BackendError, match="rank 16 is above the --max-lora-rank 8"):
                await engine.update_weights(build_tiny_lora(model_dir, tmp_path / "r16", seed=3, rank=16), version=2)
            lora = engine.statistics().backend.lora
    assert lora.loaded == ("lora-v1",) and lora.unloads == 1 and lora.unload_failures == 0
    assert await _served(url) == ["tiny"] and list(served_dir.iterdir()) == []  # every name unloaded, every folder gone
    async with httpx.AsyncClient(timeout=30) as client:
        assert (await client.get(url + "/health")).status_code == 200  # the server alive at the end

    r = result["r"]
    k = r.output_versions.index(1)
    assert 0 < k < r.output_len == 400 and r.output_versions == [0] * k + [1] * (400 - k)
    diffs = {
        "v0": (torch.tensor(first.output_logprobs) - _teacher_forced(_peft(model_dir, a), PROMPT,
                                                                     first.output_tokens)).abs().max().item(),
        "before the boundary": (torch.tensor(r.output_logprobs[:k]) - _teacher_forced(
            _peft(model_dir, a), PROMPT, r.output_tokens)[:k]).abs().max().item(),
        "after the boundary": (torch.tensor(r.output_logprobs[k:]) - _teacher_forced(
            _peft(model_dir, b), PROMPT, r.output_tokens)[k:]).abs().max().item(),
        "v1": (torch.tensor(after.output_logprobs) - _teacher_forced(_peft(model_dir, b), PROMPT,
                                                                     after.output_tokens)).abs().max().item(),
    }
    print(f"max |vLLM - peft| logprob: {diffs} (boundary at token {k})")
    assert max(diffs.values()) < TOLERANCE, diffs
    assert first.output_versions == [0] * 24 and after.output_versions == [1] * 24
    other = (torch.tensor(after.output_logprobs) - _teacher_forced(_peft(model_dir, a), PROMPT,
                                                                   after.output_tokens)).abs().max().item()
    assert other > 1e-2  # v1 is not v0: the check above can tell them apart


async def test_an_update_storm_for_a_minute_fails_no_request_and_leaves_one_name(vllm_lora, tmp_path, reward_pool):
    """An adapter update every ~0.3 s for a minute (~200 updates) while 4 request loops
    run: no request fails, every response's versions only go up and name versions that were
    loaded, the server stays up, and at the end one name is loaded and the folders of every
    retired version are gone.  Prints the numbers (updates, requests, load/unload ms)."""
    url, model_dir = vllm_lora
    sources = [build_tiny_lora(model_dir, tmp_path / f"s{i}", seed=10 + i) for i in range(2)]
    served_dir = tmp_path / "served"
    transport = TimedTransport()
    backend = make_remote_backend("vllm", [url], health_interval_s=1.0, health_timeout_s=60.0,
                                  request_timeout_s=300.0, lora=sources[0], lora_dir=str(served_dir),
                                  transport=transport)
    responses, loaded, update_ms, stop = [], {0}, [], trio.Event()
    with trio.fail_after(STORM_S + 300):
        async with open_rollout_engine(backend, reward_pool=reward_pool) as engine:
            async def requests(i):
                while not stop.is_set():
                    responses.append(await engine.agenerate(ModelRequest(input_ids=PROMPT + [i], gconfig=G(
                        max_new_tokens=48, temperature=1.0, ignore_eos=True))))

            async with trio.open_nursery() as nursery:
                for i in range(4):
                    nursery.start_soon(requests, i)
                version, begin = 0, trio.current_time()
                while trio.current_time() < begin + STORM_S:
                    version += 1
                    await trio.sleep_until(begin + version * STORM_PERIOD_S)  # the storm's pace
                    start = trio.current_time()
                    await engine.update_weights(sources[version % 2], version=version)  # load v, unload v-1
                    update_ms.append((trio.current_time() - start) * 1e3)
                    loaded.add(version)
                stop.set()
            await backend.adapters.drained()
            stats = engine.statistics()
            assert await _served(url) == [f"lora-v{version}", "tiny"]  # exactly one name left ...
            assert [p.name.startswith(f"lora-v{version}-") for p in served_dir.iterdir()] == [True]  # ... one folder
    updates = version
    print(f"storm: {updates} updates in {STORM_S:.0f} s, {len(responses)} requests, "
          f"{sum(r.output_len for r in responses)} tokens; update_weights ms {_p50_max(update_ms)}; "
          f"load ms {_p50_max(transport.ms['load_lora_adapter'])}; "
          f"unload ms {_p50_max(transport.ms['unload_lora_adapter'])}; load average {os.getloadavg()}")
    assert updates >= STORM_S and len(responses) >= 4 * 5  # at least one a second (111 at load average 19)
    assert stats.failed == 0 and stats.backend.requests_failed == 0
    assert all(r.output_versions == sorted(r.output_versions) for r in responses)
    assert {v for r in responses for v in r.output_versions} <= loaded
    assert stats.segments_resumed > 0  # the storm did abort requests mid-generation (they resumed)
    assert stats.backend.lora.loaded == (f"lora-v{updates}",) and stats.backend.lora.unloads == updates
    assert len(transport.ms["load_lora_adapter"]) == updates + 1  # v0 at start-up, then one per update
    assert await _served(url) == ["tiny"] and list(served_dir.iterdir()) == []
    async with httpx.AsyncClient(timeout=30) as client:
        assert (await client.get(url + "/health")).status_code == 200


def _tenant_backend(url, tmp_path, name, source, **kwargs):
    return make_remote_backend("vllm", [url], health_interval_s=1.0, health_timeout_s=60.0,
                               request_timeout_s=300.0, lora=source, lora_name=name,
                               lora_dir=str(tmp_path / "served"), **kwargs)


async def test_tenants_on_one_server_each_sample_their_own_versions(vllm_lora, tmp_path, reward_pool):
    """Three tenants (one engine each) generate on the one server for TENANTS_S seconds;
    tenant-a updates its adapter every 0.4 s, tenant-b every 1.1 s, tenant-c never.
    Each tenant's tokens carry its own versions and are peft's under that version of its
    adapter (teacher-forced, within TENANT_TOLERANCE); tenant-c's requests are never
    aborted (no update of another tenant pauses the server); three adapters were served at
    once, above --max-loras 2."""
    url, model_dir = vllm_lora
    seeds = {"tenant-a": (21, 22), "tenant-b": (31, 32), "tenant-c": (41,)}
    sources = {s: build_tiny_lora(model_dir, tmp_path / f"seed{s}", seed=s) for ss in seeds.values() for s in ss}

    def source(tenant, version):
        return sources[seeds[tenant][version % len(seeds[tenant])]]

    backends = {t: _tenant_backend(url, tmp_path, t, source(t, 0)) for t in seeds}
    cadence_s = {"tenant-a": 0.4, "tenant-b": 1.1}
    responses, finals, stop = {t: [] for t in seeds}, {t: 0 for t in seeds}, trio.Event()
    with trio.fail_after(TENANTS_S + 300):
        async with contextlib.AsyncExitStack() as stack:
            engines = {t: await stack.enter_async_context(open_rollout_engine(b, reward_pool=reward_pool))
                       for t, b in backends.items()}
            at_start = await _served(url)

            async def requests(tenant, i):
                while not stop.is_set():
                    responses[tenant].append(await engines[tenant].agenerate(ModelRequest(
                        input_ids=PROMPT + [i], gconfig=G(max_new_tokens=32, temperature=1.0, ignore_eos=True))))

            async def updates(tenant):
                while not stop.is_set():
                    await trio.sleep(cadence_s[tenant])  # the tenant's pace
                    finals[tenant] += 1
                    await engines[tenant].update_weights(source(tenant, finals[tenant]), version=finals[tenant])

            async with trio.open_nursery() as nursery:
                for tenant in seeds:
                    for i in range(2):
                        nursery.start_soon(requests, tenant, i)
                for tenant in cadence_s:
                    nursery.start_soon(updates, tenant)
                await trio.sleep(TENANTS_S)  # how long the test runs
                stop.set()
            for backend in backends.values():
                await backend.adapters.drained()
            stats = {t: e.statistics() for t, e in engines.items()}
            at_end = await _served(url)
    assert at_start == ["tenant-a-v0", "tenant-b-v0", "tenant-c-v0", "tiny"]  # 3 adapters, --max-loras 2
    assert at_end == sorted([f"tenant-a-v{finals['tenant-a']}", f"tenant-b-v{finals['tenant-b']}", "tenant-c-v0",
                             "tiny"])
    assert await _served(url) == ["tiny"]
    assert finals["tenant-a"] >= 10 and finals["tenant-b"] >= 5
    for tenant, stat in stats.items():
        assert stat.failed == 0 and stat.backend.requests_failed == 0 and len(responses[tenant]) >= 2, tenant
        assert stat.backend.lora.current == {tenant: f"{tenant}-v{finals[tenant]}"}
    assert stats["tenant-c"].segments_resumed == 0 and stats["tenant-c"].backend.aborts_sent == 0
    assert stats["tenant-a"].segments_resumed > 0  # its own updates did abort (and resume) its own requests

    worst, other = {}, {}
    for tenant, rs in responses.items():
        for r in rs:
            versions = r.output_versions
            assert versions == sorted(versions) and set(versions) <= set(range(finals[tenant] + 1)), tenant
            for v in sorted(set(versions)):
                lp = _teacher_forced(_peft(model_dir, source(tenant, v)), list(r.input_tokens),
                                     r.output_tokens)
                mine = torch.tensor([v == w for w in versions])
                diff = (torch.tensor(r.output_logprobs) - lp)[mine].abs().max().item()
                worst[tenant] = max(worst.get(tenant, 0.0), diff)
        r = rs[0]
        lp = _teacher_forced(_peft(model_dir, sources[41 if tenant != "tenant-c" else 21]),
                             list(r.input_tokens), r.output_tokens)
        other[tenant] = (torch.tensor(r.output_logprobs) - lp).abs().max().item()
    print(f"tenants: updates {finals}, requests {({t: len(rs) for t, rs in responses.items()})}, "
          f"max |vLLM - peft| {worst}, under another tenant's adapter {other}; load average {os.getloadavg()}")
    assert max(worst.values()) < TENANT_TOLERANCE, worst
    assert min(other.values()) > 1e-2  # another tenant's adapter gives other logprobs: the check can tell


async def test_two_tenants_with_one_lora_name_are_one_clear_error(vllm_lora, tmp_path, reward_pool):
    url, model_dir = vllm_lora
    first = _tenant_backend(url, tmp_path / "one", "lora", build_tiny_lora(model_dir, tmp_path / "a", seed=1))
    second = _tenant_backend(url, tmp_path / "two", "lora", build_tiny_lora(model_dir, tmp_path / "b", seed=2))
    with trio.fail_after(300):
        async with open_rollout_engine(first, reward_pool=reward_pool) as engine:
            await engine.update_weights(build_tiny_lora(model_dir, tmp_path / "c", seed=3), version=1)
            await first.adapters.drained()  # lora-v0 is free on the server again
            with pytest.raises(BackendError, match=r"the LoRA adapter name 'lora' is in use on http://127\.0\.0\.1:"
                                                   r"\d+ by another client \(it serves 'lora-v1'.*own lora_name"):
                async with open_rollout_engine(second, reward_pool=reward_pool):
                    pass
            assert await _served(url) == ["lora-v1", "tiny"]  # the first tenant's adapter, untouched
    assert await _served(url) == ["tiny"] and not (tmp_path / "two" / "served").exists()

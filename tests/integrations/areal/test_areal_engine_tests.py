"""AReaL's own engine tests, run against the adapter.

The bodies of ``test_rollout``, ``test_staleness_control``, ``test_wait_for_task`` and
``test_disk_update_weights_from_fsdp_engine`` are AReaL v1.0.4's
(``tests/test_inference_engines.py``), kept as they are but for: the fixture (the adapter over
the engine's in-process ``hf`` backend on the tiny random Llama instead of a launched
SGLang/vLLM server), the model path, the timeouts of the waits that must time out (10 s /
5 s -> 3 s / 2 s: the tiny model answers in milliseconds) and a subset of the staleness
parametrization (one batch size).  The weight-update test also checks what AReaL's does not:
the tokens after the update carry its version and the engine's logprobs equal the updated
actor's own recomputation (``FSDPPPOActor.compute_logp``) within 1e-4.
"""

from __future__ import annotations

import functools
import os

import pytest

pytest.importorskip("areal", reason="needs the areal venv: make test-integrations")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from areal.api import RolloutWorkflow, WeightUpdateMeta  # noqa: E402
from areal.api.cli_args import GenerationHyperparameters, InferenceEngineConfig  # noqa: E402
from areal.utils import network  # noqa: E402
from areal.utils.data import concat_padded_tensors, get_batch_size  # noqa: E402
from areal.utils.hf_utils import load_hf_tokenizer  # noqa: E402
from areal_doubles import AREAL_WARNINGS, max_logp_error  # noqa: E402

from engine import HFBackend  # noqa: E402
from engine.integrations.areal import AReaLInferenceEngine  # noqa: E402
from engine.testing import build_tiny_model  # noqa: E402

torch.set_num_threads(1)

pytestmark = AREAL_WARNINGS


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    # qwen2: AReaL's FSDPEngine packs sequences and hands the model a per-layer-type mask mapping, which
    # transformers 5.3 reads for Qwen2 (layer types) but not for Llama
    return str(build_tiny_model(tmp_path_factory.mktemp("areal-engine-tests") / "tiny", arch="qwen2"))


@pytest.fixture(scope="module")
def inference_engine(model_path):
    """AReaL's fixture, minus the server: the adapter class, each engine with its own backend."""
    tok = load_hf_tokenizer(model_path)
    return {
        "engine_class": functools.partial(AReaLInferenceEngine, backend=lambda: HFBackend(model_path, tok)),
        "expr_name": "test_trio_rollout_engine",
        "trial_name": "trial_0",
        "model_path": model_path,
    }


# AReaL's test defines ``_dummy_reward_fn`` (always 1.0) here.  The engine's reward workers
# are spawned processes that load a reward function's module by path: this module imports
# torch and AReaL, too slow to load inside a reward's 15 s timeout on a loaded 2-core box.  So
# the same function comes from a module that imports nothing (AReaL's own executor forks its
# workers, which inherit the imports).
from areal_rewards import constant_reward as _dummy_reward_fn  # noqa: E402


@pytest.mark.parametrize("n_samples", [1, 2, 4])
def test_rollout(inference_engine, n_samples):
    """Test engine rollout with different sample sizes."""
    from areal.workflow import RLVRWorkflow

    config = InferenceEngineConfig(
        backend="sglang:d1",
        experiment_name=inference_engine["expr_name"],
        trial_name=inference_engine["trial_name"],
        max_concurrent_rollouts=2,
        consumer_batch_size=2,
        enable_rollout_tracing=True,
        setup_timeout=360,
        max_head_offpolicyness=int(1e10),
    )

    engine = inference_engine["engine_class"](config)
    engine.initialize()

    gconfig = GenerationHyperparameters(max_new_tokens=16, greedy=False)
    tokenizer = load_hf_tokenizer(inference_engine["model_path"])

    workflow = RLVRWorkflow(
        reward_fn=_dummy_reward_fn,
        gconfig=gconfig,
        tokenizer=tokenizer,
        enable_thinking=False,
    )

    data = {
        "messages": [{"role": "user", "content": "Hello, how are you?"}],
    }
    result = engine.rollout_batch([data] * 2, workflow=workflow, group_size=n_samples)
    assert isinstance(result, list)
    concatenated = concat_padded_tensors(result)
    bs = get_batch_size(concatenated)
    assert bs == 2 * n_samples

    class NullWorkflow(RolloutWorkflow):
        async def arun_episode(self, engine, data):
            return None

    # Test workflow returning None
    result = engine.rollout_batch(
        [data] * 2,
        workflow=NullWorkflow(),
    )
    assert result == []

    engine.destroy()
    assert not dist.is_initialized()


@pytest.mark.parametrize("ofp", [0, 1, 4, 16])
@pytest.mark.parametrize("bs", [2])
@pytest.mark.parametrize("n_samples", [2, 1])
def test_staleness_control(inference_engine, bs, ofp, n_samples):
    """Test engine staleness control mechanism."""
    from areal.workflow import RLVRWorkflow

    config = InferenceEngineConfig(
        backend="sglang:d1",
        experiment_name=inference_engine["expr_name"],
        trial_name=inference_engine["trial_name"],
        consumer_batch_size=bs,
        max_head_offpolicyness=ofp,
        enable_rollout_tracing=True,
        setup_timeout=360,
    )

    engine = inference_engine["engine_class"](config)
    engine.initialize()

    gconfig = GenerationHyperparameters(max_new_tokens=2, greedy=False)
    tokenizer = load_hf_tokenizer(inference_engine["model_path"])

    workflow = RLVRWorkflow(
        reward_fn=_dummy_reward_fn,
        gconfig=gconfig,
        tokenizer=tokenizer,
        enable_thinking=False,
    )
    data = {
        "messages": [{"role": "user", "content": "Hello, how are you?"}],
    }
    for _ in range(bs * 2):
        engine.submit(data, workflow=workflow, group_size=n_samples)

    if ofp < 1:
        # Due to controlled offpolicyness, not all requests are committed
        with pytest.raises(TimeoutError):
            engine.wait(count=bs * 2, timeout=3)
    else:
        results = engine.wait(count=bs * 2, timeout=30)
        result = concat_padded_tensors([r for r in results if r is not None])
        assert result["attention_mask"].shape[0] == bs * 2 * n_samples

    # Update model version
    engine.set_version(1)
    print("Updated model version", flush=True)

    # submit again
    for _ in range(bs * 2):
        engine.submit(data, workflow=workflow, group_size=n_samples)

    if ofp < 2:
        # Due to controlled offpolicyness, not all requests are committed
        with pytest.raises(TimeoutError):
            engine.wait(count=bs * 4, timeout=2)
    else:
        # 2 * bs samples haved been retrived above
        results_list = engine.wait(count=bs * 2, timeout=30)
        results = concat_padded_tensors([r for r in results_list if r is not None])
        assert results["attention_mask"].shape[0] == bs * 2 * n_samples

    engine.destroy()
    assert not dist.is_initialized()


def test_wait_for_task(inference_engine):
    """Test wait_for_task functionality with real inference engines."""
    from areal.workflow import RLVRWorkflow

    config = InferenceEngineConfig(
        backend="sglang:d1",
        experiment_name=inference_engine["expr_name"],
        trial_name=inference_engine["trial_name"],
        max_concurrent_rollouts=8,
        consumer_batch_size=4,
        setup_timeout=360,
        max_head_offpolicyness=int(1e10),
    )

    engine = inference_engine["engine_class"](config)
    engine.initialize()

    gconfig = GenerationHyperparameters(max_new_tokens=8, greedy=False, n_samples=1)
    tokenizer = load_hf_tokenizer(inference_engine["model_path"])

    workflow = RLVRWorkflow(
        reward_fn=_dummy_reward_fn,
        gconfig=gconfig,
        tokenizer=tokenizer,
        enable_thinking=False,
    )

    data = {"messages": [{"role": "user", "content": "Hello"}]}

    # Test 1: Wait for specific task
    task_id1 = engine.submit(data, workflow=workflow)
    task_id2 = engine.submit(data, workflow=workflow)
    task_id3 = engine.submit(data, workflow=workflow)

    result2 = engine.wait_for_task(task_id2, timeout=30.0)
    assert result2 is not None
    assert isinstance(result2, dict)

    result1 = engine.wait_for_task(task_id1, timeout=30.0)
    assert result1 is not None

    result3 = engine.wait_for_task(task_id3, timeout=30.0)
    assert result3 is not None

    # Test 2: Invalid task_id raises ValueError
    with pytest.raises(ValueError, match="never submitted"):
        engine.wait_for_task(999999, timeout=1.0)

    # Test 3: Timeout with raise_timeout=False returns None
    slow_task_id = engine.submit(data, workflow=workflow)
    # Immediately try to get it with very short timeout
    result = engine.wait_for_task(slow_task_id, timeout=0.001, raise_timeout=False)
    # Should timeout and return None (task hasn't completed yet)
    # But if it completed fast, that's ok too
    if result is None:
        # Now get it for real
        result = engine.wait_for_task(slow_task_id, timeout=30.0)
        assert result is not None

    # Test 4: Mix wait_for_task with regular wait()
    task_ids = [engine.submit(data, workflow=workflow) for _ in range(4)]

    # Get specific task
    specific_result = engine.wait_for_task(task_ids[1], timeout=30.0)
    assert specific_result is not None

    # Get remaining 3 with regular wait()
    remaining = engine.wait(count=3, timeout=30.0)
    assert len(remaining) == 3
    assert all(r is not None for r in remaining)

    engine.destroy()
    assert not dist.is_initialized()


def test_disk_update_weights_from_fsdp_engine(tmp_path_factory, inference_engine, monkeypatch):
    """Test disk-based weight updates from FSDP engine to inference engine."""

    # setup FSDP engine
    from areal.api import FinetuneSpec
    from areal.api.cli_args import OptimizerConfig, PPOActorConfig
    from areal.engine.fsdp_engine import FSDPPPOActor
    from areal.workflow import RLVRWorkflow

    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("MASTER_ADDR", "localhost")
    monkeypatch.setenv("MASTER_PORT", str(network.find_free_ports(1)[0]))

    engine_config = PPOActorConfig(  # (AReaL's test: TrainEngineConfig; the actor adds compute_logp)
        backend="fsdp:d1",
        experiment_name=inference_engine["expr_name"],
        trial_name=inference_engine["trial_name"],
        path=inference_engine["model_path"],
        optimizer=OptimizerConfig(),
        dtype="float32",
        attn_impl="sdpa",
        temperature=1.0,
    )
    train_engine = FSDPPPOActor(engine_config)
    train_engine.create_process_group()
    inf_engine = None
    try:
        ft_spec = FinetuneSpec(
            total_train_epochs=1, dataset_size=100, train_batch_size=2
        )
        train_engine.initialize(None, ft_spec)
        train_engine.model_version = 100

        # setup name resolve
        import areal.utils.name_resolve as name_resolve
        from areal.api.cli_args import NameResolveConfig

        nfs_record_root = tmp_path_factory.mktemp("nfs_record_path")
        name_resolve_config = NameResolveConfig(
            type="nfs", nfs_record_root=nfs_record_root
        )
        name_resolve.reconfigure(name_resolve_config)

        config = InferenceEngineConfig(
            backend="sglang:d1",
            experiment_name=inference_engine["expr_name"],
            trial_name=inference_engine["trial_name"],
        )
        # initialize inference engine
        inf_engine = inference_engine["engine_class"](config)
        inf_engine.initialize()
        inf_engine.set_version(100)

        # (ours) move the actor away from the weights the engine loaded, so the update shows
        with torch.no_grad():
            for p in train_engine.model.parameters():
                p.mul_(1.1)

        # test update weights
        path = tmp_path_factory.mktemp("update_weights_from_disk")
        update_weight_meta = WeightUpdateMeta(type="disk", path=str(path)).with_version(101)
        train_engine.connect_engine(inf_engine, update_weight_meta)
        train_engine.set_version(100)
        train_engine.update_weights(update_weight_meta)

        # (ours) the engine serves the updated weights, tagged with the update's version
        assert inf_engine.get_version() == 101
        tokenizer = load_hf_tokenizer(inference_engine["model_path"])
        workflow = RLVRWorkflow(reward_fn=_dummy_reward_fn, gconfig=GenerationHyperparameters(max_new_tokens=12),
                                tokenizer=tokenizer)
        data = {"messages": [{"role": "user", "content": "Hello, how are you?"}]}
        batch = inf_engine.rollout_batch([data] * 2, workflow=workflow, group_size=2)
        generated = torch.cat([g["versions"][g["loss_mask"].bool()] for g in batch])
        assert set(generated.tolist()) == {101}
        worst = max_logp_error(train_engine, batch)  # AReaL's own recomputation, row by row
        assert worst < 1e-4, worst
        assert not os.path.exists(update_weight_meta.path)  # clear_checkpoint_after_load
    finally:
        train_engine.destroy()
        if inf_engine is not None:
            inf_engine.destroy()
        assert not dist.is_initialized()

"""Vision RLVR: the tiny random VLM, the built-in shapes dataset, ``VisionRLVRWorkflow`` on
the hf / sim / SGLang / vLLM backends, and ``rollout run --workflow vision_rlvr``."""

from __future__ import annotations

import base64
import io
import json

import numpy as np
import pytest
import torch
import trio
from tensordict import TensorDict

from engine import BackendError, InvalidRequestError, ModelRequest, open_rollout_engine
from engine.backends.base import MockBackend
from engine.backends.hf import HFBackend
from engine.backends.remote import make_remote_backend
from engine.backends.sim import SimBackend
from engine.cli import main
from engine.data import concat_padded_tensors
from engine.datasets import load_dataset
from engine.testing import (
    TINY_IMAGE_TOKEN_ID,
    TINY_VLM_IMAGE_TOKENS,
    build_tiny_model,
    build_tiny_vlm,
    build_tiny_vlm_processor,
)
from engine.types import GenerationHyperparameters, ModelResponse
from fake_servers import FakeSGLang, FakeVLLM, fake_tokens, mock_transport
from workflows import VisionRLVRWorkflow

A = "http://a:1"


def zero_reward(prompt, completions, prompt_ids, completion_ids, **data):
    return 0.0


def answer_reward(prompt, completions, prompt_ids, completion_ids, *, answer, images, **data):
    """Checks that the row's keys (images included) reach the reward as keywords."""
    assert isinstance(answer, int) and len(images) == 1
    return float(answer)


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory):
    return build_tiny_vlm(tmp_path_factory.mktemp("vlm") / "tiny-vlm", seed=0)


@pytest.fixture(scope="module")
def processor(vlm_dir):
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(vlm_dir)


@pytest.fixture(scope="module")
def vlm(vlm_dir):
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(vlm_dir, dtype=torch.float32).eval()


def _png(image) -> bytes:
    with io.BytesIO() as buf:
        image.save(buf, format="PNG")
        return buf.getvalue()


# -- dataset ------------------------------------------------------------------------------------


def test_shapes_dataset_is_deterministic_and_answers_the_red_count():
    a, b = load_dataset("builtin:shapes:12"), load_dataset("builtin:shapes:12")
    assert len(a) == 12 and len(load_dataset("builtin:shapes:12", limit=5)) == 5
    assert len(load_dataset("builtin:shapes")) == 16
    for x, y in zip(a, b):
        assert x["answer"] == y["answer"] and x["shapes"] == y["shapes"]
        assert _png(x["images"][0]) == _png(y["images"][0])  # same pixels
        assert x["answer"] == sum(colour == "red" for _, colour in x["shapes"]) and 1 <= len(x["shapes"]) <= 5
        (image,) = x["images"]
        assert image.mode == "RGB" and image.size == (63, 63)
        (turn,) = x["messages"]
        assert turn["role"] == "user" and [p["type"] for p in turn["content"]] == ["image", "text"]
    assert len({_png(x["images"][0]) for x in a}) == 12
    # the count is visible in the pixels: red pixels appear iff some shape is red
    for x in a:
        pixels = np.asarray(x["images"][0]).astype(int)  # [63, 63, 3]
        red = ((pixels[..., 0] > 200) & (pixels[..., 1] < 60) & (pixels[..., 2] < 60)).sum()
        assert (red > 0) == (x["answer"] > 0)
    with pytest.raises(ValueError, match="builtin:shapes:N"):
        load_dataset("builtin:shapes:x")
    with pytest.raises(ValueError, match="builtin:shapes"):
        load_dataset("builtin:pictures")


# -- the tiny VLM ----------------------------------------------------------------------------------


def test_tiny_vlm_folder_loads_offline_and_processor_expands_images(vlm_dir, processor, vlm):
    assert build_tiny_vlm(vlm_dir) == vlm_dir  # idempotent
    assert type(vlm).__name__ == "LlavaForConditionalGeneration"
    assert vlm.config.image_token_index == TINY_IMAGE_TOKEN_ID
    assert len(processor.tokenizer) == vlm.config.get_text_config().vocab_size == 262
    item = load_dataset("builtin:shapes:1")[0]
    text = processor.apply_chat_template(item["messages"], tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>user\n<image>How many red") and text.endswith("<|im_start|>assistant\n")
    out = processor(images=item["images"], text=[text], return_tensors="pt")
    assert (out["input_ids"] == TINY_IMAGE_TOKEN_ID).sum() == TINY_VLM_IMAGE_TOKENS
    assert out["pixel_values"].shape == (1, 3, 32, 32) and out["pixel_values"].dtype == torch.float32
    # a fresh processor renders identically (what the folder stores is what build_tiny_vlm_processor makes)
    fresh = build_tiny_vlm_processor()
    assert fresh(images=item["images"], text=[text], return_tensors="pt")["input_ids"].tolist() == \
        out["input_ids"].tolist()


# -- hf backend -----------------------------------------------------------------------------------


def _image_request(processor, item, **g):
    from workflows.vision_rlvr import encode_images

    text = processor.apply_chat_template(item["messages"], tokenize=False, add_generation_prompt=True)
    out = processor(images=item["images"], text=[text], return_tensors="pt")
    req = ModelRequest(input_ids=out["input_ids"][0].tolist(), gconfig=GenerationHyperparameters(**g),
                       image_data=encode_images([(im, None) for im in item["images"]]), processor=processor)
    return req, out["pixel_values"]


def _teacher_forced(vlm, prompt, output, pixel_values):
    ids = torch.tensor([prompt + output])
    with torch.no_grad():
        logits = vlm(input_ids=ids, pixel_values=pixel_values).logits[0].float()
    logp = torch.log_softmax(logits, -1)
    pos = torch.arange(len(prompt) - 1, len(prompt) + len(output) - 1)
    return logp[pos, torch.tensor(output)]


@pytest.mark.slow
async def test_hf_backend_generates_from_images_in_one_batch(vlm_dir, processor, vlm, reward_pool):
    items = load_dataset("builtin:shapes:3")
    # greedy, fixed budget: deterministic (the random model may also sample <image>, id 261,
    # like any token; these outputs hold none, so the teacher-forced pass below is well defined)
    reqs = [_image_request(processor, it, greedy=True, ignore_eos=True, max_new_tokens=6) for it in items]
    text_ids = processor.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=True,
                                                       add_generation_prompt=True, return_dict=False)
    backend = HFBackend(vlm_dir, batch_window_s=0.5)
    results: dict[int, ModelResponse] = {}
    async with open_rollout_engine(backend, reward_pool=reward_pool) as engine:
        async def one(i, req):
            results[i] = await engine.agenerate(req)

        async with trio.open_nursery() as nursery:
            for i, (req, _) in enumerate(reqs):
                nursery.start_soon(one, i, req)
            nursery.start_soon(one, 3, ModelRequest(input_ids=list(text_ids), gconfig=GenerationHyperparameters(
                greedy=True, ignore_eos=True, max_new_tokens=6)))
    assert backend.accepts_images and backend.statistics().batches == 1  # images and text in one batch
    for i, (req, pixel_values) in enumerate(reqs):
        resp = results[i]
        assert len(resp.output_tokens) == 6 and TINY_IMAGE_TOKEN_ID not in resp.output_tokens
        ref = _teacher_forced(vlm, req.input_ids, resp.output_tokens, pixel_values)
        assert (ref - torch.tensor(resp.output_logprobs)).abs().max() < 1e-4
    # the images are really used: the same prompt ids with another image give other logprobs
    req0, _ = reqs[0]
    other = _teacher_forced(vlm, req0.input_ids, results[0].output_tokens, reqs[1][1])
    assert (other - torch.tensor(results[0].output_logprobs)).abs().max() > 1e-3


@pytest.mark.slow
async def test_hf_backend_refuses_images_it_cannot_serve(tmp_path, vlm_dir, processor, reward_pool):
    item = load_dataset("builtin:shapes:1")[0]
    req, _ = _image_request(processor, item, max_new_tokens=2)
    text_model = build_tiny_model(tmp_path / "text")
    async with open_rollout_engine(HFBackend(text_model), reward_pool=reward_pool) as engine:
        with pytest.raises(InvalidRequestError, match="image_data: the model LlamaForCausalLM is text-only"):
            await engine.agenerate(ModelRequest(input_ids=[3, 10, 11], image_data=req.image_data))
    async with open_rollout_engine(HFBackend(vlm_dir, mode="continuous", cache_tokens=1024),
                                   reward_pool=reward_pool) as engine:
        with pytest.raises(InvalidRequestError, match="mode='continuous' does not support image_data"):
            await engine.agenerate(req)
    backend = HFBackend(vlm_dir, batch_window_s=0.5)
    async with open_rollout_engine(backend, reward_pool=reward_pool) as engine:
        bad = ModelRequest(input_ids=req.input_ids, image_data=["bm90IGFuIGltYWdl"], processor=processor)
        results = {}

        async def one(name, r):
            try:
                results[name] = await engine.agenerate(r)
            except InvalidRequestError as exc:
                results[name] = exc

        async with trio.open_nursery() as nursery:  # one batch: the bad row fails alone
            nursery.start_soon(one, "bad", bad)
            nursery.start_soon(one, "good", req)
    assert isinstance(results["bad"], InvalidRequestError) and "image_data[0] is not a base64 image" in str(
        results["bad"])
    assert isinstance(results["good"], ModelResponse) and len(results["good"].output_tokens) >= 1
    assert backend.statistics().batches == 1


# -- the workflow --------------------------------------------------------------------------------


@pytest.mark.slow
async def test_episode_on_the_tiny_vlm_carries_image_inputs_through_concat_and_save(
        tmp_path, vlm_dir, processor, reward_pool):
    items = load_dataset("builtin:shapes:2")
    g = GenerationHyperparameters(n_samples=2, max_new_tokens=5, ignore_eos=True)
    workflow = VisionRLVRWorkflow(answer_reward, g, tokenizer=None, processor=processor)
    async with open_rollout_engine(HFBackend(vlm_dir), reward_pool=reward_pool) as engine:
        for item in items:
            engine.submit(item, workflow)
        results = sorted(await engine.wait_results(2), key=lambda r: r.task_id)  # through the result buffer
    assert [r.status for r in results] == ["accepted", "accepted"], [r.error_message for r in results]
    for result, item in zip(results, items):
        traj = result.trajectory
        assert traj.batch_size == (2,)
        assert traj["pixel_values"].shape == (2, 1, 3, 32, 32) and traj["pixel_values"].dtype == torch.float32
        assert traj["num_images"].tolist() == [1, 1] and traj["num_images"].dtype == torch.int32
        expected = processor.image_processor(images=item["images"], return_tensors="pt")["pixel_values"]
        assert torch.equal(traj["pixel_values"][0], expected) and torch.equal(traj["pixel_values"][1], expected)
        assert traj["rewards"].tolist() == [float(item["answer"])] * 2
        prompt = traj["loss_mask"][0] == 0
        assert (traj["input_ids"][0][prompt] == TINY_IMAGE_TOKEN_ID).sum() == TINY_VLM_IMAGE_TOKENS
        n_out = traj["loss_mask"].sum(1)  # sampling: a row may stop early on <|im_end|> or <pad>
        assert ((n_out >= 1) & (n_out <= 5)).all()
        assert (n_out[traj["is_truncated"]] == 5).all() and traj["is_truncated"][n_out < 5].logical_not().all()
    batch = concat_padded_tensors([r.trajectory for r in results])
    assert batch["pixel_values"].shape == (4, 1, 3, 32, 32) and batch["num_images"].tolist() == [1, 1, 1, 1]
    batch.save(tmp_path / "batch")
    loaded = TensorDict.load(tmp_path / "batch")
    assert set(loaded.keys()) == set(batch.keys())
    for key in batch.keys():
        assert torch.equal(loaded[key], batch[key]), key


async def test_images_as_pil_paths_or_bytes_give_the_same_request(tmp_path, processor, reward_pool):
    item = load_dataset("builtin:shapes:1")[0]
    raw = _png(item["images"][0])
    (tmp_path / "img.png").write_bytes(raw)
    seen: list[ModelRequest] = []

    async def handler(req, budget):
        seen.append(req)
        toks, lps = fake_tokens(req.input_ids, 3)
        return ModelResponse(input_tokens=req.input_ids, output_tokens=toks, output_logprobs=lps,
                             output_versions=[0] * 3, stop_reason="length")

    workflow = VisionRLVRWorkflow(zero_reward, GenerationHyperparameters(max_new_tokens=3), None, processor)
    trajs = []
    async with open_rollout_engine(MockBackend(handler), reward_pool=reward_pool) as engine:
        for images in (item["images"], [str(tmp_path / "img.png")], raw, [tmp_path / "img.png"]):
            trajs.append(await workflow.arun_episode(engine, {**item, "images": images}))
        with pytest.raises(InvalidRequestError, match=r"data\['images'\]\[0\]: expected a PIL image"):
            await workflow.arun_episode(engine, {**item, "images": [42]})
        with pytest.raises(InvalidRequestError, match=r"data\['images'\]\[0\]: cannot read"):
            await workflow.arun_episode(engine, {**item, "images": [str(tmp_path / "missing.png")]})
        with pytest.raises(InvalidRequestError, match=r"data\['images'\]\[0\]: not a readable image"):
            await workflow.arun_episode(engine, {**item, "images": [b"not an image"]})
        with pytest.raises(InvalidRequestError, match="1 image part.* 2 image"):
            await workflow.arun_episode(engine, {**item, "images": item["images"] * 2})
        with pytest.raises(InvalidRequestError, match="no 'images' field"):
            await workflow.arun_episode(engine, {"messages": item["messages"]})
    assert len({tuple(r.input_ids) for r in seen}) == 1
    assert all(r.processor is processor for r in seen)
    assert all(torch.equal(t["pixel_values"], trajs[0]["pixel_values"]) for t in trajs)
    # image_data: the PNG of a PIL image (AReaL image2base64), the original bytes otherwise
    assert [base64.b64decode(r.image_data[0]) for r in seen] == [raw] * 4


async def test_prompt_given_as_rendered_text_and_per_token_processor_outputs(processor, reward_pool):
    """AReaL's datasets give ``messages`` as the rendered prompt; a processor output of shape
    [1, prompt_len] (e.g. ``mm_token_type_ids``) becomes per-token, 0 on generated tokens."""

    class TypedProcessor:
        def __init__(self, inner):
            self.inner, self.tokenizer, self.chat_template = inner, inner.tokenizer, inner.chat_template

        def __call__(self, **kwargs):
            out = dict(self.inner(**kwargs))
            out["mm_token_type_ids"] = (out["input_ids"] == TINY_IMAGE_TOKEN_ID).long()
            return out

    async def handler(req, budget):
        return ModelResponse(input_tokens=req.input_ids, output_tokens=[TINY_IMAGE_TOKEN_ID, 7],
                             output_logprobs=[-1.0, -1.0], output_versions=[0, 0], stop_reason="length")

    item = load_dataset("builtin:shapes:1")[0]
    text = processor.apply_chat_template(item["messages"], tokenize=False, add_generation_prompt=True)
    workflow = VisionRLVRWorkflow(zero_reward, GenerationHyperparameters(max_new_tokens=2), None,
                                  TypedProcessor(processor))
    async with open_rollout_engine(MockBackend(handler), reward_pool=reward_pool) as engine:
        traj = await workflow.arun_episode(engine, {**item, "messages": text})
    types = traj["mm_token_type_ids"][0]
    assert types.shape == traj["input_ids"][0].shape and types.dtype == torch.int64
    assert types.sum() == TINY_VLM_IMAGE_TOKENS and types[-2:].tolist() == [0, 0]  # the sampled 261 is not an image


async def test_sim_backend_accepts_image_requests(processor, reward_pool, autojump_clock):
    workflow = VisionRLVRWorkflow(zero_reward, GenerationHyperparameters(n_samples=2, max_new_tokens=8), None,
                                  processor)
    backend = SimBackend(vocab_size=262, eos_token_id=4, seed=0)
    async with open_rollout_engine(backend, reward_pool=reward_pool) as engine:
        batch = await engine.rollout_batch(load_dataset("builtin:shapes:3"), workflow)
    assert batch.batch_size == (6,) and batch["pixel_values"].shape == (6, 1, 3, 32, 32)
    assert backend.statistics().image_requests == 6


async def test_seeded_samples_of_an_image_prompt_differ(processor, reward_pool, autojump_clock):
    """Regression (new-user trial): every sample of a prompt shared the run seed."""
    workflow = VisionRLVRWorkflow(zero_reward, GenerationHyperparameters(n_samples=4, max_new_tokens=8, seed=0),
                                  None, processor)
    backend = SimBackend(vocab_size=262, eos_token_id=4, seed=0, out_len_sigma=0.5)
    async with open_rollout_engine(backend, reward_pool=reward_pool) as engine:
        batch = await engine.rollout_batch(load_dataset("builtin:shapes:1"), workflow)
    gen = batch["loss_mask"].bool()
    assert len({tuple(batch["input_ids"][i][gen[i]].tolist()) for i in range(4)}) == 4


# -- remote backends ------------------------------------------------------------------------------


async def test_sglang_client_sends_image_data(processor, reward_pool, autojump_clock):
    fake = FakeSGLang(length=3)
    backend = make_remote_backend("sglang", [A], transport=mock_transport({A: fake}), seed=0)
    item = load_dataset("builtin:shapes:1")[0]
    workflow = VisionRLVRWorkflow(zero_reward, GenerationHyperparameters(max_new_tokens=8), None, processor)
    async with open_rollout_engine(backend, reward_pool=reward_pool) as engine:
        traj = await workflow.arun_episode(engine, item)
    (call,) = fake.generate_calls
    assert json.loads(json.dumps(call)) == call  # what went over the wire
    (b64,) = call["image_data"]
    assert base64.b64decode(b64) == _png(item["images"][0])
    assert call["input_ids"].count(TINY_IMAGE_TOKEN_ID) == TINY_VLM_IMAGE_TOKENS
    assert traj["input_ids"][0].tolist() == call["input_ids"] + fake_tokens(call["input_ids"], 3)[0]
    assert traj["pixel_values"].shape == (1, 1, 3, 32, 32)


async def test_vllm_client_refuses_image_data_before_sending(processor, reward_pool, autojump_clock):
    fake = FakeVLLM(length=3)
    backend = make_remote_backend("vllm", [A], transport=mock_transport({A: fake}), seed=0)
    item = load_dataset("builtin:shapes:1")[0]
    workflow = VisionRLVRWorkflow(zero_reward, GenerationHyperparameters(max_new_tokens=8), None, processor)
    async with open_rollout_engine(backend, reward_pool=reward_pool) as engine:
        with pytest.raises(InvalidRequestError, match="image_data is not supported by the vllm backend"):
            await workflow.arun_episode(engine, item)
        engine.submit(item, workflow)
        (result,) = await engine.wait_results(1)
        text = await engine.agenerate(ModelRequest(input_ids=[3, 4, 5], gconfig=GenerationHyperparameters(
            max_new_tokens=2)))
    assert result.status == "failed" and result.reason == "invalid_request"
    assert [c["prompt"] for c in fake.generate_calls] == [[3, 4, 5]]  # only the text request was sent
    assert text.output_len == 2


# -- CLI -------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_cli_vision_rlvr_on_the_builtin_tiny_vlm(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TRIO_ROLLOUT_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "out"
    code = main(["run", "--workflow", "vision_rlvr", "--dataset", "builtin:shapes:16", "--model", "builtin:tiny-vlm",
                 "--backend", "hf", "--n-samples", "2", "--max-new-tokens", "8", "--torch-threads", "1",
                 "--out", str(out), "--quiet"])
    _, err = capsys.readouterr()
    assert code == 0, err
    assert (tmp_path / "cache" / "tiny-vlm-llava-seed0" / "config.json").is_file()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["accepted"] == summary["submitted"] == 16 and summary["failed"] == 0
    assert summary["trajectories"] == 32 and summary["model"] == "builtin:tiny-vlm"
    from engine.cli import load_trajectories

    batch = load_trajectories(out)  # every committed shard as one batch
    assert TensorDict.load(next((out / "trajectories").glob("shard-*")))["pixel_values"].ndim == 5
    assert batch.batch_size == (32,)
    assert batch["pixel_values"].shape == (32, 1, 3, 32, 32) and batch["num_images"].tolist() == [1] * 32
    from transformers import AutoProcessor

    proc = AutoProcessor.from_pretrained(tmp_path / "cache" / "tiny-vlm-llava-seed0")
    items = load_dataset("builtin:shapes:16")
    first = proc.image_processor(images=items[0]["images"], return_tensors="pt")["pixel_values"]
    assert torch.equal(batch["pixel_values"][0], first)  # rows in task order, samples of task 0 first
    prompt = (batch["loss_mask"] == 0) & batch["attention_mask"]
    assert ((batch["input_ids"] == TINY_IMAGE_TOKEN_ID) & prompt).sum(1).tolist() == [TINY_VLM_IMAGE_TOKENS] * 32
    rows = [json.loads(line) for line in (out / "rollouts.jsonl").read_text().splitlines()]
    assert len(rows) == 32 and rows[0]["prompt"].count("<image>") == TINY_VLM_IMAGE_TOKENS


def test_cli_vision_rlvr_needs_an_image_model(tmp_path, capsys):
    model = build_tiny_model(tmp_path / "text")
    code = main(["run", "--workflow", "vision_rlvr", "--dataset", "builtin:shapes:2", "--model", model,
                 "--backend", "sim", "--out", str(tmp_path / "out"), "--quiet"])
    _, err = capsys.readouterr()
    assert code == 2 and "vision_rlvr" in err and "no image processor" in err, err


@pytest.mark.slow
async def test_rollout_serve_passes_image_data_to_the_model(vlm_dir, processor, vlm, reward_pool):
    """The SGLang client -> ``rollout serve``'s app (in-process, over httpx's ASGITransport) ->
    the hf backend, which reads the images with the folder's own processor."""
    import httpx

    from engine.serve import SGLangServer

    server = SGLangServer(HFBackend(vlm_dir), model_path=vlm_dir)
    transport = httpx.ASGITransport(app=server.app)

    item = load_dataset("builtin:shapes:1")[0]
    g = GenerationHyperparameters(max_new_tokens=6, greedy=True, ignore_eos=True)
    workflow = VisionRLVRWorkflow(zero_reward, g, None, processor)
    backend = make_remote_backend("sglang", [A], transport=transport, seed=0)
    with trio.fail_after(120):
        async with trio.open_nursery() as nursery:
            await nursery.start(server.run)
            async with open_rollout_engine(backend, reward_pool=reward_pool) as engine:
                traj = await workflow.arun_episode(engine, item)
                with pytest.raises(BackendError, match=r"HTTP 400.*image_data\[0\] is not a base64 image"):
                    await engine.agenerate(ModelRequest(input_ids=[3, 10], image_data=["bm90IGFuIGltYWdl"]))
            nursery.cancel_scope.cancel()
    ids = traj["input_ids"][0].tolist()
    gen = traj["loss_mask"][0].bool()
    prompt, output = [t for t, m in zip(ids, gen) if not m], [t for t, m in zip(ids, gen) if m]
    assert len(output) == 6 and TINY_IMAGE_TOKEN_ID not in output
    ref = _teacher_forced(vlm, prompt, output, traj["pixel_values"][0])
    assert (ref - traj["logprobs"][0][gen]).abs().max() < 1e-4


async def test_image_data_is_validated_and_kept_when_a_segment_is_resumed(reward_pool):
    """An aborted segment is re-sent as prompt + partial output: with the same images."""
    segments: list[ModelRequest] = []

    async def handler(req, budget):
        segments.append(req)
        n, reason = (2, "abort") if len(segments) == 1 else (budget, "length")
        toks, lps = fake_tokens(req.input_ids, n)
        return ModelResponse(input_tokens=req.input_ids, output_tokens=toks, output_logprobs=lps,
                             output_versions=[0] * n, stop_reason=reason)

    async with open_rollout_engine(MockBackend(handler), reward_pool=reward_pool) as engine:
        with pytest.raises(InvalidRequestError, match="image_data must be a list of base64 strings"):
            await engine.agenerate(ModelRequest(input_ids=[3, 4], image_data="aGk="))
        resp = await engine.agenerate(ModelRequest(input_ids=[3, TINY_IMAGE_TOKEN_ID, 4], image_data=["aGk="],
                                                   gconfig=GenerationHyperparameters(max_new_tokens=5)))
    assert resp.output_len == 5 and len(segments) == 2
    assert segments[1].input_ids == [3, TINY_IMAGE_TOKEN_ID, 4] + resp.output_tokens[:2]
    assert [s.image_data for s in segments] == [["aGk="], ["aGk="]]

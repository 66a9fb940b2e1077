"""RLVR on image + text prompts (AReaL ``areal/workflow/vision_rlvr.py``).

A dataset row holds ``images`` and ``messages``.  The transformers processor renders
the chat (its chat template writes one image placeholder per image part), expands the
placeholders to the model's image tokens and turns the images into the model's image
inputs (``pixel_values``, and ``image_grid_thw`` / ``image_sizes`` / ... when the model
needs them).  The request carries the prompt ids plus the images as base64 strings
(``ModelRequest.image_data``, AReaL's field; PNG for PIL images, the original file bytes
for paths and bytes) and the processor (``ModelRequest.processor``); the reward is
called with keyword arguments as in :class:`~workflows.rlvr.RLVRWorkflow`.

Trajectory fields, on top of those of :class:`~workflows.rlvr.RLVRWorkflow`
(``engine.data.TRAJECTORY_SCHEMA`` plus ``reward_is_fallback``), for a row of ``B``
samples (``B = gconfig.n_samples``):

- every tensor the processor returns besides ``input_ids`` / ``attention_mask``, under
  its own name, as the processor returns it with a leading batch dim: e.g. the tiny
  Llava's ``pixel_values [B, n_images, 3, 32, 32] float32``, Qwen2-VL's
  ``pixel_values [B, n_patches, D]`` and ``image_grid_thw [B, n_images, 3] int64``;
  per-token processor outputs (``[1, prompt_len]``, e.g. ``mm_token_type_ids``) become
  ``[B, T]`` with 0 on generated tokens (AReaL);
- ``num_images [B] int32``.

These are plain tensors, so :func:`engine.data.concat_padded_tensors` (which right-pads
every non-batch dim with 0: padded images are all-zero, padded ``image_grid_thw`` rows
are ``0, 0, 0``; ``num_images`` tells the real count), the engine's result buffer and
``TensorDict.save`` / ``TensorDict.load`` handle them.  AReaL instead keeps
``multi_modal_input = [{"pixel_values": ..., "image_grid_thw": ...}]``, a list of dicts
per row (non-tensor data).
"""

from __future__ import annotations

import base64
import io
import os
from collections.abc import Callable
from typing import Any

import torch
import trio

from engine.chat import check_messages
from engine.errors import InvalidRequestError
from engine.trajectory import trajectory_from_response
from engine.types import GenerationHyperparameters, ModelRequest
from engine.workflow import EpisodeEngine

from .base import sample_gconfig
from ._samples import sample_rows
from ._text import decode
from .rlvr import RLVRWorkflow

__all__ = ["IMAGE_PART_TYPES", "VisionRLVRWorkflow", "build_vision_workflow", "encode_images", "read_images"]

#: Message content parts that stand for one image (HF ``"image"``, OpenAI ``"image_url"``).
IMAGE_PART_TYPES = ("image", "image_url")
_TEXT_FIELDS = ("input_ids", "attention_mask")


class VisionRLVRWorkflow(RLVRWorkflow):
    """Generate ``gconfig.n_samples`` completions of one image + text prompt and score them.

    Args:
        reward_fn: as in :class:`~workflows.rlvr.RLVRWorkflow` (called with the row's
            keys, ``images`` included, as keyword arguments).
        gconfig: sampling parameters; stop/pad ids of ``tokenizer`` are merged in.
        tokenizer: a tokenizer, a path to one, or ``None`` (the processor's).
        processor: a transformers multimodal processor (``processor(images=..., text=...)``
            with a chat template), or a path that ``AutoProcessor`` loads.
        enable_thinking: passed to the chat template when not ``None``.

    ``data`` must hold ``"images"`` (one image or a list; each a ``PIL.Image``, a file
    path, or the bytes of an image file) and ``"messages"`` (a chat whose content parts
    of type ``"image"``/``"image_url"`` mark where the images go, one part per image, in
    order; or an already rendered prompt string with the processor's placeholders, as
    AReaL's datasets give).

    Returns from :meth:`arun_episode`: a trajectory of batch ``[n_samples]`` (fields in
    the module docstring).

    Raises (the episode fails with reason ``invalid_request``):
        InvalidRequestError: ``images`` or ``messages`` is missing or malformed, an image
            cannot be read or decoded (names ``images[i]``), or the number of image parts
            in ``messages`` differs from the number of images.
    """

    def __init__(
        self,
        reward_fn: Callable[..., Any],
        gconfig: GenerationHyperparameters,
        tokenizer: Any,
        processor: Any,
        enable_thinking: bool | None = None,
    ) -> None:
        if isinstance(processor, (str, os.PathLike)):
            from transformers import AutoProcessor

            processor = AutoProcessor.from_pretrained(str(processor))
        if processor is None or not callable(processor):
            raise InvalidRequestError(f"processor: expected a transformers processor or a path, got {processor!r}")
        super().__init__(reward_fn, gconfig, tokenizer if tokenizer is not None else processor.tokenizer,
                         enable_thinking=enable_thinking)
        self.processor = processor
        self._limiter: trio.CapacityLimiter | None = None  # one processor call at a time (shared tokenizer)

    async def arun_episode(self, engine: EpisodeEngine, data: dict[str, Any]):
        if not isinstance(data, dict) or "images" not in data or "messages" not in data:
            missing = "data" if not isinstance(data, dict) else ("images" if "images" not in data else "messages")
            raise InvalidRequestError(f"VisionRLVRWorkflow: the dataset row has no {missing!r} field")
        images = await read_images(data["images"])
        if self._limiter is None:
            self._limiter = trio.CapacityLimiter(1)
        input_ids, image_data, image_fields, token_fields = await trio.to_thread.run_sync(
            self._process, data["messages"], images, limiter=self._limiter)
        prompt_text: list[str] = []

        async def one_sample(i: int) -> Any:
            req = ModelRequest(input_ids=input_ids, gconfig=sample_gconfig(self._sample_cfg, i),
                               tokenizer=self.tokenizer,
                               image_data=image_data, processor=self.processor)
            resp = await engine.agenerate(req)
            if not prompt_text:
                prompt_text.append(decode(self.tokenizer, resp.input_tokens, False))
            scored = await self._reward(engine, resp, data, prompt_text[0])
            traj = trajectory_from_response(resp, scored.reward, reward_is_fallback=scored.is_fallback)
            for key, value in image_fields.items():
                traj[key] = value  # [1, ...]
            for key, value in token_fields.items():  # [1, prompt_len] -> [1, T], 0 on generated tokens
                full = torch.zeros((1, resp.input_len + resp.output_len), dtype=value.dtype)
                full[:, : value.shape[1]] = value
                traj[key] = full
            traj["num_images"] = torch.full((1,), len(images), dtype=torch.int32)
            return traj

        return await sample_rows(self.gconfig.n_samples, one_sample)

    def _process(self, messages: Any, images: list[tuple[Any, bytes | None]]):
        """In a worker thread: render, run the processor, encode the images.

        Returns ``(input_ids, image_data, image_fields, token_fields)``."""
        pil_images = [image for image, _ in images]
        if isinstance(messages, str):
            text = messages
        elif isinstance(messages, list) and all(isinstance(m, dict) for m in messages):
            parts = sum(1 for m in messages if isinstance(m.get("content"), list)
                        for p in m["content"] if isinstance(p, dict) and p.get("type") in IMAGE_PART_TYPES)
            if parts != len(pil_images):
                raise InvalidRequestError(f"data['messages'] has {parts} image part(s) but data['images'] holds "
                                          f"{len(pil_images)} image(s); give one part per image")
            check_messages(messages, "VisionRLVRWorkflow: data")
            kwargs = {"enable_thinking": self.enable_thinking} if self.enable_thinking is not None else {}
            renderer = self.processor if getattr(self.processor, "chat_template", None) else self.tokenizer
            text = renderer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)
        else:
            raise InvalidRequestError(f"data['messages']: expected a chat (list of dicts) or a rendered prompt "
                                      f"string, got {type(messages).__name__}")
        out = self.processor(images=pil_images or None, text=[text], padding=False, return_tensors="pt")
        input_ids = [int(t) for t in out["input_ids"][0].tolist()]
        image_fields: dict[str, torch.Tensor] = {}
        token_fields: dict[str, torch.Tensor] = {}
        for key, value in out.items():
            if key in _TEXT_FIELDS:
                continue
            if not isinstance(value, torch.Tensor):
                try:
                    value = torch.as_tensor(value)
                except (TypeError, ValueError, RuntimeError):
                    continue  # not tensor-like (e.g. a list of strings): not a model input we can carry
            if value.dim() == 2 and tuple(value.shape) == (1, len(input_ids)):
                token_fields[key] = value
            else:
                image_fields[key] = value.unsqueeze(0)
        return input_ids, encode_images(images), image_fields, token_fields


async def read_images(images: Any) -> list[tuple[Any, bytes | None]]:
    """``data["images"]`` -> ``[(PIL.Image, original file bytes or None)]``.

    Accepts one image or a list of them; each a ``PIL.Image.Image``, a ``str`` /
    ``os.PathLike`` file path (read with ``trio.Path``), or ``bytes`` / ``bytearray``
    of an image file.

    Raises:
        InvalidRequestError: naming ``images[i]``, for another type, a missing file,
            or bytes PIL cannot decode.
    """
    from PIL import Image, UnidentifiedImageError

    items = list(images) if isinstance(images, (list, tuple)) else [images]
    result: list[tuple[Any, bytes | None]] = []
    for i, item in enumerate(items):
        if isinstance(item, Image.Image):
            result.append((item, None))
            continue
        if isinstance(item, (str, os.PathLike)):
            try:
                raw = await trio.Path(item).read_bytes()
            except OSError as exc:
                raise InvalidRequestError(f"data['images'][{i}]: cannot read {str(item)!r}: {exc}") from None
        elif isinstance(item, (bytes, bytearray, memoryview)):
            raw = bytes(item)
        else:
            raise InvalidRequestError(f"data['images'][{i}]: expected a PIL image, a file path or bytes, "
                                      f"got {type(item).__name__}")
        try:
            image = Image.open(io.BytesIO(raw))
            image.load()
        except (UnidentifiedImageError, OSError, ValueError) as exc:
            raise InvalidRequestError(f"data['images'][{i}]: not a readable image ({exc})") from None
        result.append((image, raw))
    return result


def encode_images(images: list[tuple[Any, bytes | None]]) -> list[str] | None:
    """Base64 strings for ``ModelRequest.image_data`` (AReaL ``image2base64``: PNG for a
    PIL image; the original bytes of a file or bytes input), or ``None`` for no image."""
    if not images:
        return None
    encoded = []
    for image, raw in images:
        if raw is None:
            with io.BytesIO() as buffer:
                image.save(buffer, format="PNG")
                raw = buffer.getvalue()
        encoded.append(base64.b64encode(raw).decode("ascii"))
    return encoded


def load_vision_processor(model: str | None, *, flag: str = "--workflow vision_rlvr") -> Any:
    """The ``AutoProcessor`` of ``model`` (resolved by :func:`engine.models.resolve_model`,
    e.g. ``builtin:tiny-vlm``).

    Raises:
        InvalidRequestError: the model folder has no image processor (not a vision model).
    """
    from transformers import AutoProcessor

    from engine.models import resolve_model

    path = resolve_model(model)
    try:
        processor = AutoProcessor.from_pretrained(path)
    except (OSError, ValueError, KeyError) as exc:
        raise InvalidRequestError(f"{flag}: model {model!r} has no image processor "
                                  f"({exc}); use an image-text-to-text model such as builtin:tiny-vlm") from None
    if not hasattr(processor, "image_processor"):
        raise InvalidRequestError(f"{flag}: model {model!r} has no image processor; use an "
                                  "image-text-to-text model such as builtin:tiny-vlm")
    return processor


def build_vision_workflow(args: Any, reward_fn: Callable[..., Any], gconfig: GenerationHyperparameters,
                          tokenizer: Any) -> VisionRLVRWorkflow:
    """A :class:`VisionRLVRWorkflow` whose processor is loaded from ``args.model``
    (:func:`load_vision_processor`)."""
    return VisionRLVRWorkflow(reward_fn, gconfig, tokenizer, load_vision_processor(args.model))

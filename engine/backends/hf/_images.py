"""The ``hf`` backend's image path: ``ModelRequest.image_data`` -> the model's image kwargs.

Runs in the generate thread.  Each request's base64 image files are decoded with PIL and
passed through its processor's ``image_processor`` (the request's ``processor``, else the
backend's); each output (``pixel_values``, ``image_grid_thw``, ``image_sizes``, ...) is
concatenated over the requests of the batch in row order, which is how image-text-to-text
models in transformers pair image features with the image tokens of ``input_ids``.
"""

from __future__ import annotations

import base64
import binascii
import io
from collections import defaultdict
from typing import Any

from ...errors import InvalidRequestError
from ...types import ModelRequest

__all__ = ["image_inputs"]


def image_inputs(requests: list[ModelRequest], default_processor: Any, *, device: Any,
                 dtype: Any) -> tuple[dict[str, Any], dict[int, InvalidRequestError]]:
    """Returns ``(kwargs, errors)``: the image kwargs for ``generate`` (floating tensors
    cast to ``dtype``, all on ``device``) over the requests that carry images, and the
    :class:`InvalidRequestError` of each request whose images could not be read, by index
    (those requests are left out of ``kwargs``)."""
    import torch
    from PIL import Image, UnidentifiedImageError

    parts: dict[str, list[Any]] = defaultdict(list)
    errors: dict[int, InvalidRequestError] = {}
    for i, req in enumerate(requests):
        if not req.image_data:
            continue
        processor = req.processor if req.processor is not None else default_processor
        image_processor = getattr(processor, "image_processor", processor)
        images = []
        try:
            for k, item in enumerate(req.image_data):
                try:
                    raw = base64.b64decode(item.split(",", 1)[1] if item.startswith("data:") else item, validate=True)
                    image = Image.open(io.BytesIO(raw))
                    image.load()
                except (binascii.Error, ValueError, UnidentifiedImageError, OSError) as exc:
                    raise InvalidRequestError(f"request {req.rid}: image_data[{k}] is not a base64 image "
                                              f"file ({exc})") from None
                images.append(image)
            out = image_processor(images=images, return_tensors="pt")
        except InvalidRequestError as exc:
            errors[i] = exc
            continue
        except Exception as exc:  # the processor refused these images
            errors[i] = InvalidRequestError(f"request {req.rid}: image_data: the image processor failed: {exc!r}")
            continue
        for key, value in out.items():
            parts[key].append(torch.as_tensor(value))
    kwargs = {}
    for key, values in parts.items():
        value = torch.cat(values, dim=0).to(device)
        kwargs[key] = value.to(dtype) if value.is_floating_point() else value
    return kwargs, errors

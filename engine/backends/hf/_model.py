"""The ``hf`` backend's one loaded model, and the rules both batchers share.

:class:`LoadedModel` loads a transformers model (a causal LM, or an image-text-to-text
model when the config has a ``vision_config``), its tokenizer and (image models) its
processor; reads the context length; and reads and loads new weights.  The helpers below
it are the request rules both batchers apply identically: :func:`stop_ids`,
:meth:`LoadedModel.unsupported`, :meth:`LoadedModel.fit_context`,
:meth:`LoadedModel.stop_string_cut` and :func:`tag_versions`.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from ...errors import BackendError
from ...types import ModelRequest
from ._jobs import GenerationJob

__all__ = ["NO_TOP_K", "LoadedModel", "auto_model_class", "stop_ids", "tag_versions"]

logger = logging.getLogger(f"rollout.{__name__}")  # the package's one logging namespace

#: ``gconfig.top_k`` at or above this means "no top-k" (AReaL's default).
NO_TOP_K = 100_000_000
#: config fields holding a model's context length, in the order they are tried
_CONTEXT_FIELDS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")


def auto_model_class(image_text_to_text: bool) -> Any:
    """``AutoModelForImageTextToText`` for a model with a vision tower, else
    ``AutoModelForCausalLM``."""
    if image_text_to_text:
        from transformers import AutoModelForImageTextToText

        return AutoModelForImageTextToText
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM


def stop_ids(tokenizer: Any, req: ModelRequest) -> set[int]:
    """The ids that end ``req``: ``gconfig.stop_token_ids`` plus the tokenizer's EOS
    unless ``ignore_eos``."""
    stop = set(req.gconfig.stop_token_ids)
    if not req.gconfig.ignore_eos and tokenizer.eos_token_id is not None:
        stop.add(int(tokenizer.eos_token_id))
    return stop


def tag_versions(version: int, n: int, boundaries: list[tuple[int, int]]) -> list[int]:
    """The ``output_versions`` of ``n`` tokens decoded from ``version``, where each
    ``(step, new_version)`` of ``boundaries`` (in order) says: tokens at index >= ``step``
    came after an in-place weight update to ``new_version``."""
    versions = [version] * n
    for step, new_version in boundaries:
        versions[step:] = [new_version] * max(0, n - step)
    return versions


class LoadedModel:
    """A transformers model, its tokenizer and processor, loaded once per backend.

    Args:
        spec: a local HF folder or hub id (loaded by :meth:`load`), or a loaded
            ``PreTrainedModel`` (then ``tokenizer`` is required).
        tokenizer: optional tokenizer (loaded from ``spec`` when omitted).
        device: ``"cuda"`` when available else ``"cpu"`` by default.
        dtype: ``"auto"`` (bfloat16 on CUDA, float32 on CPU), or a torch dtype name.

    After :meth:`load`: ``model`` (eval mode, on ``device``, its generation config's
    ``eos_token_id`` cleared: stops are per request), ``tokenizer``, ``processor``
    (image models, when the folder has one), ``accepts_images``, ``device``,
    ``vocab_size`` and ``context_length`` (tokens, ``None`` when the config names none).
    """

    def __init__(self, spec: Any, tokenizer: Any = None, *, device: str | None = None, dtype: str = "auto") -> None:
        self.spec = spec
        self.model: Any = None if isinstance(spec, str) else spec
        self.tokenizer = tokenizer
        self.processor: Any = None
        self.accepts_images = False
        self.device: str = device or ""
        self._device = device
        self._dtype = dtype
        self.vocab_size = 0
        self.context_length: int | None = None

    def load(self) -> None:
        """Load (blocking: call it in a thread).  Raises what transformers raises."""
        import torch
        from transformers import AutoTokenizer

        device = self._device or ("cuda" if torch.cuda.is_available() else "cpu")
        if self._dtype == "auto":
            dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
        else:
            dtype = getattr(torch, self._dtype)
        if self.model is None:
            from transformers import AutoConfig

            is_vlm = getattr(AutoConfig.from_pretrained(self.spec), "vision_config", None) is not None
            self.model = auto_model_class(is_vlm).from_pretrained(self.spec, dtype=dtype)
        self.accepts_images = getattr(self.model.config, "vision_config", None) is not None
        if self.accepts_images and isinstance(self.spec, str):
            from transformers import AutoProcessor

            try:
                self.processor = AutoProcessor.from_pretrained(self.spec)
            except (OSError, ValueError) as exc:  # requests may still bring their own processor
                logger.warning("hf backend: no processor in %s (%s)", self.spec, exc)
        self.model.to(device=device, dtype=dtype).eval()
        # Stops are ours (per request, ``ignore_eos`` honoured): without this,
        # ``generate`` falls back to the model's default eos and ends rows early.
        self.model.generation_config.eos_token_id = None
        if self.tokenizer is None:
            self.tokenizer = AutoTokenizer.from_pretrained(self.spec)
        self.device = device
        config = self.model.config.get_text_config()  # a VLM's language model holds these
        self.vocab_size = int(config.vocab_size)
        self.context_length = next((getattr(config, name) for name in _CONTEXT_FIELDS
                                    if isinstance(getattr(config, name, None), int)), None)

    # -- request rules (both batchers) ----------------------------------------------------
    def fit_context(self, job: GenerationJob) -> str | None:
        """Enforce the model's context length (as ``rollout serve`` does): clamp
        ``job.budget`` so that prompt + output fits, or say why nothing fits."""
        context = self.context_length
        if context is None:
            return None
        n = len(job.request.input_ids)
        if n >= context:
            return (f"input_ids has {n} tokens, at or over the model's context of {context} tokens "
                    "(max_position_embeddings): no room to generate")
        job.budget = min(job.budget, context - n)
        return None

    def unsupported(self, req: ModelRequest) -> str | None:
        """Why this model cannot serve ``req`` (``frequency_penalty``; images on a
        text-only model, malformed, or with no processor), else ``None``."""
        if req.gconfig.frequency_penalty:
            return "the hf backend does not support gconfig.frequency_penalty"
        if req.image_data is not None:
            if not self.accepts_images:
                return (f"image_data: the model {type(self.model).__name__} is text-only (no vision_config); "
                        "image requests need an image-text-to-text model")
            if not isinstance(req.image_data, list) or not all(isinstance(x, str) for x in req.image_data):
                return "image_data must be a list of base64 strings"
            if req.processor is None and self.processor is None:
                return ("image_data: no processor to read the images with: set ModelRequest.processor, or load "
                        "the model from a folder that has one")
        return None

    def stop_string_cut(self, tokens: list[int], stops: list[str] | None) -> int | None:
        """The shortest prefix length ``k`` whose decoded text contains one of ``stops``
        (the output is cut there), or ``None``."""
        if not stops:
            return None
        for k in range(1, len(tokens) + 1):
            text = self.tokenizer.decode(tokens[:k], skip_special_tokens=False)
            if any(s in text for s in stops):
                return k
        return None

    # -- weights ----------------------------------------------------------------------------
    def read_state(self, source: Any) -> dict[str, Any]:
        """A state dict from ``source``: a checkpoint folder (``from_pretrained``, same
        architecture, in the model's dtype) or a mapping ``{name: tensor}``.  Blocking."""
        if isinstance(source, (str, Path)):
            model_class = auto_model_class(self.accepts_images)
            return model_class.from_pretrained(str(source), dtype=self.model.dtype).state_dict()
        return dict(source)

    def load_state(self, state: dict[str, Any]) -> None:
        """Copy ``state`` into the model's parameters (strict).  Blocking.

        A key may be left out when it is a tied alias of a given one (same storage in the
        model, e.g. ``lm_head.weight`` tied to the embeddings): trainers that stream
        ``named_parameters()`` (OpenRLHF, verl) send tied weights once.

        Raises:
            BackendError: missing (untied) or unexpected keys, or a shape mismatch; the
                old weights stay.
        """
        import torch

        own = self.model.state_dict()
        unexpected = sorted(set(state) - set(own))
        given = {own[k].data_ptr() for k in state if k in own}
        missing = sorted(k for k in own if k not in state and own[k].data_ptr() not in given)
        if unexpected or missing:
            raise BackendError(f"update_weights: the new weights do not fit the model: missing keys {missing}, "
                               f"unexpected keys {unexpected}")
        try:
            with torch.no_grad():
                self.model.load_state_dict(state, strict=False)
        except (RuntimeError, KeyError) as exc:
            raise BackendError(f"update_weights: the new weights do not fit the model: {exc}") from exc

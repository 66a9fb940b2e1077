"""A vLLM worker extension whose reload is correct on vLLM's CPU backend (vLLM 0.32).

This file runs **inside the vLLM server's worker processes**, not in this package: it imports
only ``vllm`` and ``torch``, and its folder (:func:`engine.backends.remote.vllm_worker_dir`)
goes on the server's ``PYTHONPATH``::

    PYTHONPATH=<vllm_worker_dir()> VLLM_SERVER_DEV_MODE=1 vllm serve MODEL \\
        --worker-extension-cls rollout_vllm_worker.RolloutWorkerExtension ...

The bug it works around (vLLM 0.32.0, CPU platform, models with tied word embeddings, e.g.
the tools' tiny Llama, Qwen2.5-0.5B, SmolLM2): ``collective_rpc reload_weights`` reloads every
layer that the checkpoint names, then re-runs its ``process_weights_after_loading``.  The
Llama-family loaders skip ``lm_head.weight`` when the embeddings are tied, so the LM head
loads nothing ("ParallelLMHead: Failed to load weights" in the server log) and the layerwise
reload (``model_loader/reload/layerwise.py``) puts its old tensors back without processing
it.  On GPU that is harmless (the head reads the shared, updated embedding parameter), but
on CPU ``process_weights_after_loading`` prepacks the head's GEMM weight into a separate
oneDNN / sgl-kernel buffer (``layers/utils.py: dispatch_cpu_unquantized_gemm``), and that
buffer keeps the weights the server started with: the body runs the new weights, the
logits come from the old head.  Measured here: logprobs off by 0.8-1.6 nats from the new
weights, and equal (to 1e-5) to a model with the new body and the old head.

:meth:`RolloutWorkerExtension.rollout_reload_weights` calls the stock reload, then re-runs
``process_weights_after_loading`` of every LM-head / embedding layer, which repacks them
from their (updated) parameters; on GPU that re-run does nothing.

A failed reload is worse than an error (vLLM 0.32, measured on CPU): the layer-by-layer
reload (``initialize_layerwise_reload``) first moves every layer to the meta device and
puts a layer's tensors back only once the checkpoint has loaded it, so a reload that fails
-- even at once, for a path that is not a folder on the server, which vLLM then takes for a
Hub repository id ("Cannot find an appropriate cached snapshot folder") -- leaves the model on
meta tensors and the next request kills the engine core (``onednn_mm`` on Meta tensors).
So the extension first checks what it can without touching the model and refuses with a
``ValueError`` naming the path: an absolute path to a folder on this machine that holds
weight files, and the tensor shapes of its ``*.safetensors`` headers against those of the
checkpoint loaded last (at first the folder the server started from; a tensor of another
shape means another model, e.g. a trainer that trains something else than what is served).
A reload that still fails midway is reported as such, with the fix: restart the server.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Any

__all__ = ["RolloutWorkerExtension", "check_same_shapes", "check_weights_folder", "checkpoint_shapes", "refusal"]

#: the checkpoint files vLLM's default loader reads
WEIGHT_FILES = ("*.safetensors", "*.bin", "*.pt")


def refusal(reason: str, weights_path: str) -> ValueError:
    """The error of a reload refused before anything was loaded: the reason first (vLLM
    relays a worker's error inside a longer answer, which clients may cut), the path last."""
    return ValueError(f"rollout_reload_weights: nothing was loaded: {reason} (weights_path {weights_path!r})")


def check_weights_folder(weights_path: str) -> None:
    """Raise ``ValueError`` (:func:`refusal`: the reason and the fix) unless ``weights_path``
    is an absolute path to a folder on this machine that holds weight files (:data:`WEIGHT_FILES`)."""
    where = "a folder the server can read at the same path (shared storage when the trainer runs elsewhere)"
    if not os.path.isabs(weights_path):
        raise refusal(f"not an absolute path (the server would look it up in its own working directory, "
                      f"{os.getcwd()}, or on the Hugging Face Hub): send the absolute path of {where}", weights_path)
    folder = Path(weights_path)
    if not folder.is_dir():
        raise refusal(f"no such folder on this server ({os.uname().nodename}), which reads the path on its own "
                      f"machine: write the checkpoint to {where}", weights_path)
    if not any(any(folder.glob(pattern)) for pattern in WEIGHT_FILES):
        raise refusal(f"no weight files ({', '.join(WEIGHT_FILES)}) in the folder: write the checkpoint there "
                      "(save_pretrained) first", weights_path)


def checkpoint_shapes(folder: str) -> dict[str, list[int]] | None:
    """Tensor name -> shape of every ``*.safetensors`` file in ``folder``, from the files'
    headers (no tensor is read); ``None`` when ``folder`` is no local folder with such files.

    Raises:
        ValueError: a file's header cannot be read (:func:`refusal`, naming the file).
    """
    files = sorted(Path(folder).glob("*.safetensors")) if folder and Path(folder).is_dir() else []
    if not files:
        return None
    shapes: dict[str, list[int]] = {}
    for file in files:
        try:
            with open(file, "rb") as handle:  # the format: u64 little-endian header size, then a JSON header
                (size,) = struct.unpack("<Q", handle.read(8))
                header = json.loads(handle.read(size))
            shapes.update((name, list(entry["shape"])) for name, entry in header.items() if name != "__metadata__")
        except (OSError, ValueError, struct.error, TypeError, KeyError, AttributeError) as exc:
            raise refusal(f"{file.name} is not a readable safetensors file ({type(exc).__name__}: {exc})",
                          folder) from exc
    return shapes


def check_same_shapes(served: dict[str, list[int]], new: dict[str, list[int]], weights_path: str) -> None:
    """Raise ``ValueError`` (:func:`refusal`) when a tensor of both checkpoints has another
    shape in ``new``."""
    wrong = [name for name in sorted(new.keys() & served.keys()) if new[name] != served[name]]
    if wrong:
        name = wrong[0]
        raise refusal(f"not a checkpoint of the served model: {len(wrong)} tensor(s) have other shapes, e.g. "
                      f"{name} {new[name]} (served: {served[name]})", weights_path)


class RolloutWorkerExtension:
    """Mixed into vLLM's worker class by ``--worker-extension-cls`` (methods reachable by
    ``POST /collective_rpc {"method": name, "kwargs": {...}}`` in dev mode)."""

    def rollout_reload_weights(self, weights_path: str) -> dict[str, Any]:
        """Reload the checkpoint folder ``weights_path`` in place (``reload_weights`` with
        ``is_checkpoint_format=True``), then reprocess the embedding and LM-head layers.

        Returns ``{"reprocessed": [module names]}`` (JSON for the HTTP answer).

        Raises:
            ValueError: ``weights_path`` is not an absolute path to a folder on this machine
                with weight files (:func:`check_weights_folder`), or a tensor there has another
                shape than in the checkpoint loaded last (:func:`check_same_shapes`); nothing
                was loaded.
            RuntimeError: the reload failed midway; the model is partly replaced (the
                message says so and names the cause): restart the server.
        """
        check_weights_folder(weights_path)
        worker: Any = self
        new = checkpoint_shapes(weights_path)
        served = getattr(worker, "_rollout_served_shapes", None)
        if served is None:  # the first reload: the folder the server started from (a Hub id: None)
            served = checkpoint_shapes(str(worker.vllm_config.model_config.model))
        if served is not None and new is not None:
            check_same_shapes(served, new, weights_path)
        try:
            worker.reload_weights(weights_path=weights_path, is_checkpoint_format=True)
        except Exception as exc:
            raise RuntimeError(
                f"rollout_reload_weights: the reload failed midway ({type(exc).__name__}: {exc}), so this "
                "server's model is now partly replaced (vLLM reloads in place, layer by layer) and its next request "
                "may kill it: restart the server (an error about shapes means the checkpoint is not the served "
                f"model's) (weights_path {weights_path!r})") from exc
        if new is not None:  # the reference for the next reload (the trainer may delete this folder)
            worker._rollout_served_shapes = new
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

        model = worker.model_runner.get_model()
        done = []
        with set_current_vllm_config(worker.vllm_config):
            for name, module in model.named_modules():
                method = getattr(module, "quant_method", None)
                if isinstance(module, VocabParallelEmbedding) and method is not None \
                        and not module.weight.is_meta and module.weight.numel():
                    method.process_weights_after_loading(module)
                    done.append(name)
        return {"reprocessed": done}

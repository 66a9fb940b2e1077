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
"""

from __future__ import annotations

from typing import Any

__all__ = ["RolloutWorkerExtension"]


class RolloutWorkerExtension:
    """Mixed into vLLM's worker class by ``--worker-extension-cls`` (methods reachable by
    ``POST /collective_rpc {"method": name, "kwargs": {...}}`` in dev mode)."""

    def rollout_reload_weights(self, weights_path: str) -> dict[str, Any]:
        """Reload the checkpoint folder ``weights_path`` in place (``reload_weights`` with
        ``is_checkpoint_format=True``), then reprocess the embedding and LM-head layers.

        Returns ``{"reprocessed": [module names]}`` (JSON for the HTTP answer).
        """
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

        worker: Any = self
        worker.reload_weights(weights_path=weights_path, is_checkpoint_format=True)
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

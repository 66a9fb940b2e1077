"""``vllm``: vLLM's OpenAI-compatible ``/v1/completions`` API, kept importable here; the
backend lives in :mod:`engine.backends.remote.vllm`."""

from .remote import WORKER_EXTENSION, VLLMBackend, vllm_abort_id, vllm_worker_dir

__all__ = ["VLLMBackend", "WORKER_EXTENSION", "vllm_abort_id", "vllm_worker_dir"]

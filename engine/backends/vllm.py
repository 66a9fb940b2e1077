"""``vllm``: vLLM's OpenAI-compatible ``/v1/completions`` API, kept importable here; the
backend lives in :mod:`engine.backends.remote.vllm`."""

from .remote import VLLMBackend, vllm_abort_id

__all__ = ["VLLMBackend", "vllm_abort_id"]

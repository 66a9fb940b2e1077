"""Benchmark scripts and harnesses (``benchmarks/README.md``).  Importable: ``rollout
bench --backend hf|sglang|vllm`` runs :mod:`benchmarks.async_vs_sync`."""

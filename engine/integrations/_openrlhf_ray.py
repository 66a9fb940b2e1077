"""OpenRLHF's Ray trainer on trio-rollout engines: ``create_vllm_engines`` replaced (OpenRLHF 0.11.2).

``openrlhf/cli/train_ppo_ray.py`` builds its rollout engines with
``openrlhf.trainer.ray.create_vllm_engines(...)`` (Ray actors of ``RolloutRayActor``, each a
``vllm.AsyncLLMEngine``) and then only calls methods on them: ``generate_responses`` and
``get_num_unfinished_requests`` (``SamplesGenerator``), ``init_process_group`` /
``update_weight`` / ``update_weight_cuda_ipc`` / ``reset_prefix_cache`` (``ActorPPOTrainer``),
``sleep`` / ``wake_up`` (``--vllm.enable_sleep``), ``pause_generation`` / ``resume_generation``
(``PPOTrainerAsync``).  :func:`install` swaps in :func:`create_engines`, which builds Ray actors
of :class:`TrioRolloutActor` (the same methods, over our engine), so the trainer runs unchanged::

    # train.py: python train.py <train_ppo_ray's flags> --vllm.sync_with_ray --vllm.sync_backend gloo
    import runpy
    from engine.integrations.openrlhf import install
    install()
    runpy.run_module("openrlhf.cli.train_ppo_ray", run_name="__main__", alter_sys=True)

:func:`install` imports ``openrlhf.trainer.ray``, whose ``vllm_engine`` module imports ``vllm``:
the trainer's machine needs vllm installed (as OpenRLHF's trainer does anyway); the engine
actors import neither vllm nor DeepSpeed.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
import importlib
from typing import Any

from ..errors import InvalidRequestError

__all__ = ["OpenRLHFRayOptions", "TrioRolloutActor", "create_engines", "install"]


@dataclass(frozen=True, kw_only=True)
class OpenRLHFRayOptions:
    """How :func:`create_engines` builds each engine actor.

    Attributes:
        num_gpus_per_engine, num_cpus_per_engine: the Ray resources of one actor.
        backend_kwargs: keyword arguments of :class:`engine.HFBackend` (``device``, ``dtype``,
            ``mode``, ...); the model is OpenRLHF's ``--actor.model_name_or_path``.
        engine_config: the :class:`engine.EngineConfig` of each engine (None: defaults).
        config: the :class:`~engine.integrations.openrlhf.OpenRLHFConfig` (None: defaults with
            ``max_model_len`` from OpenRLHF's ``--data.max_len``).
    """

    num_gpus_per_engine: float = 0.0
    num_cpus_per_engine: float = 1.0
    backend_kwargs: dict[str, Any] = field(default_factory=dict)
    engine_config: Any = None
    config: Any = None


class TrioRolloutActor:
    """OpenRLHF's ``RolloutRayActor`` API over a trio-rollout engine (an ``hf`` backend on
    ``pretrain``), run as a Ray actor by :func:`create_engines`.  Every method forwards to
    :class:`~engine.integrations.openrlhf.OpenRLHFEngine`."""

    def __init__(self, pretrain: str, *, max_model_len: int, agent_func_path: str | None, remote_rm_url: Any,
                 options: OpenRLHFRayOptions, seed: int = 0) -> None:
        from transformers import AutoTokenizer

        from ..backends.hf import HFBackend
        from ..sync import RolloutEngineThread
        # by name: engine.integrations.openrlhf re-exports this module's names (no import cycle)
        adapter = importlib.import_module("engine.integrations.openrlhf")
        OpenRLHFConfig, OpenRLHFEngine, load_executor = (adapter.OpenRLHFConfig, adapter.OpenRLHFEngine,
                                                         adapter.load_executor)

        tokenizer = AutoTokenizer.from_pretrained(pretrain)
        self._thread = RolloutEngineThread(HFBackend(pretrain, tokenizer, **options.backend_kwargs),
                                           options.engine_config).start()
        config = options.config or OpenRLHFConfig(max_model_len=max_model_len)
        self.llm = OpenRLHFEngine(self._thread, tokenizer, config,
                                  executor=load_executor(agent_func_path, remote_rm_url))

    async def generate(self, prompt_token_ids: list[int], sampling_params: Any, multi_modal_data: Any = None) -> Any:
        return await self.llm.generate(prompt_token_ids, sampling_params, multi_modal_data)

    async def generate_responses(self, prompt: Any, label: Any, sampling_params: Any, max_length: int,
                                 hf_tokenizer: Any, num_samples: int = 1, images: Any = None) -> list[dict[str, Any]]:
        return await self.llm.generate_responses(prompt, label, sampling_params, max_length, hf_tokenizer,
                                                 num_samples, images)

    def get_num_unfinished_requests(self) -> int:
        return self.llm.get_num_unfinished_requests()

    async def init_process_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                                 group_name: str, backend: str = "nccl", use_ray: bool = False) -> None:
        await self.llm.init_process_group(master_address, master_port, rank_offset, world_size, group_name,
                                          backend, use_ray)

    async def update_weight(self, name: str, dtype: Any, shape: Any, empty_cache: bool = False) -> None:
        await self.llm.update_weight(name, dtype, shape, empty_cache)

    async def update_weight_cuda_ipc(self, name: str, dtype: Any, shape: Any, ipc_handles: Any = None,
                                     empty_cache: bool = False) -> None:
        await self.llm.update_weight_cuda_ipc(name, dtype, shape, ipc_handles, empty_cache)

    async def update_weights(self, source: Any, version: int | None = None) -> int:
        return await self.llm.update_weights(source, version=version)

    async def get_version(self) -> int:
        return await self.llm.get_version()

    async def reset_prefix_cache(self) -> None:
        await self.llm.reset_prefix_cache()

    async def pause_generation(self) -> None:
        await self.llm.pause_generation()

    async def resume_generation(self) -> None:
        await self.llm.resume_generation()

    async def sleep(self, level: int = 1) -> None:
        await self.llm.sleep(level)

    async def wake_up(self, tags: Any = None) -> None:
        await self.llm.wake_up(tags)

    def statistics(self) -> Any:
        return self.llm.statistics()

    def close(self) -> None:
        """Stop the engine (its thread, workers); the actor can then be killed."""
        self._thread.close()


def create_engines(num_engines: int, tensor_parallel_size: int, pretrain: str, seed: int, full_determinism: bool,
                   enable_prefix_caching: bool, enforce_eager: bool, max_model_len: int, shared_pg: Any = None,
                   gpu_memory_utilization: Any = None, vllm_enable_sleep: bool = False, logprobs_mode: Any = None,
                   agent_func_path: str | None = None, remote_rm_url: Any = None, max_images_per_prompt: int = 0,
                   *, options: OpenRLHFRayOptions | None = None) -> list[Any]:
    """``create_vllm_engines``' signature (``openrlhf/trainer/ray/vllm_engine.py``): ``num_engines``
    Ray actors of :class:`TrioRolloutActor`.  The vLLM-only arguments (``seed`` aside) are
    accepted and ignored: ``shared_pg`` (placement is by ``options``' resources),
    ``gpu_memory_utilization``, ``enforce_eager``, ``enable_prefix_caching``, ``full_determinism``,
    ``vllm_enable_sleep`` (``sleep`` / ``wake_up`` are no-ops).

    Raises:
        InvalidRequestError: ``tensor_parallel_size != 1``, ``max_images_per_prompt > 0``, or a
            ``logprobs_mode`` other than None / ``"processed_logprobs"`` (our logprobs are of
            the processed distribution).
    """
    import ray

    options = options or OpenRLHFRayOptions()
    if tensor_parallel_size != 1:
        raise InvalidRequestError(f"--vllm.tensor_parallel_size {tensor_parallel_size}: a trio-rollout engine "
                                  "actor is one process; use --vllm.tensor_parallel_size 1 and more engines")
    if max_images_per_prompt:
        raise InvalidRequestError("--data.max_images_per_prompt: images are not supported by the trio-rollout "
                                  "OpenRLHF adapter yet")
    if logprobs_mode not in (None, "processed_logprobs"):
        raise InvalidRequestError(f"logprobs_mode {logprobs_mode!r}: trio-rollout returns processed logprobs "
                                  "(after temperature/top-k/top-p) only")
    actor = ray.remote(TrioRolloutActor).options(num_gpus=options.num_gpus_per_engine,
                                                 num_cpus=options.num_cpus_per_engine)
    return [actor.remote(pretrain, max_model_len=max_model_len, agent_func_path=agent_func_path,
                         remote_rm_url=remote_rm_url, options=options, seed=seed + i) for i in range(num_engines)]


def install(options: OpenRLHFRayOptions | None = None) -> Any:
    """Make OpenRLHF's trainer build trio-rollout engines: replaces ``create_vllm_engines`` in
    ``openrlhf.trainer.ray`` (what ``train_ppo_ray`` imports) and in an already imported
    ``openrlhf.cli.train_ppo_ray``.  Returns a function that puts the originals back.

    Raises:
        ImportError: OpenRLHF (or the vllm it imports there) is missing.
    """
    import openrlhf.trainer.ray as orl_ray

    def create(*args: Any, **kwargs: Any) -> list[Any]:
        return create_engines(*args, **kwargs, options=options)

    targets = [orl_ray]
    cli = sys.modules.get("openrlhf.cli.train_ppo_ray")
    if cli is not None:
        targets.append(cli)
    originals = [(module, module.create_vllm_engines) for module in targets]
    for module in targets:
        module.create_vllm_engines = create

    def uninstall() -> None:
        for module, original in originals:
            module.create_vllm_engines = original

    return uninstall

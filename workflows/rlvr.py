"""Single-turn RL with verifiable rewards (AReaL ``areal/workflow/rlvr.py``).

chat template -> ``ModelRequest`` -> ``engine.agenerate`` -> reward in the worker
pool -> trajectory.  With ``gconfig.n_samples = n`` the ``n`` samples of one prompt
are generated concurrently in a child nursery (cancelling the episode cancels all
of them) and returned as one trajectory of batch ``[n]``, rows ordered by sample
index.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import trio

from engine.data import concat_padded_tensors
from engine.episode_context import episode_id, sample_index
from engine.imports import resolve_reward_fn
from engine.trajectory import trajectory_from_response
from engine.types import GenerationHyperparameters, ModelRequest, ModelResponse, derive_seed

from .base import RolloutWorkflow

__all__ = ["RLVRWorkflow", "default_get_input_ids"]


def default_get_input_ids(tokenizer: Any, data: dict[str, Any], enable_thinking: bool) -> list[int]:
    """Render ``data["messages"]`` with the tokenizer's chat template (generation
    prompt added) and return the prompt token ids."""
    kwargs = {"enable_thinking": enable_thinking} if enable_thinking is not None else {}
    backend = _rust_backend(tokenizer)
    if backend is not None:  # what tokenize=True does, minus transformers' per-call overhead
        text = tokenizer.apply_chat_template(data["messages"], tokenize=False, add_generation_prompt=True, **kwargs)
        return backend.encode(text, add_special_tokens=False).ids
    ids = tokenizer.apply_chat_template(
        data["messages"], tokenize=True, add_generation_prompt=True, return_dict=False, **kwargs
    )
    return list(ids)


def _rust_backend(tokenizer: Any) -> Any:
    """The ``tokenizers.Tokenizer`` behind a fast tokenizer whose encode/decode add
    nothing on top of it (no clean-up of spaces), else None."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return None
    return backend


def _decode(tokenizer: Any, ids: list[int], skip_special_tokens: bool) -> str:
    backend = _rust_backend(tokenizer)
    if backend is not None:
        return backend.decode(ids, skip_special_tokens=skip_special_tokens)
    return tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


class RLVRWorkflow(RolloutWorkflow):
    """Generate ``gconfig.n_samples`` completions of one chat prompt and score them.

    Args:
        reward_fn: ``reward_fn(prompt, completions, prompt_ids, completion_ids, **data)
            -> float``; picklable (it runs in a worker process), or an ``async def``
            (runs in-process under the same timeout policy); or an import string
            naming one (``"pkg.module:fn"``, ``"path/to/file.py:fn"``), resolved
            and checked here (:func:`engine.imports.resolve_reward_fn`).
        gconfig: sampling parameters; stop/pad ids of ``tokenizer`` are merged in.
            Validated here (:class:`~engine.errors.InvalidRequestError` naming the
            field, e.g. ``n_samples must be >= 1``).
        tokenizer: a transformers tokenizer with a chat template, or a path to one.
        enable_thinking: passed to the chat template when not ``None``.
        get_input_ids_fn: ``(tokenizer, data, enable_thinking) -> list[int]``.

    ``data`` must hold ``"messages"`` (a chat); every key is passed to the reward
    function as a keyword argument (GSM8K rows carry ``answer``).

    Seeds (ours): with ``gconfig.seed`` set (the run seed), each request gets its own
    seed ``derive_seed(gconfig.seed, task_id, group sample, sample)``: the samples of a
    prompt differ, and a run with the same seed (and the same task ids: ``submit(...,
    task_id=i)``) repeats row for row on a backend that honours per-request seeds.

    Returns from :meth:`arun_episode`: a trajectory of batch ``[n_samples]`` with
    the fields of ``engine.data.TRAJECTORY_SCHEMA`` plus ``reward_is_fallback
    [n_samples] bool`` (the reward timed out on every attempt and is the pool's
    fallback value).

    Raises:
        RewardError: ``reward_fn`` cannot be resolved, is not callable, or cannot
            be sent to a reward worker process (one error at construction, not one
            per episode).
    """

    def __init__(
        self,
        reward_fn: Callable[..., Any] | str,
        gconfig: GenerationHyperparameters,
        tokenizer: Any,
        enable_thinking: bool | None = None,
        get_input_ids_fn: Callable[[Any, dict[str, Any], Any], list[int]] = default_get_input_ids,
    ) -> None:
        if isinstance(tokenizer, str):
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(tokenizer)
        self.reward_fn = resolve_reward_fn(reward_fn)
        self.tokenizer = tokenizer
        self.gconfig = gconfig.new_with_stop_and_pad_token_ids(tokenizer)
        self.gconfig.validate()  # n_samples=0 etc.: refused here, before any episode runs
        self.enable_thinking = enable_thinking
        self.get_input_ids_fn = get_input_ids_fn
        self._sample_cfg = self.gconfig.new(n_samples=1)  # shared by every request (never mutated)

    async def arun_episode(self, engine: Any, data: dict[str, Any]):
        input_ids = self.get_input_ids_fn(self.tokenizer, data, self.enable_thinking)
        n = self.gconfig.n_samples
        sample_cfg = self._sample_cfg
        trajectories: list[Any] = [None] * n
        run_seed = self.gconfig.seed
        item, group_sample = episode_id.get(), sample_index.get()

        prompt_text: list[str] = []  # decoded once per episode, shared by its samples

        async def one_sample(i: int) -> None:
            cfg = sample_cfg if run_seed is None else sample_cfg.new(seed=derive_seed(run_seed, item, group_sample, i))
            req = ModelRequest(input_ids=input_ids, gconfig=cfg, tokenizer=self.tokenizer)
            resp = await engine.agenerate(req)
            if not prompt_text:
                prompt_text.append(_decode(self.tokenizer, resp.input_tokens, False))
            scored = await self._reward(engine, resp, data, prompt_text[0])
            traj = trajectory_from_response(resp, scored.reward, reward_is_fallback=scored.is_fallback)
            trajectories[i] = traj

        if n == 1:  # no child nursery and task for the common case
            await one_sample(0)
            return trajectories[0]
        async with trio.open_nursery() as nursery:
            for i in range(n):
                nursery.start_soon(one_sample, i)
        return concat_padded_tensors(trajectories)

    async def _reward(self, engine: Any, resp: ModelResponse, data: dict[str, Any], prompt: str) -> Any:
        """Score one sample in the engine's reward pool -> ``rewards.RewardOutcome``
        (``prompt``: the decoded prompt, special tokens kept)."""
        completion = _decode(self.tokenizer, resp.output_tokens, self.gconfig.skip_special_tokens)
        return await engine.reward_pool.score(
            self.reward_fn, prompt, completion, resp.input_tokens, resp.output_tokens, **data
        )

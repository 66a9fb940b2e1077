"""Single-turn RL with verifiable rewards (AReaL ``areal/workflow/rlvr.py``).

chat template -> ``ModelRequest`` -> ``engine.agenerate`` -> reward in the worker
pool -> trajectory.  With ``gconfig.n_samples = n`` the ``n`` samples of one prompt
are generated concurrently in a child nursery (cancelling the episode cancels all
of them) and returned as one trajectory of batch ``[n]``, rows ordered by sample
index.

CPU per episode (ours): the prompt of a dataset item is rendered and encoded
once and kept in a small cache keyed by its messages (the samples of a group,
the members of a group and later epochs reuse it); completions (and the
prompt) reach the reward as :class:`rewards.TokenText` (token ids decoded in
the reward worker, off the event loop) when the tokenizer is a plain fast one.
"""

from __future__ import annotations

import collections
import functools
from array import array
from collections.abc import Awaitable, Callable
from typing import Any

from engine.chat import check_messages, encode_prompt, render_chat
from engine.context import episode_id, sample_index
from engine.imports import resolve_reward_fn
from engine.trajectory import trajectory_from_response
from engine.types import GenerationHyperparameters, ModelRequest, ModelResponse, derive_seed
from engine.workflow import EpisodeEngine, RolloutWorkflow
from rewards import TokenText, rust_tokenizer, tokenizer_file

from ._samples import sample_rows
from ._text import decode

__all__ = ["RLVRWorkflow", "default_get_input_ids"]


def default_get_input_ids(tokenizer: Any, data: dict[str, Any], enable_thinking: bool) -> list[int]:
    """Render ``data["messages"]`` with the tokenizer's chat template (generation
    prompt added) and return the prompt token ids."""
    kwargs = {"enable_thinking": enable_thinking} if enable_thinking is not None else {}
    backend = rust_tokenizer(tokenizer)
    if backend is not None:  # what tokenize=True does, minus transformers' per-call overhead
        text = render_chat(tokenizer, data["messages"], **kwargs)  # the template rendered once per chat structure
        return encode_prompt(backend, text)  # the pieces between special tokens, repeated ones cached
    check_messages(data["messages"], "RLVRWorkflow: data")  # (render_chat checks on its own)
    ids = tokenizer.apply_chat_template(
        data["messages"], tokenize=True, add_generation_prompt=True, return_dict=False, **kwargs
    )
    return list(ids)


#: a value's type in a prompt key, so that equal keys mean equal messages (``1``, ``1.0`` and ``True``
#: are equal in Python but render differently)
_KEY_TAGS = {str: "s", int: "i", bool: "b", float: "f", type(None): "n"}


def _messages_key(messages: Any, prefix: str) -> tuple[Any, ...] | None:
    """A key for a chat whose messages are dicts with ``str`` keys and plain values (str,
    int, float, bool, None): ``prefix`` then each field's name, type tag and value (a
    float's ``repr``), a tuple of strings and numbers (nothing for the GC to walk once
    examined); None (do not cache) for anything else, e.g. images or tool calls given
    as objects."""
    if type(messages) is not list:
        return None
    key: list[Any] = [prefix]
    for message in messages:
        if type(message) is not dict:
            return None
        for name, value in message.items():
            tag = _KEY_TAGS.get(type(value))
            if tag is None or type(name) is not str:
                return None
            key += (name, tag, repr(value) if tag == "f" else value)
        key.append(None)  # end of the message
    return tuple(key)


class _Prompt:
    """An episode's prompt ids and, when the reward cannot decode them in its
    worker, their decoded text (made once per cached item)."""

    __slots__ = ("ids", "text")

    def __init__(self, ids: list[int]) -> None:
        self.ids = ids
        self.text: str | None = None


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
        prompt_cache_size: prompts kept encoded, keyed by ``data["messages"]``
            (ours; only with the default ``get_input_ids_fn``, which reads nothing
            else; 0 disables).  The ids of a cached prompt are the ids of its
            first encoding: the chat template and tokenizer must not change
            under the workflow.

    ``data`` must hold ``"messages"`` (a chat); every key is passed to the reward
    function as a keyword argument (GSM8K rows carry ``answer``).  ``prompt`` and
    ``completions`` are ``tokenizer.decode`` of the ids (the prompt with special
    tokens, the completion as ``gconfig.skip_special_tokens`` says), decoded in the
    reward worker when the tokenizer is a plain fast one (:class:`rewards.TokenText`).

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
        ValueError: ``prompt_cache_size`` < 0.
    """

    def __init__(
        self,
        reward_fn: Callable[..., Any] | str,
        gconfig: GenerationHyperparameters,
        tokenizer: Any,
        enable_thinking: bool | None = None,
        get_input_ids_fn: Callable[[Any, dict[str, Any], Any], list[int]] = default_get_input_ids,
        prompt_cache_size: int = 4096,
    ) -> None:
        if isinstance(tokenizer, str):
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(tokenizer)
        if isinstance(prompt_cache_size, bool) or not isinstance(prompt_cache_size, int) or prompt_cache_size < 0:
            raise ValueError(f"prompt_cache_size must be an int >= 0, got {prompt_cache_size!r}")
        self.reward_fn = resolve_reward_fn(reward_fn)
        self.tokenizer = tokenizer
        self.gconfig = gconfig.new_with_stop_and_pad_token_ids(tokenizer)
        self.gconfig.validate()  # n_samples=0 etc.: refused here, before any episode runs
        self.enable_thinking = enable_thinking
        self.get_input_ids_fn = get_input_ids_fn
        self.prompt_cache_size = prompt_cache_size if get_input_ids_fn is default_get_input_ids else 0
        # key -> (ids as the bytes of an array('l'), decoded text or None): compact, and (strings,
        # numbers, bytes, tuples of them) nothing the garbage collector has to walk on every full collection
        self._prompts: collections.OrderedDict[tuple[Any, ...], tuple[bytes, str | None]] = (
            collections.OrderedDict())
        self._sample_cfg = self.gconfig.new(n_samples=1)  # shared by every request (never mutated)
        self._tokenizer_file = tokenizer_file(tokenizer)  # None: decode in-process

    def _prompt(self, data: dict[str, Any]) -> _Prompt:
        key = _messages_key(data.get("messages"), repr(self.enable_thinking)) if self.prompt_cache_size else None
        if key is not None:
            cached = self._prompts.get(key)
            if cached is not None:
                self._prompts.move_to_end(key)
                ids = array("l")
                ids.frombytes(cached[0])
                prompt = _Prompt(ids.tolist())
                prompt.text = cached[1]
                return prompt
        prompt = _Prompt(list(self.get_input_ids_fn(self.tokenizer, data, self.enable_thinking)))
        if key is not None:
            if self._tokenizer_file is None:  # decoded in-process: once per item
                prompt.text = decode(self.tokenizer, prompt.ids, False)
            self._prompts[key] = (array("l", prompt.ids).tobytes(), prompt.text)
            if len(self._prompts) > self.prompt_cache_size:
                self._prompts.popitem(last=False)
        return prompt

    async def arun_episode(self, engine: EpisodeEngine, data: dict[str, Any]):
        prompt = self._prompt(data)
        n = self.gconfig.n_samples
        if n == 1:  # no child nursery, task, closure or helper frame for the common case
            resp = await engine.agenerate(self._request(prompt.ids, 0))
            scoring = self._reward(engine, resp, data, prompt)
            del prompt  # not kept alive while the reward runs (see engine._episode.Episodes._member)
            scored = await scoring
            return trajectory_from_response(resp, scored.reward, reward_is_fallback=scored.is_fallback)
        return await self._samples(engine, data, prompt, n)

    async def _samples(self, engine: EpisodeEngine, data: dict[str, Any], prompt: _Prompt, n: int) -> Any:
        """``n`` > 1 samples of one prompt, concurrently.  (Its own method: a closure in
        ``arun_episode`` would give every episode, ``n == 1`` too, five cells to keep alive.)"""
        return await sample_rows(n, functools.partial(self._one_sample, engine, data, prompt))

    def _request(self, prompt_ids: list[int], i: int) -> ModelRequest:
        """Sample ``i``'s request: its seed (when ``gconfig.seed`` is set) and, inside an
        episode, the engine's sticky routing key (``episode-<task id>``, what
        ``agenerate`` would add; set here so that it does not copy the request)."""
        cfg = self._sample_cfg
        task_id = episode_id.get()
        if cfg.seed is not None:
            cfg = cfg.new(seed=derive_seed(cfg.seed, task_id, sample_index.get(), i))
        metadata = {"routing_key": f"episode-{task_id}"} if task_id is not None else {}
        return ModelRequest(input_ids=prompt_ids, gconfig=cfg, tokenizer=self.tokenizer, metadata=metadata)

    async def _one_sample(self, engine: EpisodeEngine, data: dict[str, Any], prompt: _Prompt, i: int) -> Any:
        resp = await engine.agenerate(self._request(prompt.ids, i))
        scored = await self._reward(engine, resp, data, prompt)
        return trajectory_from_response(resp, scored.reward, reward_is_fallback=scored.is_fallback)

    def _reward(self, engine: EpisodeEngine, resp: ModelResponse, data: dict[str, Any], prompt: Any) -> Awaitable[Any]:
        """Score one sample in the engine's reward pool: an awaitable of its
        ``rewards.RewardOutcome`` (the pool's own coroutine: no frame of ours stays
        alive while the reward runs) (``prompt``: the prompt's text, special tokens
        kept, or its cache entry)."""
        skip = self.gconfig.skip_special_tokens
        pool = engine.reward_pool
        if self._tokenizer_file is not None and getattr(pool, "accepts_token_text", False):  # decoded in the worker
            completion: Any = TokenText(self._tokenizer_file, resp.output_tokens, skip)
            if isinstance(prompt, _Prompt):
                prompt = prompt.text if prompt.text is not None else TokenText(
                    self._tokenizer_file, resp.input_tokens, False)
        else:
            completion = decode(self.tokenizer, resp.output_tokens, skip)
            if isinstance(prompt, _Prompt):
                if prompt.text is None:
                    prompt.text = decode(self.tokenizer, resp.input_tokens, False)
                prompt = prompt.text
        return pool.score(self.reward_fn, prompt, completion, resp.input_tokens, resp.output_tokens, **data)

"""The engine as torchrl's (synchronous) collector thread sees it; no torchrl import here.

torchrl's ``LLMCollector`` calls its policy, and each env transform, synchronously on the
thread that iterates the collector, once per env step with the whole env batch.  Each such
call here is **one** hop into the engine's trio loop (``trio.from_thread.run``) that runs
every row of the batch as its own trio task (a nursery of ``engine.agenerate`` calls, or of
``reward_pool.score`` calls) and returns when all are done: the rows of one call are in
flight together (the ``hf`` backend batches them), with no thread per row.

:class:`Bridge` makes that hop over either engine kind:

* :class:`engine.RolloutEngineThread` (the blocking facade): into its loop thread;
* a trio-native :class:`engine.RolloutEngine` (``open_rollout_engine``): the collector must
  then run in a worker thread of that loop (``await trio.to_thread.run_sync(train_loop)``),
  or the adapter must be built inside the loop (its trio token is kept).

:func:`generate_rows` is the generation of one policy call: rows in order, each row's
request sent again (up to ``max_attempts``) when the backend fails it, so row ``i`` of the
answer is always the completion of prompt ``i``.  :func:`score_rows` is the same for the
reward pool.  :func:`gconfig_from_generate_kwargs` reads torchrl's generation arguments.
"""

from __future__ import annotations

import functools
import math
import sys
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import trio

from ..errors import BackendError, InvalidRequestError
from ..sync import RolloutEngineThread
from ..types import GenerationHyperparameters, ModelRequest, ModelResponse

if sys.version_info < (3, 11):  # pragma: no cover
    from exceptiongroup import BaseExceptionGroup

__all__ = ["Bridge", "CallCounters", "TorchRLConfig", "gconfig_from_generate_kwargs", "generate_rows",
           "score_rows"]


@dataclass(frozen=True, kw_only=True)
class TorchRLConfig:
    """Settings of the torchrl adapter (validated on construction; a ``ValueError`` names the field).

    Attributes:
        max_attempts: attempts per row (>= 1): a row whose generation request the backend
            fails (:class:`~engine.errors.BackendError`) is sent again, in place, up to this
            many times in all; then the call raises, naming the row.
        call_timeout_s: bound of one policy call (all its rows) and of one reward step, in
            seconds (> 0); past it the call raises :class:`TimeoutError` and its requests are
            withdrawn.
    """

    max_attempts: int = 3
    call_timeout_s: float = 3600.0

    def __post_init__(self) -> None:
        a = self.max_attempts
        if isinstance(a, bool) or not isinstance(a, int) or a < 1:
            raise ValueError(f"max_attempts must be an int >= 1, got {a!r}")
        t = self.call_timeout_s
        if isinstance(t, bool) or not isinstance(t, (int, float)) or math.isnan(t) or t <= 0:
            raise ValueError(f"call_timeout_s must be a number of seconds > 0, got {t!r}")


@dataclass
class CallCounters:
    """Mutable counters of one adapter object (its ``statistics()`` freezes them)."""

    calls: int = 0
    rows: int = 0
    rows_retried: int = 0
    generated_tokens: int = 0
    wait_s: float = 0.0
    last_versions: list[int] = field(default_factory=list)


class Bridge:
    """One blocking hop into the engine's trio loop per call (see the module docstring).

    :meth:`run` ``(async_fn, *args, **kwargs)`` runs ``await async_fn(trio_engine, *args, **kwargs)`` in
    the engine's loop (as a task of it) and returns its result (errors keep their type).

    Raises (from :meth:`run`): :class:`RuntimeError` naming the fix when called on the
    engine's own trio thread (it would block the loop), or, for a trio-native engine, from a
    thread that trio did not start while no trio token was captured.
    """

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.facade = isinstance(engine, RolloutEngineThread)
        self._token: trio.lowlevel.TrioToken | None = None
        if not self.facade:
            try:
                self._token = trio.lowlevel.current_trio_token()
            except RuntimeError:  # built outside the loop: the collector must run in a trio worker thread
                self._token = None

    def run(self, async_fn: Callable[..., Awaitable[Any]], *args: Any, **kwargs: Any) -> Any:
        if trio.lowlevel.in_trio_run():
            raise RuntimeError("the torchrl adapter was called on a trio thread (it would block the loop): run "
                               "the collector in a worker thread, await trio.to_thread.run_sync(train_loop)")
        if self.facade:
            facade = self.engine
            return facade._run(lambda: async_fn(facade._engine, *args, **kwargs))
        if self._token is None:
            try:  # a trio worker thread knows its loop: keep its token for every later call
                self._token = trio.from_thread.run_sync(trio.lowlevel.current_trio_token)
            except RuntimeError as exc:
                raise RuntimeError(
                    "the torchrl adapter with a trio-native engine: run the collector in a worker thread of the "
                    "engine's loop (await trio.to_thread.run_sync(train_loop)), build the adapter inside that "
                    "loop, or use engine.RolloutEngineThread") from exc
        return trio.from_thread.run(functools.partial(async_fn, self.engine, *args, **kwargs), trio_token=self._token)

    @property
    def version(self) -> int:
        """The engine's current policy version."""
        return int(self.run(_version))


async def _version(engine: Any) -> int:
    await trio.lowlevel.checkpoint()
    return int(engine.version)


async def generate_rows(engine: Any, prompts: list[list[int]], gconfig: GenerationHyperparameters,
                        tokenizer: Any, *, max_attempts: int, timeout_s: float,
                        counters: CallCounters) -> list[ModelResponse]:
    """Generate one completion per prompt, all rows at once (one trio task each), in order.

    Args:
        engine: the trio :class:`engine.RolloutEngine` (inside its loop).
        prompts: token ids per row (``list[int]`` each, no padding).
        gconfig: the sampling parameters of every row (``n_samples == 1``).
        max_attempts: sends per row when the backend fails it (:class:`BackendError`).
        timeout_s: bound of the whole call (seconds).

    Returns: ``len(prompts)`` responses; response ``i`` answers ``prompts[i]``.

    Raises:
        BackendError: a row failed ``max_attempts`` times (the message names the row and the
            last error, which is the cause); the other rows are withdrawn.
        InvalidRequestError: a request is malformed (e.g. its prompt leaves no token budget).
        TimeoutError: ``timeout_s`` passed.
    """
    out: list[ModelResponse | None] = [None] * len(prompts)

    async def row(i: int) -> None:
        for attempt in range(1, max_attempts + 1):
            req = ModelRequest(input_ids=list(prompts[i]), gconfig=gconfig, tokenizer=tokenizer)
            try:
                out[i] = await engine.agenerate(req)
                return
            except BackendError as exc:
                if attempt == max_attempts:
                    raise BackendError(f"torchrl policy call: row {i} failed {attempt} attempt(s); "
                                       f"last: {type(exc).__name__}: {exc}") from exc
                counters.rows_retried += 1

    with trio.fail_after(timeout_s):
        try:
            async with trio.open_nursery() as nursery:
                for i in range(len(prompts)):
                    nursery.start_soon(row, i)
        except BaseExceptionGroup as group:  # the first row error, with its own type and cause
            raise _first(group)
    responses = [r for r in out if r is not None]
    assert len(responses) == len(prompts)
    counters.rows += len(responses)
    counters.generated_tokens += sum(r.output_len for r in responses)
    return responses


async def score_rows(engine: Any, reward_fn: Any, rows: list[tuple[tuple[Any, ...], dict[str, Any]]], *,
                     timeout_s: float) -> list[Any]:
    """Score each row in the engine's reward pool, all at once, in order.

    Args:
        rows: ``((prompt, completions, prompt_ids, completion_ids), data)`` per row.

    Returns: one :class:`rewards.RewardOutcome` per row (``.reward``, ``.is_fallback``).

    Raises:
        RewardError: a row's reward failed after the pool's retries (the first such row).
        TimeoutError: ``timeout_s`` passed (the reward workers are killed).
    """
    pool = engine.reward_pool
    out: list[Any] = [None] * len(rows)

    async def row(i: int) -> None:
        args, data = rows[i]
        out[i] = await pool.score(reward_fn, *args, **data)

    with trio.fail_after(timeout_s):
        try:
            async with trio.open_nursery() as nursery:
                for i in range(len(rows)):
                    nursery.start_soon(row, i)
        except BaseExceptionGroup as group:
            raise _first(group)
    return out


def _first(group: BaseExceptionGroup) -> BaseException:
    """The first leaf error of ``group`` (a row's), its own ``__cause__`` kept; the group is
    not shown as its context."""
    exc: BaseException = group
    while isinstance(exc, BaseExceptionGroup):
        exc = exc.exceptions[0]
    exc.__suppress_context__ = True
    return exc


#: torchrl's standardized generation arguments (``LLMWrapperBase.COMMON_GENERATION_PARAMS``, after
#: ``_standardize_generate_kwargs`` renamed ``max_tokens``/``n``) that the engine has, with their field
_DIRECT = {"max_new_tokens": "max_new_tokens", "min_new_tokens": "min_new_tokens", "top_p": "top_p",
           "top_k": "top_k", "temperature": "temperature", "skip_special_tokens": "skip_special_tokens",
           "ignore_eos": "ignore_eos", "frequency_penalty": "frequency_penalty", "seed": "seed"}
#: torchrl arguments that the engine's backends cannot honour (refused rather than ignored)
_UNSUPPORTED = ("repetition_penalty", "num_beams", "length_penalty", "early_stopping", "bad_words_ids",
                "force_words_ids", "no_repeat_ngram_size", "encoder_repetition_penalty", "num_beam_groups",
                "diversity_penalty", "presence_penalty")
#: torchrl/HF bookkeeping arguments with no effect on what is sampled (accepted, unused)
_IGNORED = ("logprobs", "output_scores", "return_dict_in_generate", "output_logits", "tokenizer", "pad_token_id")


def gconfig_from_generate_kwargs(generate_kwargs: Mapping[str, Any] | None,
                                 base: GenerationHyperparameters | None = None) -> GenerationHyperparameters:
    """The engine's :class:`~engine.GenerationHyperparameters` for torchrl's ``generate_kwargs``.

    Accepted (torchrl's standardized names, ``LLMWrapperBase`` docstring): ``max_new_tokens``
    (or ``max_tokens``), ``min_new_tokens``, ``temperature`` (0 means greedy), ``top_p``,
    ``top_k``, ``do_sample`` (False means greedy), ``stop_sequences`` (stop strings),
    ``eos_token_id`` (int or list: extra stop ids), ``ignore_eos``, ``skip_special_tokens``,
    ``frequency_penalty``, ``seed``, and ``num_return_sequences``/``n`` equal to 1.

    Raises:
        InvalidRequestError: an argument the engine cannot honour (beam search, repetition
            penalty, ...), ``num_return_sequences`` > 1, or an unknown argument (each names it).
    """
    g = (base or GenerationHyperparameters()).new()
    kw = dict(generate_kwargs or {})
    if "max_tokens" in kw:  # torchrl's own rule: the legacy name wins
        kw["max_new_tokens"] = kw.pop("max_tokens")
    if "n" in kw:
        kw["num_return_sequences"] = kw.pop("n")
    overrides: dict[str, Any] = {}
    for key, value in kw.items():
        if key in _DIRECT:
            overrides[_DIRECT[key]] = value
        elif key == "do_sample":
            if not value:
                overrides["greedy"] = True
        elif key == "num_return_sequences":
            if value != 1:
                raise InvalidRequestError(
                    f"generate_kwargs[{key!r}]={value!r}: the engine samples one completion per row; repeat the "
                    "prompts in the env instead (ChatEnv.from_dataloader(repeats=n, group_repeats=True))")
        elif key == "stop_sequences":
            overrides["stop"] = list(value) if value else None
        elif key == "eos_token_id":
            ids = [value] if isinstance(value, int) else list(value or [])
            overrides["stop_token_ids"] = [*g.stop_token_ids, *(int(t) for t in ids if t not in g.stop_token_ids)]
        elif key in _UNSUPPORTED:
            raise InvalidRequestError(f"generate_kwargs[{key!r}]: the engine's backends do not implement it; "
                                      "remove it (supported: max_new_tokens, temperature, top_p, top_k, do_sample, "
                                      "stop_sequences, eos_token_id, ignore_eos)")
        elif key in _IGNORED:
            continue
        else:
            raise InvalidRequestError(f"generate_kwargs[{key!r}]: unknown generation argument (supported: "
                                      "max_new_tokens, temperature, top_p, top_k, do_sample, stop_sequences, "
                                      "eos_token_id, ignore_eos, min_new_tokens, frequency_penalty, seed)")
    if overrides.get("temperature", g.temperature) == 0:
        overrides["greedy"] = True
    out = g.new(**overrides)
    out.validate()
    return out

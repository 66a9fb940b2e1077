"""trio-rollout as TRL's rollout backend: an object that *is* ``GRPOTrainer``'s ``rollout_func``.

::

    from trl import GRPOConfig, GRPOTrainer
    from engine import EngineConfig, GenerationHyperparameters, HFBackend, RolloutEngineThread
    from engine.integrations.trl import TRLRollout, engine_reward
    from workflows.rlvr import RLVRWorkflow

    tok = AutoTokenizer.from_pretrained(path)
    workflow = RLVRWorkflow("rewards.gsm8k:gsm8k_reward", GenerationHyperparameters(max_new_tokens=256), tok)
    with RolloutEngineThread(HFBackend(path, tok), EngineConfig(max_concurrent_rollouts=64)) as engine:
        trainer = GRPOTrainer(model=path, args=GRPOConfig(..., num_generations=8), train_dataset=ds,
                              processing_class=tok, reward_funcs=engine_reward,
                              rollout_func=TRLRollout(engine, workflow))
        trainer.train()

The contract (TRL 1.16, ``trl/trainer/grpo_trainer.py``: ``RolloutFunc``, called from
``_generate``): ``rollout_func(prompts, trainer) -> {"prompt_ids", "completion_ids",
"logprobs", ...}``, one completion per entry of ``prompts``, in order; TRL's sampler has
already repeated each prompt ``num_generations`` times in a row.  What the adapter does per
call:

* **Groups.** Each block of ``G`` identical prompts (``trainer.num_generations``;
  ``num_generations_eval`` when ``trainer.model.training`` is false) is one engine episode
  with ``group_size=G``.  A sample that fails or is rejected is run again (up to
  ``TRLRolloutConfig.max_attempts`` attempts per sample); otherwise the call raises
  :class:`IncompleteBatchError` naming the prompt and the reason.  Never a short or
  misaligned batch.  A sample whose reward failed (``reward_error``) is not run again:
  the reward pool already retried it (``EngineConfig.reward_max_retries``), so the call
  raises at once and the line names the pool's attempt count only.
* **Data.** The workflow's data is the prompt's dataset row (every column TRL has, e.g.
  ``answer``; read from TRL's call stack, :mod:`._trl_rows`) plus the prompt: ``messages``
  for a conversational prompt (the workflow applies the chat template: TRL leaves it to the
  rollout), ``trl_prompt`` / ``trl_prompt_ids`` for a plain-text one (tokenized as TRL does;
  give RLVR ``get_input_ids_fn=trl_prompt_ids``).
* **Weights.** On the first training call and whenever ``trainer.state.global_step``
  changed, the trainer's weights reach the backend before anything is generated: tensors
  for the in-process ``hf`` backend (no disk), a ``save_pretrained`` folder for servers
  (``TRLRolloutConfig.weights_dir``), through ``engine.update_weights``; the engine's
  version is then the step, and so is every token's version.  Eval calls sync the same way
  (an eval after step k scores the weights of step k, not those of the last training call).
* **Columns.** ``prompt_ids``, ``completion_ids``, ``logprobs`` (the behaviour policy's,
  per token, as the engine sampled them) and, per completion, ``engine_reward`` (the
  workflow's raw reward: pass :func:`engine_reward` as TRL's reward function),
  ``stop_reason`` (``"stop"`` / ``"length"``), ``is_truncated``, ``token_versions``, and
  ``env_mask`` (TRL's reserved field: the ``loss_mask`` of the completion, 0 on tool and
  template tokens of multi-turn and agent episodes; by default only when it has a 0).
* **Checks** at the first call, one line each (:mod:`._trl_checks`): sampling parameters
  against ``GRPOConfig``, ``num_generations`` dividing the prompts, the tokenizer against
  ``processing_class``, run-ahead without a correction, an engine that bounds staleness
  itself (``EngineConfig.max_head_offpolicyness`` must be None: TRL paces generation).
* **Run-ahead** (``TRLRolloutConfig(max_staleness=N)``, N >= 1): after each training call
  the next N calls' prompts (predicted from TRL's sampler, :mod:`._trl_ahead`) start
  generating while TRL trains; weight syncs land mid-generation (tokens carry their
  versions).  Refused unless ``GRPOConfig.off_policy_mask_threshold`` is set (TRL then reads
  the behaviour logprobs) or ``allow_uncorrected_off_policy=True``.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import InvalidRequestError
from ._trl_ahead import Lookahead, RunAhead
from ._trl_checks import (check_engine_config, check_grouping, check_run_ahead, check_sampling, check_tokenizer,
                          workflow_parts)
from ._trl_engine import BlockingEngine, sync_weights
from ._trl_groups import Episodes, Group, IncompleteBatchError
from ._trl_rows import COLUMNS, batch_rows, episode_data, is_conversational

__all__ = ["IncompleteBatchError", "TRLRollout", "TRLRolloutConfig", "TRLRolloutStatistics", "engine_reward",
           "trl_prompt_ids"]

logger = logging.getLogger(f"rollout.{__name__}")

WEIGHT_SYNC_MODES = ("auto", "tensors", "folder")


@dataclass(frozen=True, kw_only=True)
class TRLRolloutConfig:
    """Settings of :class:`TRLRollout` (validated on construction; a ``ValueError`` names the field).

    Attributes:
        max_attempts: attempts per sample (>= 1): a failed or rejected sample runs again
            until its prompt has ``G`` completions or a sample has used this many (not a
            ``reward_error``: the reward pool owns reward retries, ``EngineConfig.reward_max_retries``).
        call_timeout_s: bound of one call, weight sync excluded (seconds, > 0).
        max_staleness: generation calls the engine may run ahead of TRL (0: none).  With TRL's
            defaults one call is one optimizer step, so a sample is at most this many
            versions old (``token_versions`` says exactly).
        allow_uncorrected_off_policy: accept ``max_staleness >= 1`` without
            ``GRPOConfig.off_policy_mask_threshold`` (TRL then treats old samples as on-policy).
        weight_sync: ``"auto"`` (tensors for the in-process backends, a folder otherwise),
            ``"tensors"``, ``"folder"``, or a callable ``(engine, trainer, version) -> None``
            that publishes the weights itself.
        weights_dir: where folder mode writes ``step-<N>/`` (the servers must read it at the
            same path; a relative one is taken from this process's working directory and sent
            absolute); the previous step's folder is removed once the next one is loaded, a
            step the servers refused is removed at once (so only the folder loaded last stays).
        env_mask: return ``env_mask``: ``None`` when some completion has a tool/template
            token (multi-turn, agents), ``True`` always, ``False`` never.
    """

    max_attempts: int = 3
    call_timeout_s: float = 3600.0
    max_staleness: int = 0
    allow_uncorrected_off_policy: bool = False
    weight_sync: str | Callable[[Any, Any, int], None] = "auto"
    weights_dir: str | None = None
    env_mask: bool | None = None

    def __post_init__(self) -> None:
        for name, low in (("max_attempts", 1), ("max_staleness", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
        t = self.call_timeout_s
        if isinstance(t, bool) or not isinstance(t, (int, float)) or math.isnan(t) or t <= 0:
            raise ValueError(f"call_timeout_s must be a number of seconds > 0, got {t!r}")
        if not callable(self.weight_sync) and self.weight_sync not in WEIGHT_SYNC_MODES:
            raise ValueError(f"weight_sync must be one of {WEIGHT_SYNC_MODES} or a callable, got {self.weight_sync!r}")


@dataclass(frozen=True)
class TRLRolloutStatistics:
    """A snapshot of a :class:`TRLRollout`.

    Attributes:
        calls, eval_calls: ``rollout_func`` calls in training / evaluation mode.
        completions: completions returned.
        samples_rerun: samples run again after a failure or rejection.
        weight_syncs: weight syncs done; ``version``: the last synced version (-1: none).
        prefetched_calls: training calls served by run-ahead; ``prefetch_misses``: predictions
            that did not match TRL's prompts (run-ahead then stops).
        wait_s: seconds TRL spent inside ``rollout_func`` (weight syncs included); ``sync_s``:
            of which weight syncs.
    """

    calls: int = 0
    eval_calls: int = 0
    completions: int = 0
    samples_rerun: int = 0
    weight_syncs: int = 0
    version: int = -1
    prefetched_calls: int = 0
    prefetch_misses: int = 0
    wait_s: float = 0.0
    sync_s: float = 0.0


class TRLRollout:
    """TRL's ``rollout_func`` over a trio-rollout engine (see the module docstring).

    Args:
        engine: a :class:`engine.RolloutEngineThread` (started), or a trio-native engine from
            ``open_rollout_engine`` (then run ``trainer.train`` in a worker thread of its loop).
        workflow: any workflow spec ``engine.submit`` takes (an instance, a class with
            ``workflow_kwargs``, an import string); resolved here, once.  Its sampling
            config must produce one completion per episode (``n_samples=1``).
        config: :class:`TRLRolloutConfig`.
        workflow_kwargs, should_accept_fn: as for ``engine.submit`` (a rejected sample runs again).

    Calling it: ``rollout(prompts, trainer) -> dict`` of lists, ``len(prompts)`` each.

    Raises (from a call):
        InvalidRequestError: a check failed (one line naming the setting and the fix).
        IncompleteBatchError: a prompt lacks completions after ``max_attempts``, or its
            reward failed (after the reward pool's retries).
        TimeoutError: ``call_timeout_s`` passed (its samples keep running in the engine).
        BackendError: the weights could not be loaded (from ``engine.update_weights``).
        WorkflowError: (at construction) the workflow spec cannot be resolved.
    """

    def __init__(self, engine: Any, workflow: Any, config: TRLRolloutConfig | None = None, *,
                 workflow_kwargs: dict[str, Any] | None = None,
                 should_accept_fn: Callable[..., Any] | None = None) -> None:
        from engine.workflow import resolve_workflow

        self.config = config or TRLRolloutConfig()
        self.workflow = resolve_workflow(workflow, workflow_kwargs)
        self.should_accept_fn = should_accept_fn
        self._engine = BlockingEngine(engine)
        self._episodes = Episodes(self._engine, self.workflow, should_accept_fn)
        self._checked = False
        self._synced_step: int | None = None
        self._folders: list[Path] = []
        self._ahead: RunAhead | None = None
        self._stats: dict[str, Any] = {}
        self._no_rows_logged = False

    # -- the call ------------------------------------------------------------------------------
    def __call__(self, prompts: list[Any], trainer: Any) -> dict[str, list[Any]]:
        start = time.perf_counter()
        try:
            return self._call(prompts, trainer)
        finally:
            self._count("wait_s", time.perf_counter() - start)

    def _call(self, prompts: list[Any], trainer: Any) -> dict[str, list[Any]]:
        training = bool(trainer.model.training)
        group = int(trainer.num_generations if training else trainer.num_generations_eval)
        check_grouping(len(prompts), group, "train" if training else "eval")
        if not self._checked:
            self._first_call(prompts, trainer)
        rows = batch_rows(prompts, trainer)
        if rows is None and not self._no_rows_logged:
            self._no_rows_logged = True
            logger.warning("rollout_func: TRL's dataset rows were not found on the call stack (TRL %s?); "
                           "only the prompts reach the workflow", _trl_version())
        starts = range(0, len(prompts), group)
        for s in starts:
            for i in range(s + 1, s + group):
                if prompts[i] != prompts[s]:
                    raise InvalidRequestError(
                        f"rollout_func: prompts[{i}] differs from prompts[{s}]; TRL's sampler repeats each prompt "
                        f"{group} times in a row (a custom sampler or dataloader must do the same)")
        self._count("calls" if training else "eval_calls")
        self.sync_weights(trainer)  # an eval scores the current policy too
        deadline = time.monotonic() + self.config.call_timeout_s
        groups = self._ahead.take(prompts) if training and self._ahead is not None else None
        if groups is None:
            groups = [Group(prompts[s], episode_data(prompts[s], rows[s] if rows else None,
                                                     trainer.processing_class), group) for s in starts]
            for g in groups:
                self._episodes.submit(g, group)
        self._episodes.collect(groups, deadline=deadline, max_attempts=self.config.max_attempts,
                               call_timeout_s=self.config.call_timeout_s)
        if training and self._ahead is not None:
            self._ahead.top_up(trainer.processing_class, group)
        return self._columns(groups, group)

    def _first_call(self, prompts: list[Any], trainer: Any) -> None:
        gconfig, tokenizer = workflow_parts(self.workflow)
        check_engine_config(self._engine.engine_config())
        check_sampling(gconfig, trainer.args)
        check_tokenizer(tokenizer, trainer.processing_class)
        check_run_ahead(self.config.max_staleness, self.config.allow_uncorrected_off_policy, trainer.args,
                        int(trainer.accelerator.num_processes))
        if prompts and not is_conversational(prompts[0]):
            from workflows.rlvr import default_get_input_ids

            if getattr(getattr(self.workflow, "_obj", self.workflow), "get_input_ids_fn", None) is default_get_input_ids:
                raise InvalidRequestError(
                    "rollout_func: TRL passes plain-text prompts but the workflow renders data['messages'] with the "
                    "chat template: build it with get_input_ids_fn=engine.integrations.trl.trl_prompt_ids "
                    "(or use a conversational 'prompt' column)")
        if self.config.max_staleness:
            self._ahead = RunAhead(Lookahead(trainer), self.config.max_staleness, self._episodes)
        self._checked = True

    def sync_weights(self, trainer: Any) -> bool:
        """Publish the trainer's weights as version ``trainer.state.global_step`` unless that
        step is already synced (each training call does this first; call it yourself to
        generate with the current weights outside TRL, e.g. an evaluation of your own).
        Returns whether it synced.

        Raises:
            InvalidRequestError: folder mode without ``weights_dir``; a PEFT model.
            BackendError: the backend refused the weights.
        """
        step = int(trainer.state.global_step)
        if step == self._synced_step:
            return False
        start = time.perf_counter()
        how = sync_weights(self._engine, trainer, version=step, mode=self.config.weight_sync,
                           weights_dir=self.config.weights_dir, previous=self._folders)
        if how == "callable" and self._engine.version != step:
            self._engine.set_version(step)
        self._synced_step = step
        self._count("weight_syncs")
        self._count("sync_s", time.perf_counter() - start)
        return True

    # -- output ------------------------------------------------------------------------------
    def _columns(self, groups: list[Group], group: int) -> dict[str, list[Any]]:
        out: dict[str, list[Any]] = {name: [] for name in (*COLUMNS, "env_mask")}
        for g in groups:
            for row in g.rows[:group]:
                for name in out:
                    out[name].append(row[name])
        want = self.config.env_mask
        if want is False or (want is None and all(all(m) for m in out["env_mask"])):
            del out["env_mask"]
        self._count("completions", len(out["prompt_ids"]))
        return out

    def discard_prefetched(self, timeout_s: float = 600.0) -> None:
        """Wait for the episodes run ahead and drop them (e.g. after ``trainer.train()``, to
        leave the engine with nothing unconsumed).  Closing the engine also cancels them."""
        if self._ahead is not None:
            self._ahead.discard(timeout_s)

    def statistics(self) -> TRLRolloutStatistics:
        """A frozen snapshot (sync, cheap)."""
        ahead = self._ahead
        return TRLRolloutStatistics(**self._stats, samples_rerun=self._episodes.reruns,
                                    prefetched_calls=ahead.hits if ahead else 0,
                                    prefetch_misses=ahead.misses if ahead else 0,
                                    version=-1 if self._synced_step is None else self._synced_step)

    def _count(self, name: str, n: float = 1) -> None:
        self._stats[name] = self._stats.get(name, 0) + n


def _trl_version() -> str:
    try:
        import trl

        return str(trl.__version__)
    except ImportError:  # pragma: no cover - the adapter is only called by TRL
        return "unknown"


def engine_reward(completions: list[Any], engine_reward: list[float] | None = None,
                  **kwargs: Any) -> list[float | None]:
    """TRL reward function that returns the engine's reward of each completion (the
    ``engine_reward`` column :class:`TRLRollout` adds): ``GRPOTrainer(reward_funcs=engine_reward)``
    (typed as TRL's reward functions are: ``list[float | None]``; every value is a float).
    The workflow's reward ran in the engine's reward pool (killable workers, timeouts).

    Raises:
        ValueError: no ``engine_reward`` column (the trainer's ``rollout_func`` is not a ``TRLRollout``).
    """
    if engine_reward is None:
        raise ValueError("engine_reward: the batch has no 'engine_reward' column; pass "
                         "rollout_func=engine.integrations.trl.TRLRollout(...) to GRPOTrainer")
    return [float(r) for r in engine_reward]


def trl_prompt_ids(tokenizer: Any, data: dict[str, Any], enable_thinking: Any = None) -> list[int]:
    """``get_input_ids_fn`` for :class:`workflows.rlvr.RLVRWorkflow` under TRL: a plain-text
    prompt's ids as TRL tokenizes them (``data["trl_prompt_ids"]``), else the chat template
    rendering of ``data["messages"]`` (:func:`workflows.rlvr.default_get_input_ids`)."""
    ids = data.get("trl_prompt_ids")
    if ids is not None:
        return list(ids)
    from workflows.rlvr import default_get_input_ids

    return default_get_input_ids(tokenizer, data, enable_thinking)

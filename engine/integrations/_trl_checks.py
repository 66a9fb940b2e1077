"""The adapter's checks of a TRL set-up, run at the first ``rollout_func`` call (the
trainer exists only then).  Each mistake raises one
:class:`~engine.errors.InvalidRequestError`, one line naming the setting and the fix.

Why each matters (TRL 1.16, ``trl/trainer/grpo_trainer.py``):

* sampling: TRL recomputes the policy's logprobs with ``logits / GRPOConfig.temperature``
  and no top-k/top-p (``_get_per_token_logps_and_entropies``); the engine's logprobs are
  those of the distribution it sampled (after temperature, top-k, top-p).  A different
  temperature or any truncation makes the two disagree: ratios, the off-policy mask and
  the gradient of the sampled distribution are then wrong, with no error from TRL.
* grouping: TRL's ``RepeatSampler`` repeats each prompt ``num_generations`` times in a row
  and normalises rewards over consecutive blocks of that size; a prompt list whose length
  it does not divide cannot be grouped.
* tokenizer: TRL pads with ``processing_class.pad_token_id``, decodes ``completion_ids``
  with ``processing_class`` for the reward functions and trains on the ids; a workflow that
  tokenizes with another vocabulary or chat template trains on ids that mean something else.
* run-ahead: without vLLM, TRL treats samples as on-policy (the ratio's denominator is the
  current policy) unless ``GRPOConfig.off_policy_mask_threshold`` is set (its off-policy
  sequence mask reads the returned ``logprobs``); ``use_vllm`` with
  ``vllm_importance_sampling_correction`` also reads them.
"""

from __future__ import annotations

from typing import Any

from ..errors import InvalidRequestError

__all__ = ["check_engine_config", "check_grouping", "check_run_ahead", "check_sampling", "check_tokenizer",
           "workflow_parts"]

_NO_TOP_K = 1 << 20  # our top_k at or above this (default 1e8) means "no top-k filter", as TRL's 0 does


def workflow_parts(workflow: Any) -> tuple[Any, Any]:
    """The workflow's ``(gconfig, tokenizer)`` when it has them (RLVR, multi-turn, math agent,
    any workflow with those attributes, or an object wrapped for its ``run`` method), else None."""
    obj = getattr(workflow, "_obj", workflow)  # engine.workflow._RunAdapter wraps objects with run()
    return getattr(obj, "gconfig", None), getattr(obj, "tokenizer", None)


def check_sampling(gconfig: Any, args: Any) -> None:
    """The workflow's sampling parameters against ``GRPOConfig`` (see the module docstring)."""
    if gconfig is None:
        return
    if getattr(gconfig, "n_samples", 1) != 1:
        raise InvalidRequestError(
            f"rollout_func: the workflow's gconfig.n_samples is {gconfig.n_samples}; set it to 1 (the adapter "
            "runs the num_generations copies of each prompt as one group, one completion each)")
    if getattr(gconfig, "greedy", False):
        raise InvalidRequestError(
            "rollout_func: the workflow's gconfig.greedy is True; GRPO needs sampled completions: set greedy=False "
            f"and temperature={args.temperature} (GRPOConfig.temperature)")
    if gconfig.temperature != args.temperature:
        raise InvalidRequestError(
            f"rollout_func: the workflow samples at temperature {gconfig.temperature} but "
            f"GRPOConfig.temperature is {args.temperature} (TRL recomputes logprobs with logits / "
            "GRPOConfig.temperature): set the same value in both")
    ours_k = 0 if gconfig.top_k >= _NO_TOP_K or gconfig.top_k <= 0 else gconfig.top_k
    theirs_k = args.top_k or 0
    if ours_k or theirs_k or gconfig.top_p != 1.0 or args.top_p != 1.0:
        raise InvalidRequestError(
            f"rollout_func: top_k/top_p truncate sampling (workflow top_k={ours_k or 'off'} top_p={gconfig.top_p}, "
            f"GRPOConfig top_k={theirs_k} top_p={args.top_p}) but TRL recomputes logprobs without them: "
            "use top_p=1.0 and no top_k in the workflow's gconfig and in GRPOConfig")
    if getattr(args, "min_p", None):
        raise InvalidRequestError(
            f"rollout_func: GRPOConfig.min_p is {args.min_p}; the engine samples without min_p and TRL "
            "recomputes logprobs without it: set min_p=None")


def check_engine_config(config: Any) -> None:
    """The engine must not bound staleness itself: its AReaL capacity formula counts accepted
    episodes against ``consumer_batch_size`` per version, which TRL's calls do not follow (the
    episodes of one call would wait for a version that only comes after the call)."""
    eta = getattr(config, "max_head_offpolicyness", None)
    if eta is not None:
        raise InvalidRequestError(
            f"rollout_func: the engine has EngineConfig(max_head_offpolicyness={eta}); TRL paces generation "
            "here: build the engine with max_head_offpolicyness=None and bound run-ahead with "
            "TRLRolloutConfig(max_staleness=...)")


def check_grouping(n_prompts: int, group: int, mode: str) -> None:
    """``group`` (num_generations, or num_generations_eval in eval) must divide the prompts."""
    if group < 1 or n_prompts % group:
        name = "num_generations" if mode == "train" else "num_generations_eval"
        batch = ("generation batch (per_device_train_batch_size x steps_per_generation)" if mode == "train"
                 else "per_device_eval_batch_size")
        raise InvalidRequestError(
            f"rollout_func: {name}={group} does not divide the {n_prompts} prompts of this call; make the "
            f"{batch} a multiple of {name}")


def _vocab_summary(tok: Any) -> dict[str, int]:
    return dict(tok.get_vocab())


def check_tokenizer(tokenizer: Any, processing_class: Any) -> None:
    """The workflow's tokenizer against the trainer's ``processing_class`` (vocabulary and
    chat template); skipped when the workflow has no tokenizer."""
    if tokenizer is None or processing_class is None or tokenizer is processing_class:
        return
    theirs = getattr(processing_class, "tokenizer", processing_class)  # a processor wraps its tokenizer
    ours = getattr(tokenizer, "tokenizer", tokenizer)
    if ours is theirs:
        return
    a, b = _vocab_summary(ours), _vocab_summary(theirs)
    if a != b:
        only_a = sorted(set(a.items()) - set(b.items()), key=lambda kv: kv[1])[:1]
        only_b = sorted(set(b.items()) - set(a.items()), key=lambda kv: kv[1])[:1]
        example = f"e.g. {only_a[0] if only_a else None} vs {only_b[0] if only_b else None}"
        raise InvalidRequestError(
            f"rollout_func: the workflow's tokenizer has a different vocabulary from the trainer's "
            f"processing_class ({len(a)} vs {len(b)} tokens, {example}): build the workflow with "
            "processing_class (the same tokenizer the trainer uses)")
    if getattr(ours, "chat_template", None) != getattr(theirs, "chat_template", None):
        raise InvalidRequestError(
            "rollout_func: the workflow's tokenizer has a different chat template from the trainer's "
            "processing_class: build the workflow with processing_class (or give both the same chat_template)")
    if getattr(ours, "pad_token_id", None) != getattr(theirs, "pad_token_id", None):
        raise InvalidRequestError(
            f"rollout_func: pad_token_id differs (workflow {ours.pad_token_id}, processing_class "
            f"{theirs.pad_token_id}): TRL pads prompt_ids with processing_class's; use one tokenizer")


def has_off_policy_correction(args: Any) -> str | None:
    """The ``GRPOConfig`` setting that makes TRL read the returned logprobs, or None."""
    if getattr(args, "off_policy_mask_threshold", None) is not None:
        return f"off_policy_mask_threshold={args.off_policy_mask_threshold}"
    if getattr(args, "use_vllm", False) and getattr(args, "vllm_importance_sampling_correction", False):
        return "use_vllm with vllm_importance_sampling_correction"
    return None


def check_run_ahead(max_staleness: int, allow_uncorrected: bool, args: Any, num_processes: int) -> None:
    """Run-ahead (``max_staleness >= 1``) needs a correction TRL applies, or the explicit opt-out."""
    if max_staleness < 1:
        return
    if num_processes != 1:
        raise InvalidRequestError(
            f"rollout_func: run-ahead (TRLRolloutConfig(max_staleness={max_staleness})) follows TRL's sampler "
            f"on one process; this run has {num_processes}: use max_staleness=0")
    if has_off_policy_correction(args) is None and not allow_uncorrected:
        raise InvalidRequestError(
            f"rollout_func: TRLRolloutConfig(max_staleness={max_staleness}) trains on samples up to "
            f"{max_staleness} step(s) old, and TRL without vLLM treats them as on-policy: set "
            "GRPOConfig(off_policy_mask_threshold=...) (e.g. 0.5), or TRLRolloutConfig("
            "allow_uncorrected_off_policy=True) to accept it, or max_staleness=0")

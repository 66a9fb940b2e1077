"""Reward functions of the AReaL tier, in a module of their own: the reward worker processes
load them by file path, and importing this module imports nothing."""

from __future__ import annotations

def constant_reward(prompt, completions, prompt_ids, completion_ids, **data):
    """AReaL's ``_dummy_reward_fn`` (tests/test_inference_engines.py): always 1."""
    return 1.0


def parity_reward(prompt, completions, prompt_ids, completion_ids, **data):
    """1.0 when the completion's first token id is divisible by 3: varies with the response,
    deterministically (MultiTurnWorkflow retries until it is positive)."""
    return float(completion_ids[0] % 3 == 0)


def failing_reward(prompt, completions, prompt_ids, completion_ids, **data):
    """Raises (on every attempt) for an item whose ``fail`` is set, else 1.0."""
    if data.get("fail"):
        raise RuntimeError(f"reward raised for {data['fail']!r}")
    return 1.0


def token_sum_reward(prompt, completions, prompt_ids, completion_ids, **data):
    """The completion's token ids summed, mod 7: varies within a group whatever the lengths
    (GRPO's advantages are not all 0, so a training step changes the weights)."""
    return float(sum(completion_ids) % 7)

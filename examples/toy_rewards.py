"""A toy reward for the tiny random model (which cannot solve arithmetic): the fraction
of completion characters that are digits, so GRPO has a non-zero advantage to follow.
Passed by file path: ``--reward examples/toy_rewards.py:digit_fraction``."""


def digit_fraction(prompt, completions, prompt_ids, completion_ids, **data):
    text = completions or ""
    return sum(c.isdigit() for c in text) / max(1, len(text))

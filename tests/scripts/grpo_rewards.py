"""Reward functions for the GRPO tests, written as a user writes them for TRL (prompts, completions and the rows'
columns by name, one float or None per completion)."""


def _text(completion) -> str:
    return completion if isinstance(completion, str) else completion[-1]["content"]


def digits(completions, **kwargs):
    """The share of a completion's characters that are digits (a target a model learns in a few steps)."""
    return [sum(ch.isdigit() for ch in _text(c)) / max(len(_text(c)), 1) for c in completions]


def brevity(completion_ids, **kwargs):
    """Shorter is better: minus the completion's tokens over 8."""
    return [-len(ids) / 8 for ids in completion_ids]


def mentions(completions, keyword, **kwargs):
    """1 when the completion contains the row's `keyword` column, None for a row without one (not scored)."""
    return [None if k is None else float(k in _text(c)) for c, k in zip(completions, keyword)]


def vowels(completions, **kwargs):
    """The share of a completion's characters that are vowels (varies from the first step on any model)."""
    return [sum(ch in "aeiou" for ch in _text(c)) / max(len(_text(c)), 1) for c in completions]

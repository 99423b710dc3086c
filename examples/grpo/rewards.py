"""The offline GRPO demo's reward (examples/grpo/demo.yaml): written as a TRL reward function is, one float per
completion from the completions (and, by name, any column of the prompt rows)."""


def digits(completions, **kwargs):
    """The share of a completion's characters that are digits: a target a model trained from scratch learns in a
    few dozen steps, so the reward visibly rises on a CPU within a minute. A real run scores what the task asks:
    an answer against a `solution` column (the built-in `accuracy`), a format, a test suite."""
    texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]
    return [sum(ch.isdigit() for ch in t) / max(len(t), 1) for t in texts]

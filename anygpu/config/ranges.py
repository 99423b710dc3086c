"""Range checks for every numeric option of the argument dataclasses, in one table.

Each `__post_init__` calls `check_ranges(self)` first, so a NaN learning rate or a zero eval batch is
refused up front with the option, the value and an example, never a ZeroDivisionError deep in a worker.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

from anygpu.errors import UsageError


@dataclass(frozen=True)
class Range:
    low: float | None = None  # None: unbounded
    high: float | None = None
    low_open: bool = False  # True: value must be > low (not >=)
    high_open: bool = False
    example: str = ""

    def contains(self, v: float) -> bool:
        if self.low is not None and (v <= self.low if self.low_open else v < self.low):
            return False
        return not (self.high is not None and (v >= self.high if self.high_open else v > self.high))

    def describe(self) -> str:
        lo = "" if self.low is None else ("> " if self.low_open else "≥ ") + f"{self.low:g}"
        hi = "" if self.high is None else ("< " if self.high_open else "≤ ") + f"{self.high:g}"
        return "a finite number " + " and ".join(x for x in (lo, hi) if x)


AT_LEAST_1 = Range(1, example="1")
POSITIVE = Range(0, low_open=True)
NON_NEGATIVE = Range(0)

# Options not listed here are checked by their dataclass (with a message of their own) or are not numbers.
RANGES: dict[str, Range] = {
    # ModelArguments
    "vocab_size": Range(300, example="8192"),
    # DataArguments
    "block_size": Range(2, example="512"),
    "validation_split_percentage": Range(0, 100, low_open=True, high_open=True, example="5"),
    "max_train_samples": Range(1, example="10000 (or leave it out for all)"),
    "max_eval_samples": Range(example="256 (0 or less: all)"),
    "max_corpus_mb": Range(0, low_open=True, example="1 (or leave it out for all)"),
    "preprocessing_num_workers": Range(1, example="4"),
    # TrainArguments
    "num_train_epochs": Range(0, low_open=True, example="1"),
    "global_batch_size": Range(1, example="64"),
    "save_every_minutes": Range(0, example="30 (0: off)"),
    "global_batch_tokens": Range(1, example="65536"),
    "per_device_train_batch_size": Range(1, example="8"),
    "per_device_eval_batch_size": Range(1, example="8"),
    "gradient_accumulation_steps": Range(1, example="1"),
    "dataloader_num_workers": Range(0, example="1 (0: read inline)"),
    "learning_rate": Range(0, low_open=True, example="3e-4"),
    "weight_decay": Range(0, example="0.1"),
    "adam_beta1": Range(0, 1, high_open=True, example="0.9"),
    "adam_beta2": Range(0, 1, high_open=True, example="0.95"),
    "adam_epsilon": Range(0, low_open=True, example="1e-8"),
    "warmup_steps": Range(0, example="10"),
    "max_grad_norm": Range(0, example="1.0 (0: no clipping)"),
    "seed": Range(0, 2**32 - 1, example="42"),
    "logging_steps": Range(1, example="10"),
    "eval_steps": Range(0, example="100 (0: only at the end)"),
    "save_steps": Range(0, example="500 (0: only at the end)"),
    "stop_at_step": Range(1, example="1000 (or leave it out)"),
    "save_total_limit": Range(1, example="2 (or leave it out to keep all)"),
    "ddp_timeout": Range(1, example="1800"),
    "train_timeout": Range(0, example="300 (0: --ddp_timeout throughout)"),
    "gc_steps": Range(0, example="50 (0: Python's automatic collector)"),
    "dp_replicate": Range(1, example="2 (or leave it out: one per node)"),
    "dp_shard": Range(1, example="8 (or leave it out: the processes per node)"),
    "cp": Range(1, example="2 (1: no context parallelism)"),
    "ep": Range(1, example="2 (1: no expert parallelism)"),
}


def check_ranges(obj: Any) -> None:
    """Refuse a numeric option outside its range (None means 'not given' and passes)."""
    for f in fields(obj):
        value = getattr(obj, f.name)
        if f.name not in RANGES or value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        r = RANGES[f.name]
        if not (math.isfinite(value) and r.contains(value)):
            example = f", e.g. {r.example}" if r.example else ""
            raise UsageError(f"--{f.name} {value} must be {r.describe()}{example}.")

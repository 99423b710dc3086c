"""The learning-rate schedules --lr_scheduler_type names, as transformers' `get_scheduler` computes them.

Written here rather than imported: `transformers.optimization` imports `transformers.trainer_utils`, which imports
peft wherever it is installed, 1.8 s of CPU in every native-engine process that trains no adapter (a fifth of a tiny
run's start-up). The formulas are transformers' own (`get_linear_schedule_with_warmup`,
`get_cosine_schedule_with_warmup` with half a cycle, `get_constant_schedule[_with_warmup]`), a LambdaLR each;
tests/test_schedules.py holds them equal to transformers' at every step.
"""

from __future__ import annotations

import math
from functools import partial

import torch
from torch.optim.lr_scheduler import LambdaLR


def _warming(step: int, warmup: int) -> float:
    return step / max(1, warmup)


def _linear(step: int, *, warmup: int, total: int) -> float:
    if step < warmup:
        return _warming(step, warmup)
    return max(0.0, (total - step) / max(1, total - warmup))


def _cosine(step: int, *, warmup: int, total: int) -> float:
    if step < warmup:
        return _warming(step, warmup)
    progress = (step - warmup) / max(1, total - warmup)
    return max(0.0, 0.5 * (1.0 + math.cos(math.pi * 2.0 * 0.5 * progress)))


def _constant(step: int, *, warmup: int, total: int) -> float:
    return 1.0


def _constant_with_warmup(step: int, *, warmup: int, total: int) -> float:
    return step / max(1.0, warmup) if step < warmup else 1.0


SCHEDULES = {"linear": _linear, "cosine": _cosine, "constant": _constant, "constant_with_warmup": _constant_with_warmup}


def build(name: str, optimizer: torch.optim.Optimizer, warmup: int, total: int) -> LambdaLR:
    """`name`'s schedule over `total` steps after `warmup` warm-up steps (a LambdaLR, saved and resumed as torch's)."""
    return LambdaLR(optimizer, partial(SCHEDULES[name], warmup=warmup, total=total))

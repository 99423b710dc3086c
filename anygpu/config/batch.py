"""Global batch → per-device batch × devices × accumulation steps.

The global batch G (sequences per optimizer step) is the one number that defines the
math; the world size W only changes how it is cut:  G = m · W · A  with m the
per-device micro-batch and A the gradient accumulation steps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from anygpu.errors import UsageError


@dataclass(frozen=True)
class BatchPlan:
    global_batch_size: int
    per_device_train_batch_size: int
    world_size: int
    gradient_accumulation_steps: int

    def banner(self) -> str:
        """The start-up line, e.g. `global batch 64 = 1 per device × 8 devices × 8 accumulation steps`."""
        devices = "device" if self.world_size == 1 else "devices"
        steps = "accumulation step" if self.gradient_accumulation_steps == 1 else "accumulation steps"
        return (
            f"global batch {self.global_batch_size} = {self.per_device_train_batch_size} per device"
            f" × {self.world_size} {devices} × {self.gradient_accumulation_steps} {steps}"
        )

    @property
    def sequences_per_rank(self) -> int:
        return self.per_device_train_batch_size * self.gradient_accumulation_steps


TRAINER_PER_DEVICE = 8  # TrainingArguments.per_device_train_batch_size's default


def _each(devices: int) -> str:
    return "the device" if devices == 1 else f"each of {devices} devices"


def resolve_global_batch(
    global_batch_size: int | None,
    global_batch_tokens: int | None,
    block_size: int,
    per_device_train_batch_size: int | None,
    gradient_accumulation_steps: int | None,
    world_size: int,
) -> int:
    """The global batch in sequences, from whichever of the batch arguments was given."""
    if global_batch_size is not None and global_batch_tokens is not None:
        raise UsageError(
            f"--global_batch_size {global_batch_size} and --global_batch_tokens {global_batch_tokens} "
            "both set the global batch: give only one of them."
        )
    if global_batch_tokens is not None:
        if global_batch_tokens <= 0 or global_batch_tokens % block_size:
            raise UsageError(
                f"--global_batch_tokens {global_batch_tokens} must be a positive multiple of "
                f"--block_size {block_size}, e.g. {max(1, round(global_batch_tokens / block_size)) * block_size}."
            )
        return global_batch_tokens // block_size
    if global_batch_size is not None:
        if global_batch_size <= 0:
            raise UsageError(
                f"--global_batch_size {global_batch_size} must be a positive number of sequences, e.g. 64."
            )
        return global_batch_size
    # No global batch given: the HF way, G follows from the per-device numbers (Trainer's per-device default: 8).
    return (per_device_train_batch_size or TRAINER_PER_DEVICE) * (gradient_accumulation_steps or 1) * world_size


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def plan_batch(
    global_batch_size: int,
    world_size: int,
    per_device_train_batch_size: int | None = None,
    gradient_accumulation_steps: int | None = None,
    max_per_device: int = 8,
    groups: int = 1,
) -> BatchPlan:
    """Split G over W ranks; refuse any split that would change G. `groups`: G must also be whole groups of that
    many (GRPO's completions of a prompt), so a valid value named in the refusal is a multiple of both."""
    G, W = global_batch_size, world_size
    if W <= 0:
        raise UsageError(f"world size {W} must be at least 1")
    unit = math.lcm(W, groups)
    if G % unit:
        valid = sorted({max(unit, (G // unit) * unit), (G // unit + 1) * unit})
        whole = f" in whole groups of --num_generations {groups}" if groups > 1 else ""
        raise UsageError(
            f"--global_batch_size {G} cannot be split evenly over {W} devices{whole}: "
            f"use a multiple of {unit} (e.g. {' or '.join(map(str, valid))}) or another number of devices."
        )
    per_rank = G // W
    m, A = per_device_train_batch_size, gradient_accumulation_steps
    if m is not None and m <= 0:
        raise UsageError(f"--per_device_train_batch_size {m} must be at least 1.")
    if A is not None and A <= 0:
        raise UsageError(f"--gradient_accumulation_steps {A} must be at least 1.")
    if m is not None and A is not None:
        if m * A != per_rank:
            raise UsageError(
                f"--per_device_train_batch_size {m} × --gradient_accumulation_steps {A} × {W} devices = "
                f"{m * A * W}, not --global_batch_size {G}: drop --gradient_accumulation_steps "
                f"(it follows from the global batch) or set it to {per_rank // m if per_rank % m == 0 else 'a value that fits'}."
            )
    elif m is not None:
        if per_rank % m:
            fits = [d for d in _divisors(per_rank) if d <= m]
            raise UsageError(
                f"--per_device_train_batch_size {m} does not divide the {per_rank} sequences {_each(W)} gets from "
                f"--global_batch_size {G}: use one of {fits[-3:]}."
            )
        A = per_rank // m
    elif A is not None:
        if per_rank % A:
            raise UsageError(
                f"--gradient_accumulation_steps {A} does not divide the {per_rank} sequences {_each(W)} gets from "
                f"--global_batch_size {G}: use one of {_divisors(per_rank)[-3:]}, or leave it out."
            )
        m = per_rank // A
    else:
        m = max(d for d in _divisors(per_rank) if d <= max(1, max_per_device))
        A = per_rank // m
    return BatchPlan(G, m, W, A)

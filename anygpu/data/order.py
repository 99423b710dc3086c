"""The seeded global order of packed samples: global batch k is the same samples whatever the world size."""

from __future__ import annotations

import math

from dataclasses import dataclass, field
from typing import Iterator

import torch

from anygpu.config.batch import BatchPlan
from anygpu.errors import UsageError


EVAL_SUBSET_SEED = 0  # fixed: the eval set must not move when --seed changes (as the validation split)


def eval_subset(num_rows: int, max_samples: int | None) -> list[int]:
    """`--max_eval_samples`: a seeded uniform sample of the validation rows (in their order), not the first N,
    which after best-fit packing are the fullest rows. A function of the two numbers alone: the same on any world size."""
    if not max_samples or max_samples <= 0 or max_samples >= num_rows:
        return list(range(num_rows))
    g = torch.Generator().manual_seed(EVAL_SUBSET_SEED)
    return sorted(torch.randperm(num_rows, generator=g)[:max_samples].tolist())


def check_enough_samples(num_samples: int, global_batch_size: int) -> None:
    """At least one global batch of training samples."""
    if num_samples < global_batch_size:
        raise UsageError(
            f"the training set has {num_samples} rows, fewer than --global_batch_size {global_batch_size}: lower "
            f"--global_batch_size (≤ {num_samples}), or --block_size (more, shorter rows), or add data."
        )


def steps_for_epochs(epochs: float, steps_per_epoch: int) -> int:
    """--num_train_epochs in steps, rounded up as Trainer's max_steps (0.5 of 397 is 199), the float product rounded
    first: 0.3 × 10 is 3 steps, where Trainer's ceil of 3.0000000000000004 gives 4."""
    return max(1, math.ceil(round(epochs * steps_per_epoch, 9)))


@dataclass(frozen=True)
class GlobalOrder:
    """One seeded permutation of the packed samples per epoch; global batch k is
    samples [kG, (k+1)G) of it, whatever the world size (a final partial batch is dropped)."""

    num_samples: int
    global_batch_size: int
    seed: int
    # (epoch, its permutation): drawn once per epoch, not per step (randperm of 10M samples is ~250 ms)
    _cached: list = field(default_factory=list, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        check_enough_samples(self.num_samples, self.global_batch_size)

    @property
    def steps_per_epoch(self) -> int:
        return self.num_samples // self.global_batch_size

    def permutation(self, epoch: int) -> torch.Tensor:
        """The order of epoch `epoch`; the current epoch's is kept, so a step costs a slice, whatever the corpus."""
        cached = self._cached[0] if self._cached else None  # one read: safe if another thread calls this too
        if cached is not None and cached[0] == epoch:
            return cached[1]
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        perm = torch.randperm(self.num_samples, generator=g)
        self._cached[:] = [(epoch, perm)]
        return perm

    def global_batch(self, step: int) -> list[int]:
        """Sample indices of optimizer step `step` (0-based, counted over all epochs)."""
        epoch, k = divmod(step, self.steps_per_epoch)
        G = self.global_batch_size
        return self.permutation(epoch)[k * G : (k + 1) * G].tolist()

    def micro_batches(self, step: int, plan: BatchPlan, rank: int) -> list[list[int]]:
        """Rank `rank`'s share of global batch `step`, cut into its accumulation micro-batches."""
        return rank_micro_batches(self.global_batch(step), plan, rank)


def rank_micro_batches(batch: list[int], plan: BatchPlan, rank: int) -> list[list[int]]:
    """Rank `rank`'s share of a global batch, cut into its accumulation micro-batches."""
    share = batch[rank * plan.sequences_per_rank : (rank + 1) * plan.sequences_per_rank]
    m = plan.per_device_train_batch_size
    return [share[j * m : (j + 1) * m] for j in range(plan.gradient_accumulation_steps)]


class StepSampler(torch.utils.data.Sampler):
    """Yields (step, this rank's micro-batches of it) for steps [start_step, end_step): one DataLoader item per step."""

    def __init__(self, order: GlobalOrder, plan: BatchPlan, rank: int, start_step: int, end_step: int) -> None:
        self.order, self.plan, self.rank = order, plan, rank
        self.start_step, self.end_step = start_step, end_step

    def __iter__(self) -> Iterator[tuple[int, list[list[int]]]]:
        for step in range(self.start_step, self.end_step):
            yield step, self.order.micro_batches(step, self.plan, self.rank)

    def __len__(self) -> int:
        return max(0, self.end_step - self.start_step)


class MicroBatchSampler(torch.utils.data.Sampler):
    """Yields this rank's micro-batches (lists of indices) for steps [start_step, end_step)."""

    def __init__(self, order: GlobalOrder, plan: BatchPlan, rank: int, start_step: int, end_step: int) -> None:
        self.order, self.plan, self.rank = order, plan, rank
        self.start_step, self.end_step = start_step, end_step

    def __iter__(self) -> Iterator[list[int]]:
        for step in range(self.start_step, self.end_step):
            yield from self.order.micro_batches(step, self.plan, self.rank)

    def __len__(self) -> int:
        return (self.end_step - self.start_step) * self.plan.gradient_accumulation_steps


def eval_shards(num_samples: int, world_size: int, rank: int, batch_size: int) -> list[list[int]]:
    """This rank's evaluation batches; every rank gets the same number (collectives), short ranks get []."""
    per_rank = -(-num_samples // world_size)
    mine = list(range(rank * per_rank, min(num_samples, (rank + 1) * per_rank)))
    num_batches = -(-per_rank // batch_size)
    return [mine[i * batch_size : (i + 1) * batch_size] for i in range(num_batches)]

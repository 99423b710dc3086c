"""Step k+1's micro-batches read on a background thread while step k computes.

The Arrow read, the tensor build and the target-token count happen off the critical path; on a
GPU the batches are pinned so the copies to the device are asynchronous. The count is a CPU number,
so normalising the loss by it needs no device round trip. When the device is the CPU itself, the
thread only helps on a core the step does not use; without one, reads stay inline.
"""
from __future__ import annotations

import os
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable

import torch

from anygpu.data.collate import count_targets

Batch = dict[str, torch.Tensor]


@dataclass
class StepBatches:
    micro_batches: list[Batch]  # on the device
    num_targets: torch.Tensor  # this rank's target tokens (labels != -100 after the shift), 0-d float on the device


def step_targets(batches: list[Batch]) -> int:
    """Target tokens of a step's CPU batches."""
    return sum(count_targets(b) for b in batches)


def to_device(batches: list[Batch], num_targets: torch.Tensor, device: torch.device, non_blocking: bool = False) -> StepBatches:
    return StepBatches([{k: v.to(device, non_blocking=non_blocking) for k, v in b.items()} for b in batches],
                       num_targets.to(device, non_blocking=non_blocking))


def read_now(batches: list[Batch], device: torch.device) -> StepBatches:
    """The same, without a background thread (benchmarks, tests, one-off steps)."""
    return to_device(batches, torch.tensor(float(step_targets(batches))), device)


def spare_core() -> bool:
    """A core that none of this node's processes' compute threads use (CPU training)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return cores > torch.get_num_threads() * int(os.environ.get("LOCAL_WORLD_SIZE", 1))


class Prefetcher:
    """`get(step)` returns step `step`'s batches on `device` and starts reading step + 1 in the background."""

    def __init__(self, load: Callable[[int], list[Batch]], device: torch.device, end_step: int,
                 background: bool | None = None) -> None:
        self.load, self.device, self.end_step = load, device, end_step
        self.pin = device.type == "cuda"
        self.background = (self.pin or spare_core()) if background is None else background
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="anygpu-prefetch") if self.background else None
        self.pending: tuple[int, Future] | None = None

    def _read(self, step: int) -> tuple[list[Batch], torch.Tensor]:
        batches = self.load(step)
        num_targets = torch.tensor(float(step_targets(batches)))
        if self.pin:  # page-locked host memory: the device copies below do not block the host
            batches = [{k: v.pin_memory() for k, v in b.items()} for b in batches]
            num_targets = num_targets.pin_memory()
        return batches, num_targets

    def get(self, step: int) -> StepBatches:
        if self.pending is not None and self.pending[0] == step:
            batches, num_targets = self.pending[1].result()  # re-raises a read error here, with its traceback
        else:
            batches, num_targets = self._read(step)
        self.pending = (step + 1, self.pool.submit(self._read, step + 1)) if self.pool and step + 1 < self.end_step else None
        return to_device(batches, num_targets, self.device, non_blocking=self.pin)

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)

"""This rank's optimizer steps through a `torch.utils.data.DataLoader`, read ahead while a step computes.

One item is one whole step (its A micro-batches and their target-token count), not one micro-batch:
every micro-batch's loss is normalised by the step's count, which must be known (and all-reduced)
before the first forward. `StepSampler` yields the steps of GlobalOrder from the resumed one on, and
the DataLoader never shuffles, so order and resume are GlobalOrder's exactly. The count is a CPU
number, so normalising by it needs no device round trip; on a GPU the batches are pinned so the
copies to the device are asynchronous.

Workers: one worker process where a core is spare (a GPU's host; CPU training with cores left),
none otherwise: reads then stay inline, as with the old prefetch thread. Measured on the 2-core CI
box (tiny preset, block 128, G 8, one rank using both cores): a step reads in 0.17 ms against
~90 ms of compute, so a worker could hide 0.2 % of a step; starting one costs ~120 ms per loader
(60 steps: 0.24 ms/step with 0 workers, 2.3 with 1), and engine/plain steps/s was 1.004 with 0
workers, 0.986 with 1 (benchmarks/engine_vs_plain.py, median of 3 rounds of 60 steps).
"""

from __future__ import annotations

import atexit
import functools
import multiprocessing
import os
import signal
from dataclasses import dataclass
from typing import Iterator

import torch
from datasets import Dataset

from anygpu.config.batch import BatchPlan
from anygpu.data.collate import Collator, batch_to, step_count
from anygpu.data.order import GlobalOrder, StepSampler

Batch = dict[str, torch.Tensor | int]  # ints: flash attention's max_length_q/k (collate.varlen_kwargs)


@dataclass
class StepBatches:
    """One optimizer step of this rank: its micro-batches, their data set indices and target-token count."""

    step: int
    indices: list[list[int]]  # data set indices of each micro-batch (dropout masks are keyed by them)
    micro_batches: list[Batch]
    num_targets: torch.Tensor  # labels != -100 after the shift, over all micro-batches: 0-d int64 (pairs: a vector)
    # (an integer: FSDP2's mixed precision casts floating forward inputs, and bf16 holds 257 as 256)

    def pin_memory(self) -> StepBatches:
        """Page-locked copies (the DataLoader's pinning calls this): device copies then do not block the host."""
        return StepBatches(
            self.step,
            self.indices,
            [{k: _pinned(v) for k, v in b.items()} for b in self.micro_batches],
            self.num_targets.pin_memory(),
        )

    def to(self, device: torch.device) -> StepBatches:
        non_blocking = device.type == "cuda"  # asynchronous from pinned memory; a plain copy from pageable memory
        return StepBatches(
            self.step,
            self.indices,
            [batch_to(b, device, non_blocking) for b in self.micro_batches],
            self.num_targets.to(device, non_blocking=non_blocking),
        )


def _pinned(value: torch.Tensor | int) -> torch.Tensor | int:
    return value.pin_memory() if isinstance(value, torch.Tensor) else value  # ints (flash's max_length) stay


class StepRows(torch.utils.data.Dataset):
    """Map-style view of the packed rows whose keys are StepSampler's items: one Arrow read per micro-batch."""

    def __init__(self, dataset: Dataset) -> None:
        self.dataset = dataset

    def __getitem__(self, item: tuple[int, list[list[int]]]) -> tuple[int, list[list[int]], list[dict[str, list]]]:
        step, micro = item
        return step, micro, [self.dataset[idx] for idx in micro]  # a list key: one read, not ~0.1 ms per row


@dataclass(frozen=True)
class StepCollate:
    """The Collator over each micro-batch's rows, plus the step's target-token count."""

    collator: Collator

    def __call__(self, rows: tuple[int, list[list[int]], list[dict[str, list]]]) -> StepBatches:
        step, micro, columns = rows
        batches = [self.collator.collate(c) for c in columns]
        return StepBatches(step, micro, batches, step_count(self.collator, batches))


def read_step(
    dataset: Dataset, collator: Collator, order: GlobalOrder, plan: BatchPlan, rank: int, step: int
) -> StepBatches:
    """Step `step` of rank `rank`, read now on the CPU (benchmarks, tests, one-off steps)."""
    micro = order.micro_batches(step, plan, rank)
    return StepCollate(collator)(StepRows(dataset)[(step, micro)])


def spare_core() -> bool:
    """A core that none of this node's processes' compute threads use (CPU training)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return cores > torch.get_num_threads() * int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


def default_workers(device: torch.device) -> int:
    """1 where reading ahead costs the step nothing (a GPU's host, a spare core), else 0: inline reads."""
    return 1 if device.type == "cuda" or spare_core() else 0


def leave_signals_to_the_rank(_worker_id: int) -> None:
    """A loader worker ignores the stop signals: Slurm sends them to every process of the job step, and the
    rank (its parent) handles them. A worker would otherwise run the rank's handler it inherited (and its
    watchdog, which would end the worker mid-save) or die of torch's own SIGTERM handler, and the rank's
    DataLoader would then raise inside the preemption save. The rank still ends its workers at shutdown."""
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
        signal.signal(sig, signal.SIG_IGN)


def stop_workers(batches: Iterator | None) -> None:
    """End `batches`' loader workers now, whatever they are doing. They ignore SIGTERM (leave_signals_to_the_rank),
    and Python's exit handler ends daemonic children with SIGTERM and then joins them: a rank leaving with an
    exception while its loader's iterator is alive (the traceback holds it) would wait for its workers forever."""
    workers = getattr(batches, "_workers", None)
    if not workers:
        return
    if not getattr(batches, "_shutdown", True):
        batches._shutdown_workers()  # torch's own ending (a no-op once the interpreter exits): done event, joins
    _kill(workers)


def _kill(workers: list[multiprocessing.Process]) -> None:
    """SIGKILL what is still alive (a worker only reads rows: nothing of the run is lost with it), then reap it."""
    for worker in workers:
        if worker.is_alive():
            worker.kill()
    for worker in workers:
        worker.join(timeout=10)


@functools.cache
def _guard_exit() -> None:
    """Once per process, once a loader has workers: after multiprocessing's exit handler, so it runs before it."""
    atexit.register(_kill_workers_at_exit)


def _kill_workers_at_exit() -> None:
    """The last guard, for an exit whose path did not call stop_workers: end this process's loader workers before
    multiprocessing's exit handler (registered earlier, so it runs later) waits for them. torch's SIGCHLD handler
    would report each as a worker that died: it is the rank that is leaving."""
    from torch.utils.data._utils.worker import _worker_loop

    workers = [p for p in multiprocessing.active_children() if getattr(p, "_target", None) is _worker_loop]
    if workers:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        _kill(workers)


def step_loader(
    dataset: Dataset,
    collator: Collator,
    order: GlobalOrder,
    plan: BatchPlan,
    rank: int,
    start_step: int,
    end_step: int,
    device: torch.device,
    num_workers: int | None = None,
    prefetch_factor: int = 2,
) -> torch.utils.data.DataLoader:
    """Steps [start_step, end_step) of rank `rank`, in GlobalOrder's order, as CPU StepBatches (pinned on CUDA)."""
    workers = default_workers(device) if num_workers is None else num_workers
    if workers:
        _guard_exit()
    return torch.utils.data.DataLoader(
        StepRows(dataset),
        sampler=StepSampler(order, plan, rank, start_step, end_step),
        batch_size=None,  # the sampler's items are whole steps already
        collate_fn=StepCollate(collator),
        num_workers=workers,
        pin_memory=device.type == "cuda",
        prefetch_factor=prefetch_factor if workers > 0 else None,
        persistent_workers=False,  # one pass over [start_step, end_step) per run: nothing to keep workers for
        worker_init_fn=leave_signals_to_the_rank,
        # its own generator: creating an iterator draws a worker seed, which must not move the global RNG
        generator=torch.Generator().manual_seed(0),
    )

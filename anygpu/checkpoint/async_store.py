"""Asynchronous checkpoints for the FSDP2 engine: training stops only while the model and optimizer
state are copied to host memory (pinned on a GPU); torch.distributed.checkpoint writes the copy on a
background thread.

Still atomic: the write goes to `.checkpoint-<step>.tmp`, and only once it has finished — seen at a
later step boundary (`poll`), before the next save, or at exit (`wait`) — does rank 0 write the state
file and manifest and rename the folder (`store.finalize`). A crash before then leaves an incomplete temporary
folder that is never listed, so `--resume_from_checkpoint latest` takes the previous checkpoint. SIGTERM
while a write is in flight: the preemption save first waits for it and commits it (the preemption watchdog
counts the wait as a save in progress). A full disk: one SaveError (see `store.disk_errors`).

Rank 0's write finishes only after every rank's (DCP's coordinator gathers all write results before
it writes the metadata), so rank 0 commits alone, without a collective on the training path.
"""

from __future__ import annotations

import json
import logging
import os
import time
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

from anygpu.checkpoint import store
from anygpu.runtime import distributed, faults, parallel, progress

# torch before 2.13 closes a DefaultStager's copier after each staging (its copy table emptied: the next staging
# fails on the first OrderedDict, with KeyError: <class 'type'>), so there a stager serves one save.
STAGER_REUSABLE = torch.torch_version.TorchVersion(torch.__version__) >= (2, 13)

logger = logging.getLogger(__name__)


@dataclass
class _Pending:
    step: int
    future: Future
    tmp: Path
    final: Path
    json_files: dict[str, dict[str, Any]]  # trainer state + scheduler (as of the save) and the fingerprint
    world_size: int
    needed: int | None  # bytes, for the message of a full disk


class AsyncCheckpointer:
    """One per run; `save` returns once the state is staged, `poll`/`wait` commit finished writes."""

    def __init__(
        self,
        output_dir: str,
        save_total_limit: int | None,
        rank: int,
        device: torch.device,
        watched: progress.Progress | None = None,
    ) -> None:
        """`watched`: the run's progress, which the preemption watchdog reads (a commit holds it off)."""
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        self.root, self.save_total_limit, self.rank = Path(output_dir), save_total_limit, rank
        self.watched = watched
        # The background write runs collectives (planning, gathering results): on a group of its own, on
        # the CPU, so they never interleave with the training collectives of the main thread. Made at the
        # first save (every rank saves at the same step), so a run that never saves holds no extra group.
        self.group = None
        gpu = device.type == "cuda"
        self.options = StagingOptions(
            use_pinned_memory=gpu, use_shared_memory=False, use_async_staging=False, use_non_blocking_copy=gpu
        )
        # One stager for the run where torch allows it: on a GPU its pinned host buffers are allocated once.
        self.stager = DefaultStager(self.options)
        self.pending: _Pending | None = None
        self.stalls: list[float] = []  # seconds training stopped per save (staging + waiting for the previous one)

    def save(
        self,
        step: int,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: Any,
        trainer_state: dict[str, Any],
        extra_files: dict[str, dict[str, Any]] | None = None,
    ) -> None:
        start = time.perf_counter()
        self.wait()  # one write in flight at a time
        final = self.root / f"checkpoint-{step}"
        state_dict = store.sharded_state_dict(model, optimizer)
        world_size = trainer_state.get("world_size", 1)
        needed = store.needed_bytes(self.root, state_dict, world_size)
        tmp = store.start(self.root, step, self.rank, needed)  # a SaveError here when the disk is short
        with store.disk_errors(self.root, tmp, final, self.rank, needed):
            store.save_rng(tmp, self.rank)  # before the write starts: rank 0's commit implies every rank's files
            if self.group is None:
                self.group = dist.new_group(backend="gloo")
                distributed.keep_timeout(self.group)  # a write may outlast the training steps' short timeout
            if not STAGER_REUSABLE:  # a fresh one per save (making one allocates nothing)
                self.stager = type(self.stager)(self.options)
            future = dcp.async_save(
                state_dict, checkpoint_id=str(tmp), process_group=self.group, async_stager=self.stager
            )
        # a copy of the small state as of this step (the scheduler moves on while the write runs)
        state = json.loads(json.dumps({**trainer_state, "scheduler": scheduler.state_dict()}, default=str))
        files = {store.STATE_FILE: state, **(extra_files or {})}
        self.pending = _Pending(step, future, tmp, final, files, world_size, needed)
        self.stalls.append(time.perf_counter() - start)
        logger.info("checkpoint-%d: training paused %.3f s; writing in the background", step, self.stalls[-1])

    def poll(self) -> None:
        """At a step boundary: commit the pending checkpoint if its write has finished (never blocks)."""
        if self.pending is not None and self.pending.future.done():
            self._commit()

    def wait(self) -> None:
        """Block until the pending write is done and committed (before another save, on SIGTERM, at exit)."""
        if self.pending is not None:
            self._commit()

    def _commit(self) -> None:
        p, self.pending = self.pending, None
        # The wait for the write is a save in progress to the preemption watchdog: it makes no heartbeat, yet
        # cutting it short would lose both this checkpoint and the preemption one that follows it.
        with progress.protected(self.watched), store.disk_errors(self.root, p.tmp, p.final, self.rank, p.needed):
            p.future.result()  # waits; re-raises a failed write here (a full disk: one SaveError)
            faults.at("save", p.step)
            if self.rank == 0:
                store.finalize(
                    self.root, p.tmp, p.final, p.step, p.world_size, "fsdp", self.save_total_limit, p.json_files
                )
                logger.info("checkpoint-%d complete: %s", p.step, p.final)

    def close(self) -> None:
        """Finish the pending write, leave the write group together (a rank that tears a gloo group down
        while a peer still uses it aborts that peer), then free the staging buffers."""
        self.wait()
        if self.group is not None:
            dist.barrier(group=self.group)
            dist.destroy_process_group(self.group)
            self.group = None
        self.stager.close()


def use_async(requested: bool | None, model: nn.Module, local_world_size: int) -> tuple[bool, str]:
    """Whether to save asynchronously, and why. Default: yes, when the host has room for the staged copy
    (this rank's parameters and AdamW state, about 3x its parameter bytes, times the processes of the node)."""
    if requested is not None:
        return requested, "--async_save " + str(requested).lower()
    staged = 3 * parallel.local_bytes(model) * local_world_size
    try:
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return False, "host memory unknown"
    if staged > available / 2:
        return False, f"the staged copy ({staged / 2**30:.1f} GiB) would take over half the free host memory"
    return True, "default"

"""Count the host syncs of a stretch of code: the points where the host waits for the device.

A training step should queue its work and return, so the host runs ahead and the GPU never idles between kernels;
each `.item()`, `bool(tensor)`, data-dependent shape (`nonzero`, boolean indexing) or copy to the host in between
stops the host until the GPU catches up. On a GPU the count is CUDA's own (`torch.cuda.set_sync_debug_mode`);
on a CPU, where nothing waits, the same points are counted as the ops that would wait on a GPU (a dispatch mode
that sees `_local_scalar_dense`, which every tensor-to-Python conversion calls, and the ops whose output size
depends on the data), so a CPU test catches a sync before a GPU pays for it.
"""

from __future__ import annotations

import contextlib
import traceback
import warnings
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode


def _sync_ops() -> set:
    aten = torch.ops.aten
    names = ("_local_scalar_dense", "nonzero", "masked_select", "_unique2", "unique_dim", "unique_consecutive")
    ops = {getattr(aten, n).default for n in names if hasattr(aten, n)}
    ops.add(aten.repeat_interleave.Tensor)  # without output_size: its size comes from the data
    ops.add(aten.index.Tensor)  # boolean-mask indexing (an integer index does not sync: filtered below)
    return ops


@dataclass
class Syncs:
    """What `count` saw: the number of syncs and where each came from (the nearest frame outside torch)."""

    count: int = 0
    where: Counter = field(default_factory=Counter)

    def summary(self, top: int = 5) -> str:
        return ", ".join(f"{n}× {w}" for w, n in self.where.most_common(top)) or "none"


def _caller() -> str:
    for frame in reversed(traceback.extract_stack()):
        if (
            "/torch/" not in frame.filename
            and frame.filename != __file__
            and not frame.filename.endswith("warnings.py")
        ):
            return f"{frame.filename.rsplit('/', 2)[-1]}:{frame.lineno} {frame.name}"
    return "torch"


class _Counter(TorchDispatchMode):
    def __init__(self, syncs: Syncs) -> None:
        super().__init__()
        self.syncs, self.ops = syncs, _sync_ops()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self.ops and not (func is torch.ops.aten.index.Tensor and not _bool_index(args)):
            self.syncs.count += 1
            self.syncs.where[f"{func.__name__.split('.')[0]} at {_caller()}"] += 1
        return func(*args, **kwargs)


CUDA_SYNC_TEXT = "called a synchronizing CUDA operation"  # c10's warn_or_error_on_sync


@contextlib.contextmanager
def _cuda_sync_warnings(syncs: Syncs) -> Iterator[None]:
    """Count CUDA's sync warnings, each at the nearest frame outside torch of the stack that raised it (a warning's
    own file and line name the torch function that returned to Python, not the caller)."""

    def seen(message, category, filename, lineno, file=None, line=None) -> None:
        if CUDA_SYNC_TEXT in str(message):
            syncs.count += 1
            syncs.where[_caller()] += 1

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = seen
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode("default")


def _bool_index(args) -> bool:
    indices = args[1] if len(args) > 1 else ()
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices or ())


@contextlib.contextmanager
def count(device: torch.device) -> Iterator[Syncs]:
    """Count the host syncs inside the block (see the module docstring): CUDA's own on a GPU, else the ops that
    would sync there."""
    syncs = Syncs()
    if device.type == "cuda":
        with _cuda_sync_warnings(syncs):
            yield syncs
        return
    with _Counter(syncs):
        yield syncs

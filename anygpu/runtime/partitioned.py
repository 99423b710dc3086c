"""A parameter's own shape and size, also where ZeRO-3 has partitioned it: `deepspeed.zero.Init` leaves each
parameter an empty 1-D placeholder and keeps its shape in `ds_shape` and its size in `ds_numel`, so `p.shape` and
`p.numel()` would count nothing (a 0.0M-parameter banner, an MFU of zero, no matrix in the weight-decay group)."""

from __future__ import annotations

import torch


def shape(p: torch.Tensor) -> tuple[int, ...]:
    return tuple(getattr(p, "ds_shape", p.shape))


def numel(p: torch.Tensor) -> int:
    return int(getattr(p, "ds_numel", p.numel()))

"""The gradient norm both engines log and clip with (anygpu.train.optim.clip_grad_norm): the true norm, the
same however the gradients are split into row shards (FSDP2's layout on any world size), and clipping to it."""

from __future__ import annotations

import sys

import pytest
import torch
from conftest import ROOT, run

from anygpu.train import optim

SHAPES = [(8192, 64), (64,), (), (4, 16, 8), (300, 7)]  # an lm_head, a norm weight, a scalar, experts, odd rows


def params(shapes=SHAPES, dtype=torch.float32, seed=0) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for shape in shapes:
        p = torch.nn.Parameter(torch.zeros(shape, dtype=dtype))
        p.grad = (torch.randn(shape, generator=g) * 3).to(dtype)
        out.append(p)
    return out


def float64_norm(ps: list[torch.nn.Parameter]) -> float:
    return float(torch.sqrt(sum((p.grad.double() ** 2).sum() for p in ps)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_norm_is_the_float64_norm(dtype):
    ps = params(dtype=dtype)
    assert float(optim.clip_grad_norm(ps, 0.0)) == pytest.approx(float64_norm(ps), rel=1e-6)


def test_row_shards_give_the_same_norm_bit_for_bit():
    """FSDP2 shards every gradient by rows; a norm that depended on the split would depend on the world size."""
    whole = params()
    for world in (2, 3, 5):
        shards = []
        for p in whole:
            pieces = [p.grad] if p.grad.ndim == 0 else torch.tensor_split(p.grad, world)
            for piece in pieces:
                q = torch.nn.Parameter(torch.zeros_like(piece))
                q.grad = piece.clone()
                shards.append(q)
        assert torch.equal(optim.clip_grad_norm(shards, 0.0), optim.clip_grad_norm(whole, 0.0)), world


def test_clipping_scales_to_max_norm_and_leaves_a_small_norm_alone():
    ps = params()
    before = float64_norm(ps)
    returned = optim.clip_grad_norm(ps, 1.0)
    assert float(returned) == pytest.approx(before, rel=1e-6)  # the norm before clipping, as torch returns it
    assert float64_norm(ps) == pytest.approx(1.0, rel=1e-5)
    small = params(seed=1)
    grads = [p.grad.clone() for p in small]
    optim.clip_grad_norm(small, 10 * float64_norm(small))
    assert all(torch.equal(p.grad, g) for p, g in zip(small, grads))


DTENSOR_PATH = r"""
import os, torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor
from anygpu.train import optim
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
mesh = init_device_mesh("cpu", (1,))
g = torch.Generator().manual_seed(0)
plain, sharded = [], []
for shape in [(8192, 64), (64,), (4, 16, 8), (300, 7)]:
    grad = torch.randn(shape, generator=g) * 3
    p = torch.nn.Parameter(torch.zeros(shape)); p.grad = grad.clone(); plain.append(p)
    d = torch.nn.Parameter(distribute_tensor(torch.zeros(shape), mesh, [Shard(0)]))
    d.grad = distribute_tensor(grad.clone(), mesh, [Shard(0)]); sharded.append(d)
print(float(optim.clip_grad_norm(plain, 0.0)), float(optim.clip_grad_norm(sharded, 0.0)))
dist.destroy_process_group()
"""


@pytest.mark.slow  # a process of its own
def test_fsdp2_dtensors_and_plain_tensors_agree():
    """The FSDP2 engine (DTensors) and one process / DDP (plain tensors) take different paths to the same norm."""
    p = run(
        [sys.executable, "-c", DTENSOR_PATH], timeout=120, extra_env={"PYTHONPATH": str(ROOT)}
    )  # exit 0, or its output
    plain, sharded = map(float, p.stdout.split())
    assert plain == pytest.approx(sharded, rel=1e-6)

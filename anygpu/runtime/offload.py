"""--cpu_offload (FSDP2 engine): FSDP2's `CPUOffloadPolicy` keeps each rank's shards of the parameters, their
gradients and the AdamW state in host memory (pinned where there is a GPU, so the copies overlap compute) and runs
the optimizer step there (torch's fused CPU AdamW); each unit's parameter shard is copied to the GPU for its
all-gather, its gradient shard back after the reduce-scatter. The GPU then holds only the gathered units and the
activations. The math is the same as without it: the same losses on any world size, and checkpoints that load
either way. What it costs at 8B and 70B: docs/memory.md#cpu-offload."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

from anygpu.errors import UsageError


def policy(enabled: bool, device: torch.device) -> OffloadPolicy:
    """FSDP2's offload policy: pinned host memory where a GPU copies from it (pinning needs an accelerator)."""
    return CPUOffloadPolicy(pin_memory=device.type != "cpu") if enabled else OffloadPolicy()


def materialize(model: nn.Module, device: torch.device, enabled: bool) -> None:
    """`to_empty` on the device, or under offload on the CPU (the shards' home: never the whole shard on the GPU
    first) with the buffers (RoPE tables), which FSDP2 does not manage, on the device the forward runs on."""
    if not enabled:
        model.to_empty(device=device)
        return
    model.to_empty(device="cpu")
    for module in model.modules():
        for name, buf in module._buffers.items():
            if buf is not None:
                module._buffers[name] = buf.to(device)


def check_host_memory(per_rank: int, ranks_per_node: int, available: int | None) -> None:
    """Refuse --cpu_offload where this node's ranks' offloaded state cannot fit its free host memory."""
    needed = per_rank * ranks_per_node
    if available is None or needed <= available:
        return
    gib = lambda b: f"{b / 2**30:.1f} GiB"  # noqa: E731
    raise UsageError(
        f"--cpu_offload true: this node's {ranks_per_node} rank(s) would hold {gib(needed)} of parameters, gradients "
        f"and optimizer state in host memory ({gib(per_rank)} each), and {gib(available)} is available: spread the "
        "job over more nodes, train LoRA adapters (--use_peft true), or leave --cpu_offload false "
        "(`anygpu plan` shows what fits)."
    )

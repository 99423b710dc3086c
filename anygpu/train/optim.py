"""AdamW and the learning-rate schedule, the same for both engines."""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Iterable

import torch
from torch import nn

from anygpu.config.args import TrainArguments
from anygpu.config.optimizers import BF16, FP32, LOW_BIT, flag, state_kind
from anygpu.runtime import parallel
from anygpu.train import schedules


# Trainer's get_decay_parameter_names: by name (lower-cased), and nothing inside an nn.LayerNorm
NO_DECAY_NAMES = re.compile(r"bias|layernorm|rmsnorm|(?:^|\.)norm(?:$|\.)|_norm(?:$|\.)")


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Weight decay as Trainer applies it (`Trainer.get_decay_parameter_names`): not on biases, norm weights (by
    name) or anything inside an nn.LayerNorm; by name, so also where ZeRO-3 has partitioned a parameter to an empty
    placeholder. (gpt-oss's 2-D expert biases are no matrices to decay; its 1-D sinks and Mamba's A_log are, to
    Trainer.)"""
    in_layer_norm = {id(p) for m in model.modules() if isinstance(m, nn.LayerNorm) for p in m.parameters()}
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            exempt = id(p) in in_layer_norm or NO_DECAY_NAMES.search(name.lower())
            (no_decay if exempt else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def build_optimizer(model: nn.Module, args: TrainArguments, device: torch.device) -> torch.optim.Optimizer:
    """--optim's AdamW: torch's (fused where the device has the kernel), or with bf16, 8- or 4-bit moments."""
    kind = state_kind(args.optim, getattr(args, "optim_args", None))
    parallel.resharded(model)  # the sharded parameters, whatever ran the model before
    if kind != FP32:  # bf16, 8- or 4-bit moments
        from anygpu.train.low_bit_adamw import LowBitAdamW

        return LowBitAdamW(
            param_groups(model, args.weight_decay),
            kind,
            lr=args.learning_rate,
            betas=(args.adam_beta1, args.adam_beta2),
            eps=args.adam_epsilon,
            weight_decay=args.weight_decay,
        )
    return torch.optim.AdamW(
        param_groups(model, args.weight_decay),
        lr=args.learning_rate,
        betas=(args.adam_beta1, args.adam_beta2),
        eps=args.adam_epsilon,
        # One kernel for all parameters, plain tensors or FSDP2's DTensors. On CPU torch's default
        # is a Python loop over the parameters, 4-6x slower than the fused kernel (tiny, default presets).
        fused=device.type in ("cuda", "cpu"),
    )


def note(optim: str) -> str | None:
    """The banner's line for a state kind other than AdamW's fp32 moments (None for those)."""
    if optim == BF16:
        return (
            f"optimizer: AdamW with bf16 moments ({flag(BF16).removeprefix('--optim ')}: 4 bytes of state per "
            "parameter instead of 8, the step in fp32; the same state on any world size)"
        )
    bits = LOW_BIT.get(optim)
    if bits is None:
        return None
    return (
        f"optimizer: AdamW with {bits}-bit moments ({optim}: torchao's block-wise quantisation, blocks within rows, "
        "so any world size keeps the same state; 1-D and small tensors keep fp32 moments)"
    )


def build_scheduler(optimizer: torch.optim.Optimizer, args: TrainArguments, num_training_steps: int):
    """--lr_scheduler_type's schedule, transformers' formulas (`anygpu.train.schedules`); a warm-up longer than the run
    climbs as Trainer's does, never reaching the peak (not squeezed into the run)."""
    return schedules.build(args.lr_scheduler_type, optimizer, args.warmup_steps, num_training_steps)


def clip_grad_norm(parameters: Iterable[nn.Parameter], max_norm: float) -> torch.Tensor:
    """Clip the gradients to a total norm of `max_norm` (0: no clipping) as torch's clip_grad_norm_ does, with a
    norm that does not depend on how the gradients are sharded: torch's float32 norm of a whole gradient and of
    its shards differ by up to 5e-5 relative on CPU (an 8192×64 lm_head gradient), which made the FSDP2
    engine's logged norm depend on the world size. Returns the norm on the device.

    FSDP2's DTensors: each shard's norm in float64, reduced over the shard group. Plain tensors (one process,
    DDP, DataParallel): each row's norm in float32 (FSDP2 shards whole rows, so a row's norm is the same
    in every layout), the row norms combined in float64. Both agree to ~1e-7; the row norms need no float64
    copy of each gradient, which cost the HF engine 2 ms of an 85 ms tiny-preset step on CPU
    (benchmarks/hf_vs_trainer.py: +1.94 ms per step outside the model over the bare Trainer).
    """
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return torch.tensor(0.0)
    total = _dtensor_norm(grads) if any(hasattr(g, "to_local") for g in grads) else _row_norm(grads)
    if max_norm > 0:
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        by_kind = defaultdict(list)
        for g in grads:
            local = g.to_local() if hasattr(g, "to_local") else g  # a view: scaling it scales the DTensor's shard
            by_kind[(local.device, local.dtype)].append(local)
        for (device, dtype), group in by_kind.items():
            torch._foreach_mul_(group, coef.to(device=device, dtype=dtype))
    return total.float()


def _dtensor_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """The total norm of FSDP2's gradients, each mesh's (the experts' under --ep live on a mesh of their own) reduced
    over that mesh, then combined."""
    by_mesh: dict[object, list[torch.Tensor]] = defaultdict(list)
    for g in grads:
        by_mesh[getattr(g, "device_mesh", None)].append(g)
    if len(by_mesh) == 1:
        return _mesh_norm(grads)
    parts = [_mesh_norm(group) for group in by_mesh.values()]
    return torch.linalg.vector_norm(torch.stack([p.to(parts[0].device) for p in parts]), 2.0)


def _mesh_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    norms = torch._foreach_norm(grads, 2.0, dtype=torch.float64)
    total = torch.linalg.vector_norm(torch.stack(norms), 2.0)
    if not hasattr(total, "full_tensor"):
        return total
    local, device_type = total.to_local(), total.device_mesh.device_type
    if local.device.type != device_type:  # --cpu_offload: shards on the host, reduced by the GPU's backend (NCCL)
        from torch.distributed.tensor import DTensor

        total = DTensor.from_local(local.to(device_type), total.device_mesh, total.placements, run_check=False)
    return total.full_tensor()


def _row_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    by_device: dict[torch.device, list[torch.Tensor]] = defaultdict(list)
    for g in grads:
        rows = (
            torch.linalg.vector_norm(g, 2.0, dim=tuple(range(1, g.ndim)), dtype=torch.float32)
            if g.ndim > 1
            else g.detach().float().abs()
        )
        by_device[g.device].append(rows.reshape(-1))
    parts = [torch.linalg.vector_norm(torch.cat(rows).double(), 2.0) for rows in by_device.values()]
    first = grads[0].device
    return torch.linalg.vector_norm(torch.stack([p.to(first) for p in parts]), 2.0)

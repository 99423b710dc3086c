"""AdamW and the learning-rate schedule, the same for both engines."""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

import torch
from torch import nn
from transformers import get_scheduler

from anygpu.config.args import TrainArguments


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Weight decay on matrices only: biases and norm weights (the 1-D parameters) are exempt, as in HF."""
    decay, no_decay = [], []
    for _, p in model.named_parameters():
        if p.requires_grad:
            (decay if p.dim() >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def build_optimizer(model: nn.Module, args: TrainArguments, device: torch.device) -> torch.optim.Optimizer:
    return torch.optim.AdamW(
        param_groups(model, args.weight_decay),
        lr=args.learning_rate,
        betas=(args.adam_beta1, args.adam_beta2),
        eps=args.adam_epsilon,
        # One kernel for all parameters, plain tensors or FSDP2's DTensors. On CPU torch's default
        # is a Python loop over the parameters, 4-6x slower than the fused kernel (tiny, default presets).
        fused=device.type in ("cuda", "cpu"),
    )


def build_scheduler(optimizer: torch.optim.Optimizer, args: TrainArguments, num_training_steps: int):
    return get_scheduler(
        args.lr_scheduler_type, optimizer, num_warmup_steps=min(args.warmup_steps, num_training_steps),
        num_training_steps=num_training_steps,
    )


def clip_grad_norm(parameters: Iterable[nn.Parameter], max_norm: float) -> torch.Tensor:
    """Clip the gradients to a total norm of `max_norm` (0: no clipping) as torch's clip_grad_norm_ does, the norm
    summed in float64. torch's float32 norm of a whole gradient and of its shards differ by up to 5e-5 relative on
    CPU (an 8192×64 lm_head gradient), which made the FSDP2 engine's logged norm depend on the world size.
    Plain tensors or FSDP2's DTensors (a reduction over the shard group); returns the norm on the device."""
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return torch.tensor(0.0)
    norms = torch._foreach_norm(grads, 2.0, dtype=torch.float64)
    total = torch.linalg.vector_norm(torch.stack(norms), 2.0)
    total = total.full_tensor() if hasattr(total, "full_tensor") else total
    if max_norm > 0:
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        by_kind = defaultdict(list)
        for g in grads:
            local = g.to_local() if hasattr(g, "to_local") else g  # a view: scaling it scales the DTensor's shard
            by_kind[(local.device, local.dtype)].append(local)
        for (device, dtype), group in by_kind.items():
            torch._foreach_mul_(group, coef.to(device=device, dtype=dtype))
    return total.float()

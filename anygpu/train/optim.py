"""AdamW and the learning-rate schedule, the same for both engines."""
from __future__ import annotations

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

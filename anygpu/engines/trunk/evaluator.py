"""The evaluation both engines run: the mean token loss over the whole validation set."""

from __future__ import annotations

import torch

from anygpu.data.collate import batch_to, count_targets
from anygpu.data.order import eval_shards
from anygpu.model import lean_loss, moe
from anygpu.runtime import context_parallel, distributed


@torch.no_grad()
def evaluate(
    model,
    dataset,
    collator,
    batch_size: int,
    rank: int,
    world_size: int,
    device: torch.device,
    unwrapped=None,
    cp: context_parallel.CPGroup = context_parallel.NONE,
) -> float:
    """Mean token loss over `dataset` on every rank. `model` is what runs the forward (a wrapper included);
    `unwrapped` is the model itself (its lean loss and MoE settings), `model` when not given; `cp`: the rank's
    CP group (the rows of its data rank, each split over the group as in training; each token counted once).

    Every rank runs the same number of forward passes (FSDP, ZeRO-3 gather parameters collectively):
    a rank short of samples runs a dummy batch and discards it."""
    unwrapped = model if unwrapped is None else unwrapped
    was_training = model.training
    model.eval()
    totals = torch.zeros(2, dtype=torch.float64, device=device)
    for idx in eval_shards(len(dataset), world_size // cp.size, rank // cp.size, batch_size):
        batch = batch_to(collator.read(dataset, idx or [0]), device)
        # num_items_in_batch=1 turns the model's loss into a token-loss sum (HF's own loss path)
        with lean_loss.active(unwrapped), context_parallel.split(unwrapped, batch, cp) as inputs:
            out = model(
                **inputs,
                use_cache=False,
                num_items_in_batch=torch.tensor(1, device=device),
                **moe.eval_kwargs(unwrapped),
            )
        if idx:
            count = count_targets(batch) if cp.index == 0 else 0  # the group's parts of the same rows: once
            totals += torch.stack([out.loss.double(), torch.tensor(float(count), device=device, dtype=torch.float64)])
    distributed.all_reduce_sum(totals)
    if was_training:
        model.train()
    return (totals[0] / totals[1]).item()

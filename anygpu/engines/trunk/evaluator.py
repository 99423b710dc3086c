"""The evaluation both engines run: the mean token loss over the whole validation set."""

from __future__ import annotations

import torch

from anygpu.data.collate import count_targets
from anygpu.data.order import eval_shards
from anygpu.model import lean_loss, moe
from anygpu.runtime import distributed


@torch.no_grad()
def evaluate(
    model, dataset, collator, batch_size: int, rank: int, world_size: int, device: torch.device, unwrapped=None
) -> float:
    """Mean token loss over `dataset` on every rank. `model` is what runs the forward (a wrapper included);
    `unwrapped` is the model itself (its lean loss and MoE settings), `model` when not given.

    Every rank runs the same number of forward passes (FSDP, ZeRO-3 gather parameters collectively):
    a rank short of samples runs a dummy batch and discards it."""
    unwrapped = model if unwrapped is None else unwrapped
    was_training = model.training
    model.eval()
    totals = torch.zeros(2, dtype=torch.float64, device=device)
    for idx in eval_shards(len(dataset), world_size, rank, batch_size):
        batch = {k: v.to(device) for k, v in collator.read(dataset, idx or [0]).items()}
        # num_items_in_batch=1 turns the model's loss into a token-loss sum (HF's own loss path)
        with lean_loss.active(unwrapped):
            out = model(
                **batch,
                use_cache=False,
                num_items_in_batch=torch.tensor(1, device=device),
                **moe.eval_kwargs(unwrapped),
            )
        if idx:
            count = torch.tensor(float(count_targets(batch)), device=device, dtype=torch.float64)
            totals += torch.stack([out.loss.double(), count])
    distributed.all_reduce_sum(totals)
    if was_training:
        model.train()
    return (totals[0] / totals[1]).item()

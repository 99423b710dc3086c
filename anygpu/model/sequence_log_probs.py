"""Each sequence's log-probability of its labels (a preference pair's completions), from one forward.

Where the lean loss is installed (`anygpu.model.lean_loss`, both engines' default) the per-token log-probs come from
the last hidden states a chunk of tokens at a time, so the (tokens × vocabulary) logits never exist whole, with the
family's logit soft-capping or scaling; elsewhere (`--lean_loss false`, a family it cannot serve, ZeRO-3) from the
model's own logits in fp32. Either way the sums per sequence are taken from the flat per-token values by each
position's `segment` (a packed row holds several sequences).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from anygpu.model import lean_loss

IGNORE_INDEX = -100


def token_log_probs(
    model: nn.Module, call: Callable[..., Any], inputs: dict[str, torch.Tensor], labels: torch.Tensor
) -> tuple[torch.Tensor, Any]:
    """(the log-prob of each label, flattened over the batch in fp32, 0 where it is -100; the model's output).
    `call` runs the forward (the model itself or what wraps it: FSDP2, DDP, ZeRO); `model` is the model (its lean loss)."""
    if lean_loss.is_installed(model):
        with lean_loss.log_probs(model) as got:
            out = call(**inputs, labels=labels, use_cache=False)
            values = got()
        if values.requires_grad:
            # + 0 · the output's loss: the backward then passes through the model's output, where FSDP2 hooks the
            # gathering of the parameters its forward released (the root's: the final norm's); without it they stay
            # released and the backward reads freed memory.
            values = values + 0.0 * out.loss.to(values.dtype)
        return values, out
    out = call(**inputs, use_cache=False)
    shifted = F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:]
    logits = out.logits.float()
    values = -F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), shifted.reshape(-1), ignore_index=IGNORE_INDEX, reduction="none"
    )
    return values, out


def sequence_sums(values: torch.Tensor, segment: torch.Tensor, num_sequences: int) -> torch.Tensor:
    """(num_sequences,): the per-token `values` (flat, one per position: the prediction of the next token) summed per
    sequence; position t counts for the sequence of position t + 1, whose token it predicts."""
    target = F.pad(segment, (0, 1), value=-1)[..., 1:].reshape(-1).to(values.device)
    # padding (-1) into one more bucket, dropped: a boolean selection would wait for the device (its size)
    target = torch.where(target >= 0, target, num_sequences)
    return values.new_zeros(num_sequences + 1).index_add(0, target, values)[:num_sequences]

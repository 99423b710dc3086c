"""Each sequence's log-probability of its labels (a preference pair's completions), from one forward.

Where the lean loss is installed (`anygpu.model.lean_loss`, both engines' default) the per-token log-probs come from
the last hidden states a chunk of tokens at a time, so the (tokens × vocabulary) logits never exist whole, with the
family's logit soft-capping or scaling; elsewhere (`--lean_loss false`, a family it cannot serve, ZeRO-3) from the
model's own logits in fp32. Either way the sums per sequence are taken from the flat per-token values by each
position's `segment` (a packed row holds several sequences). Under context parallelism (`--cp C`) a rank holds a part
of each row: its tokens' values are summed per sequence and the sums added over the CP group.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from anygpu.data.pair_batches import model_inputs
from anygpu.model import lean_loss
from anygpu.runtime import context_parallel
from anygpu.runtime.context_parallel import CPGroup

IGNORE_INDEX = -100


def token_log_probs(
    model: nn.Module,
    call: Callable[..., Any],
    inputs: dict[str, torch.Tensor],
    labels: torch.Tensor,
    shifted: bool = False,
) -> tuple[torch.Tensor, Any]:
    """(the log-prob of each label, flattened over the batch in fp32, 0 where it is -100; the model's output).
    `call` runs the forward (the model itself or what wraps it: FSDP2, DDP, ZeRO); `model` is the model (its lean loss).
    `shifted`: the labels are already each position's next token (a CP part's: shifted before the cut)."""
    if lean_loss.is_installed(model):
        with lean_loss.log_probs(model) as got:
            shift = {"shift_labels": labels} if shifted else {}
            out = call(**inputs, labels=labels, **shift, use_cache=False)
            values = got()
        if values.requires_grad:
            # + 0 · the output's loss: the backward then passes through the model's output, where FSDP2 hooks the
            # gathering of the parameters its forward released (the root's: the final norm's); without it they stay
            # released and the backward reads freed memory.
            values = values + 0.0 * out.loss.to(values.dtype)
        return values, out
    out = call(**inputs, use_cache=False)
    targets = labels if shifted else F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:]
    logits = out.logits.float()
    values = -F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=IGNORE_INDEX, reduction="none"
    )
    return values, out


def sequence_sums(
    values: torch.Tensor, segment: torch.Tensor, num_sequences: int, cp: CPGroup = context_parallel.NONE
) -> torch.Tensor:
    """(num_sequences,): the per-token `values` (flat, one per position: the prediction of the next token) summed per
    sequence; position t counts for the sequence of position t + 1, whose token it predicts. Under CP `values` are
    this rank's part's and `segment` the full rows': the part's sums, added over the group."""
    target = F.pad(segment, (0, 1), value=-1)[..., 1:]
    if cp.size > 1:
        target = context_parallel.part_of(target, cp, -1)
    target = target.reshape(-1).to(values.device)
    # padding (-1) into one more bucket, dropped: a boolean selection would wait for the device (its size)
    target = torch.where(target >= 0, target, num_sequences)
    sums = values.new_zeros(num_sequences + 1).index_add(0, target, values)[:num_sequences]
    return context_parallel.sum_over_group(sums, cp) if cp.size > 1 else sums


def pair_sequence_log_probs(
    model: nn.Module,
    call: Callable[..., Any],
    batch: dict[str, torch.Tensor],
    part: dict[str, torch.Tensor] | None = None,
    cp: CPGroup = context_parallel.NONE,
) -> torch.Tensor:
    """(2m,): the log-probs of a pair batch's sequences (chosen, then rejected), from one forward of the whole rows,
    or under CP of this rank's `part` of them (`context_parallel.split`'s), every rank of the group the same sums."""
    n = batch["completion_tokens"].numel()
    if cp.size == 1:
        values, _ = token_log_probs(model, call, model_inputs(batch), batch["labels"])
    else:
        inputs = {k: part[k] for k in ("input_ids", "position_ids")}
        values, _ = token_log_probs(model, call, inputs, part["shift_labels"], shifted=True)
    return sequence_sums(values, batch["segment"], n, cp)

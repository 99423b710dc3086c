"""A GRPO round's completions as training rows: which of the global batch's completions a rank holds, their padded
tensors, and the per-token log-probs of their completion tokens.

The global batch of a round is P prompts × k generations, completion c = p·k + i (prompt p of the round's order,
generation i); data rank r of D holds the consecutive completions [r·G/D, (r+1)·G/D) (groups may straddle ranks:
advantages are computed from the gathered rewards, as TRL does). A row is its prompt left-padded and its completion
right-padded, with position ids counted from the first real token (as generation counted them), so a row's
numbers do not depend on what it is padded to.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from anygpu.model import moe


@dataclass(frozen=True)
class Share:
    """This rank's completions of a round: each one's prompt (a row of the prompt set) and generation index."""

    prompts: list[int]
    generations: list[int]
    first: int  # the global index of its first completion


def rank_share(round_prompts: list[int], num_generations: int, rank: int, world_size: int) -> Share:
    """Data rank `rank`'s consecutive share of the round's P·k completions."""
    total = len(round_prompts) * num_generations
    assert total % world_size == 0, f"{total} completions do not split over {world_size} ranks"
    n = total // world_size
    mine = range(rank * n, (rank + 1) * n)
    return Share([round_prompts[c // num_generations] for c in mine], [c % num_generations for c in mine], rank * n)


def rows(
    prompt_ids: list[list[int]], completion_ids: list[list[int]], pad_token_id: int, device: torch.device
) -> dict[str, torch.Tensor]:
    """Padded rows: input_ids, attention_mask, position_ids (B, P + C); completion_ids, completion_mask (B, C)."""
    width_p = max(len(p) for p in prompt_ids)
    width_c = max(1, max(len(c) for c in completion_ids))
    ids, mask = [], []
    for p, c in zip(prompt_ids, completion_ids):
        left, right = width_p - len(p), width_c - len(c)
        ids.append([pad_token_id] * left + list(p) + list(c) + [pad_token_id] * right)
        mask.append([0] * left + [1] * (len(p) + len(c)) + [0] * right)
    input_ids = torch.tensor(ids, dtype=torch.long)
    attention_mask = torch.tensor(mask, dtype=torch.long)
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    out = {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "position_ids": position_ids,
        "completion_ids": input_ids[:, width_p:],
        "completion_mask": attention_mask[:, width_p:],
    }
    return {k: v.to(device) for k, v in out.items()}


def token_log_probs(
    model, call: Callable, batch: dict[str, torch.Tensor], temperature: float, entropy: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(B, C) fp32: each completion token's log-prob under softmax(logits / temperature) (TRL's), and the
    distributions' entropies (no gradient) where asked; only the completion positions' logits are made."""
    width = batch["completion_ids"].shape[1]
    out = call(
        input_ids=batch["input_ids"],
        attention_mask=batch["attention_mask"],
        position_ids=batch["position_ids"],
        logits_to_keep=width + 1,
        use_cache=False,
        **moe.eval_kwargs(model),  # GRPO's loss has no router term (docs/grpo.md)
    )
    logits = out.logits[:, :-1].float()  # position t predicts completion token t
    if temperature != 1.0:  # a (B, C, V) copy: only where it changes something
        logits = logits / temperature
    lse = torch.logsumexp(logits, dim=-1)
    logps = logits.gather(-1, batch["completion_ids"].unsqueeze(-1)).squeeze(-1) - lse
    return logps, _entropies(logits.detach(), lse.detach()) if entropy else None


@torch.no_grad()
def _entropies(logits: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """(B, C): each distribution's entropy, lse − Σ p · logit, one row at a time (a (C, V) temporary, not (B, C, V)
    several times over: at a 128k vocabulary a micro-batch's logits are gigabytes)."""
    out = torch.empty_like(lse)
    for b in range(logits.shape[0]):
        p = torch.exp(logits[b] - lse[b].unsqueeze(-1))
        out[b] = lse[b] - (p * logits[b]).sum(-1)
    return out


def micro_batches(n: int, size: int) -> list[range]:
    """The consecutive micro-batches of a rank's `n` completions."""
    return [range(i, min(i + size, n)) for i in range(0, n, size)]

"""Preference training (`--objective dpo`): TRL's DPOTrainer losses as a mean over the pairs of the global batch.

One forward per micro-batch of m pairs: its 2m sequences (chosen, then rejected; `data.pair_batches`), each
sequence's log-probability summed from the per-token ones (`model.sequence_log_probs`: the lean loss's chunks, no
whole logits). With the reference's log-probs (precomputed, or a frozen model's: `train.reference`), each loss type
gives one term per pair, TRL 1.16's formulas (`pair_terms`). The step's loss is

    Σ_types w · (Σ over the G pairs of the global batch of the type's term) / G   [+ w_sft · the chosen tokens' mean NLL]

each micro-batch adding its pairs' terms over the global count G (and its chosen tokens' log-probs over the global
chosen-token count): the same number whatever the world size, micro-batch, accumulation or mesh. TRL averages per
micro-batch, the same for the pair terms (all micro-batches hold m pairs) but not for `sft`, a token mean per
micro-batch there, over the global batch here. The logged metrics keep TRL's names: rewards/chosen and
rewards/rejected (β · the log-ratio against the reference), rewards/accuracies, rewards/margins, logps/chosen,
logps/rejected, each a mean over the global batch's pairs (`eval_` ones over the validation pairs).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F

from anygpu.config.objective import PAIR_LOSSES
from anygpu.data.collate import batch_to
from anygpu.data.order import eval_shards
from anygpu.model import sequence_log_probs
from anygpu.runtime import context_parallel, distributed
from anygpu.runtime.context_parallel import CPGroup

METRICS = (
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
)


@dataclass(frozen=True)
class LossConfig:
    loss_type: tuple[str, ...] = ("sigmoid",)
    weights: tuple[float, ...] = (1.0,)
    beta: float = 0.1
    label_smoothing: float = 0.0
    simpo_gamma: float = 0.5
    discopop_tau: float = 0.05

    @classmethod
    def of(cls, train_args) -> LossConfig:
        return cls(
            tuple(train_args.loss_type),
            tuple(train_args.weights()),
            train_args.beta,
            train_args.label_smoothing,
            train_args.simpo_gamma,
            train_args.discopop_tau,
        )

    @property
    def sft_weight(self) -> float:
        return sum(w for t, w in zip(self.loss_type, self.weights) if t == "sft")

    @property
    def only_simpo(self) -> bool:
        """No loss compares with a reference, and SimPO's rewards are its length-normalised log-probs (CPO's)."""
        return "simpo" in self.loss_type and not set(self.loss_type) - {"simpo", "sft"}


@dataclass
class PairLogps:
    """The sequence log-probs of m pairs and what the losses normalise them by."""

    chosen: torch.Tensor  # (m,) policy
    rejected: torch.Tensor
    ref_chosen: torch.Tensor  # (m,) reference (0 without one)
    ref_rejected: torch.Tensor
    completion: torch.Tensor  # (2m,) completion tokens of each sequence (TRL's completion_mask.sum)
    scored: torch.Tensor  # (2m,) tokens scored (completion tokens a previous token predicts)


def _term(kind: str, cfg: LossConfig, p: PairLogps) -> torch.Tensor:
    """TRL 1.16's per-pair loss of `kind` (DPOTrainer._compute_loss; simpo: CPOTrainer.cpo_loss)."""
    beta, ls = cfg.beta, cfg.label_smoothing
    chosen_lr, rejected_lr = p.chosen - p.ref_chosen, p.rejected - p.ref_rejected
    d = chosen_lr - rejected_lr
    m = p.chosen.shape[0]
    length_c, length_r = p.completion[:m].clamp(min=1), p.completion[m:].clamp(min=1)
    if kind == "sigmoid":
        return -F.logsigmoid(beta * d)
    if kind == "hinge":
        return torch.relu(1 - beta * d)
    if kind == "ipo":
        return (chosen_lr / length_c - rejected_lr / length_r - 1 / (2 * beta)) ** 2
    if kind == "sigmoid_norm":
        return -F.logsigmoid(beta * (chosen_lr / length_c - rejected_lr / length_r))
    if kind == "robust":
        return (-(1 - ls) * F.logsigmoid(beta * d) + ls * F.logsigmoid(-beta * d)) / (1 - 2 * ls)
    if kind == "exo_pair":
        qw, ql = torch.sigmoid(beta * d), torch.sigmoid(-beta * d)
        return qw * (F.logsigmoid(beta * d) - math.log1p(-ls)) + ql * (F.logsigmoid(-beta * d) - math.log(ls))
    if kind == "nca_pair":
        cr, rr = beta * chosen_lr, beta * rejected_lr
        return -F.logsigmoid(cr) - 0.5 * F.logsigmoid(-cr) - 0.5 * F.logsigmoid(-rr)
    if kind == "bco_pair":
        return -F.logsigmoid(beta * chosen_lr) - F.logsigmoid(-beta * rejected_lr)
    if kind == "sppo_hard":
        return (chosen_lr - 0.5 / beta) ** 2 + (rejected_lr + 0.5 / beta) ** 2
    if kind == "apo_zero":
        return 1 - torch.sigmoid(beta * chosen_lr) + torch.sigmoid(beta * rejected_lr)
    if kind == "apo_down":
        return torch.sigmoid(beta * chosen_lr) + 1 - torch.sigmoid(beta * d)
    if kind == "discopop":
        logits = beta * d
        mix = torch.sigmoid(logits / cfg.discopop_tau)
        return -F.logsigmoid(logits) * (1 - mix) + torch.exp(-logits) * mix
    assert kind == "simpo", kind
    logits = p.chosen / p.scored[:m].clamp(min=1) - p.rejected / p.scored[m:].clamp(min=1) - cfg.simpo_gamma / beta
    return -F.logsigmoid(beta * logits) * (1 - ls) - F.logsigmoid(-beta * logits) * ls


def pair_terms(cfg: LossConfig, p: PairLogps) -> torch.Tensor:
    """(m,): the weighted sum of every per-pair loss type's term (the sft term is a token mean: `sft_sum`)."""
    total = torch.zeros_like(p.chosen)
    for kind, weight in zip(cfg.loss_type, cfg.weights):
        if kind in PAIR_LOSSES:
            total = total + weight * _term(kind, cfg, p)
    return total


def rewards(cfg: LossConfig, p: PairLogps) -> tuple[torch.Tensor, torch.Tensor]:
    """TRL's logged rewards: β · the log-ratios (SimPO alone: β · the length-normalised log-probs, as CPO logs them)."""
    if cfg.only_simpo:
        m = p.chosen.shape[0]
        return cfg.beta * p.chosen / p.scored[:m].clamp(min=1), cfg.beta * p.rejected / p.scored[m:].clamp(min=1)
    return cfg.beta * (p.chosen - p.ref_chosen), cfg.beta * (p.rejected - p.ref_rejected)


def metric_sums(cfg: LossConfig, p: PairLogps) -> torch.Tensor:
    """(len(METRICS),) fp64: the sums over the pairs of what is logged as means."""
    with torch.no_grad():
        rc, rr = rewards(cfg, p)
        values = [rc.sum(), rr.sum(), (rc > rr).float().sum(), (rc - rr).sum(), p.chosen.sum(), p.rejected.sum()]
        return torch.stack([v.double() for v in values])


def scored_tokens(batch: dict[str, torch.Tensor], num_sequences: int) -> torch.Tensor:
    """(num_sequences,): the completion tokens of each sequence that a previous token predicts."""
    targets = (F.pad(batch["labels"], (0, 1), value=-100)[..., 1:] != -100).float().reshape(-1)
    return sequence_log_probs.sequence_sums(targets, batch["segment"], num_sequences)


Forward = Callable[..., Any]
RefLogps = Callable[..., torch.Tensor]  # a batch (under CP: its part, the group) → the reference's (2m,) log-probs


def pair_logps(
    model,
    call: Forward,
    batch: dict[str, torch.Tensor],
    reference: RefLogps | None,
    part: dict[str, torch.Tensor] | None = None,
    cp: CPGroup = context_parallel.NONE,
) -> PairLogps:
    """The policy's sequence log-probs of a batch's pairs (one forward: `call`), with the reference's; under CP from
    this rank's `part` of the rows, the sums added over the group."""
    n = batch["completion_tokens"].numel()
    m = n // 2
    seq = sequence_log_probs.pair_sequence_log_probs(model, call, batch, part, cp)
    if "ref_logps" in batch:
        ref = batch["ref_logps"].to(seq.device, seq.dtype)
    elif reference is not None:
        ref = reference(batch, part, cp).to(seq.device, seq.dtype)
    else:
        ref = torch.zeros_like(seq)
    completion = batch["completion_tokens"].to(seq.device, seq.dtype)
    return PairLogps(seq[:m], seq[m:], ref[:m], ref[m:], completion, scored_tokens(batch, n).to(seq.dtype))


class DPOObjective:
    """What both engines call for a step's micro-batches and for the evaluation under --objective dpo."""

    def __init__(self, cfg: LossConfig, reference: RefLogps | None, reference_line: str) -> None:
        self.cfg, self.reference, self.reference_line = cfg, reference, reference_line
        self._sums: torch.Tensor | None = None  # the step's metric sums, this rank's micro-batches
        self._pairs: torch.Tensor | None = None  # the step's global pair count

    def new_step(self, counts: torch.Tensor) -> None:
        """A step starts; `counts`: its global [pairs, chosen tokens] (all-reduced)."""
        self._sums, self._pairs = None, counts[0]

    def loss(
        self,
        model,
        call: Forward,
        batch: dict[str, torch.Tensor],
        counts: torch.Tensor,
        part: dict[str, torch.Tensor] | None = None,
        cp: CPGroup = context_parallel.NONE,
    ) -> torch.Tensor:
        """This micro-batch's share of the step's loss (its pair terms over the global pairs, its chosen tokens'
        NLL over the global chosen tokens): the shares of every micro-batch of every rank sum to the step's loss.
        Under CP each of the group's C ranks computes the same pairs' terms from the group's sums: a 1/C share each
        (the sums' backward brings every rank's part the whole gradient of the group's terms)."""
        p = pair_logps(model, call, batch, self.reference, part, cp)
        counts = counts.to(p.chosen.device)
        loss = pair_terms(self.cfg, p).sum() / counts[0]
        if self.cfg.sft_weight:
            loss = loss + self.cfg.sft_weight * -p.chosen.sum() / counts[1].clamp(min=1)
        sums = metric_sums(self.cfg, p)
        if cp.size > 1:
            loss, sums = loss / cp.size, sums / cp.size
        self._sums = sums if self._sums is None else self._sums + sums
        return loss

    def logged(self) -> dict[str, float]:
        """The step's metrics, means over the global batch's pairs (a collective: every rank calls it)."""
        sums = distributed.all_reduce_sum(self._sums.clone())
        return dict(zip(METRICS, (sums / self._pairs.to(sums.device)).tolist()))

    @torch.no_grad()
    def evaluate(self, model, call: Forward, dataset, collator, batch_size: int, rank: int, world: int, device):
        """eval_loss (the step loss's formula over every validation pair) and the eval_ metrics; every rank runs
        the same number of forwards (sharded parameters are gathered collectively), a short rank a dummy batch."""
        was_training = model.training
        model.eval()
        totals = torch.zeros(4 + len(METRICS), dtype=torch.float64, device=device)
        for idx in eval_shards(len(dataset), world, rank, batch_size):
            batch = batch_to(collator.read(dataset, idx or [0]), device)
            p = pair_logps(model, call, batch, self.reference)
            if idx:
                chosen_tokens = p.scored[: p.chosen.shape[0]].sum()
                found = [pair_terms(self.cfg, p).sum(), -p.chosen.sum(), chosen_tokens, len(idx)]
                totals += torch.cat(
                    [torch.stack([torch.as_tensor(v, device=device).double() for v in found]), metric_sums(self.cfg, p)]
                )
        distributed.all_reduce_sum(totals)
        if was_training:
            model.train()
        pairs = totals[3]
        loss = totals[0] / pairs + (
            self.cfg.sft_weight * totals[1] / totals[2].clamp(min=1) if self.cfg.sft_weight else 0
        )
        out = {"eval_loss": float(loss)}
        out.update({f"eval_{k}": float(v) for k, v in zip(METRICS, totals[4:] / pairs)})
        return out

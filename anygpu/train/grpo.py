"""The GRPO family's loss (`--objective grpo`): TRL 1.16's GRPOTrainer losses as a mean over the global batch.

A step's global batch holds N completions (`num_generations` per prompt) with T completion tokens in all. Each
completion has an advantage, its reward against its group's (`group_advantages`: TRL's, epsilon 1e-4 included). For
each of its tokens the policy's log-prob (with grad), the old policy's (the same, detached, when each generation
serves one optimizer step: TRL's num_iterations 1) and, for β > 0, the reference's give TRL's per-token loss

    −min(r · A, clip(r, 1 − ε, 1 + ε_high) · A) + β · (exp(ref − logp) − (ref − logp) − 1)

(the KL term times r by default: TRL's `use_bias_correction_kl`), where r is the token's ratio exp(logp − old), or under `importance_sampling_level="sequence"` (GSPO) the exp of the
sequence's mean log-ratio, one r for all its tokens. `grpo_loss` returns one micro-batch's share of the step's loss,
its sum over the global count, so the shares of every micro-batch of every rank sum to the step's loss whatever the
split (the caller counts with `batch_counts`, sums the counts over the step's micro-batches and all-reduces them
before the first forward, as `train.dpo` does with its pairs):

    grpo     Σ_completions (the completion's token mean of the loss) / N
             TRL: the same mean per micro-batch, / accumulation steps, averaged over ranks: equal to ours (every TRL
             micro-batch holds the same number of completions).
    bnpo     Σ_tokens loss / T
             TRL: a token mean per micro-batch (/ accumulation steps, averaged over ranks), which weights a token by
             1 / its micro-batch's token count: TRL's loss changes with the per-device split (TRL issue #3231).
             Globally normalised, bnpo is dapo.
    dapo     Σ_tokens loss / T
             TRL: over the generation batch's global token count (`num_items_in_batch`) × accumulation steps /
             steps_per_generation: equal to ours when a generation serves one optimizer step (TRL's default,
             steps_per_generation = gradient_accumulation_steps); with several, TRL divides each step by their mean
             token count, we by the step's own.
    dr_grpo  Σ_tokens loss / (N · max_completion_length)
             TRL: B · max_completion_length per micro-batch of B completions: equal to ours.

All four coincide with TRL when one micro-batch holds the whole batch (one rank, no accumulation). The logged
metrics keep TRL's names and definitions: `kl` (the k3 estimate, times r by default, a mean over completion tokens, only for β > 0),
`clip_ratio/low_mean`, `clip_ratio/high_mean`, `clip_ratio/region_mean` (the share of the tokens, or of the completions
at sequence level, whose ratio the clip cuts: r < 1 − ε with A < 0, r > 1 + ε_high with A > 0, either), `entropy`
(a token mean, where the caller gives the per-token entropies). TRL averages each over one micro-batch (and every
rank), then the micro-batches' values; here each is a mean over the global batch (`metric_sums`, all-reduced, then
`metric_means`). TRL's other losses (cispo, sapo, luspo, vespo), its two-sided `delta` clip, vLLM's importance
correction and the entropy mask and bonus are not here.
"""

from __future__ import annotations

import math

import torch

from anygpu.errors import UsageError

LOSS_TYPES = ("grpo", "dr_grpo", "dapo", "bnpo")
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")
SCALE_REWARDS = ("group", "batch", "none")
STD_EPSILON = 1e-4  # TRL's: advantages / (std + 1e-4)
# what `metric_sums` adds up, in order: the sums of the four metrics, then what they are means over
SUMS = (
    "kl",
    "clip_ratio/low_mean",
    "clip_ratio/high_mean",
    "clip_ratio/region_mean",
    "entropy",
    "tokens",
    "clipped_of",
)


def _check_choice(argument: str, value: object, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise UsageError(f"{argument} {value!r}: not one of the valid choices {', '.join(choices)}")


def _nanstd(x: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """TRL's `nanstd`: the std over the values that are not NaN, with Bessel's correction (NaN for fewer than two)."""
    keep = ~torch.isnan(x)
    count = keep.sum() if dim is None else keep.sum(dim, keepdim=True)
    mean = torch.nanmean(x) if dim is None else torch.nanmean(x, dim, keepdim=True)
    variance = torch.nanmean((x - mean) ** 2) if dim is None else torch.nanmean((x - mean) ** 2, dim)
    count = count if dim is None else count.squeeze(dim)
    correction = torch.where(count > 1, count / (count - 1), torch.full_like(variance, float("nan")))
    return torch.sqrt(variance * correction)


def group_advantages(rewards: torch.Tensor, num_generations: int, scale_rewards: str = "group") -> torch.Tensor:
    """(N,): each completion's advantage from the (N,) rewards of whole groups (`num_generations` consecutive
    completions of one prompt): its reward less its group's mean, over (std + 1e-4), the std its group's ("group",
    TRL's default), the whole batch's ("batch": pass the global batch's rewards) or none ("none"). As TRL 1.16's
    `_generate_and_score_completions` (sum_then_normalize): a NaN reward (unscorable) is left out of the mean and
    std, and its advantage is 0."""
    _check_choice("scale_rewards", scale_rewards, SCALE_REWARDS)
    if num_generations < 1 or rewards.numel() % num_generations:
        raise UsageError(
            f"num_generations {num_generations}: the {rewards.numel()} rewards are not whole groups of it; "
            "pass a number of completions per prompt that divides the batch"
        )
    mean = torch.nanmean(rewards.view(-1, num_generations), dim=1).repeat_interleave(num_generations)
    advantages = rewards - mean
    if scale_rewards != "none":
        advantages = advantages / (reward_stds(rewards, num_generations, scale_rewards) + STD_EPSILON)
    return torch.nan_to_num(advantages, nan=0.0)


def reward_stds(rewards: torch.Tensor, num_generations: int, scale_rewards: str) -> torch.Tensor:
    """(N,): the std each completion's advantage is scaled by, TRL's nanstd: the batch's under "batch", else its
    group's (what TRL also logs under "none"); 0 where a group or the batch holds one completion."""
    if scale_rewards == "batch":
        return _nanstd(rewards).expand_as(rewards) if rewards.numel() > 1 else torch.zeros_like(rewards)
    if num_generations == 1:
        return torch.zeros_like(rewards)
    return _nanstd(rewards.view(-1, num_generations), dim=1).repeat_interleave(num_generations)


def zero_std_fraction(rewards: torch.Tensor, num_generations: int, scale_rewards: str) -> float:
    """TRL's frac_reward_zero_std: the share of completions whose `reward_stds` is 0 as torch.isclose tells (a NaN
    std, of fewer than two scored rewards, is not 0)."""
    std = reward_stds(rewards, num_generations, scale_rewards)
    return torch.isclose(std, torch.zeros_like(std)).double().mean().item()


def batch_counts(completion_mask: torch.Tensor) -> torch.Tensor:
    """(2,) fp64: [completions, completion tokens] of a (B, T) micro-batch; summed over a step's micro-batches and
    ranks (all-reduced), the global counts `grpo_loss` divides by."""
    tokens = completion_mask.sum().double()
    return torch.stack([tokens.new_tensor(float(completion_mask.shape[0])), tokens])


def check_loss_args(loss_type: str, importance_sampling_level: str, beta: float, max_completion_length: int) -> None:
    """Refuse a value `grpo_loss` cannot use (run once, before any work)."""
    _check_choice("loss_type", loss_type, LOSS_TYPES)
    _check_choice("importance_sampling_level", importance_sampling_level, IMPORTANCE_SAMPLING_LEVELS)
    if beta < 0:
        raise UsageError(f"beta {beta}: the KL coefficient cannot be negative; pass 0 (no KL term) or more")
    if max_completion_length < 1:
        raise UsageError(f"max_completion_length {max_completion_length}: pass a positive number of tokens")


def grpo_loss(
    policy_logps: torch.Tensor,
    old_logps: torch.Tensor | None,
    ref_logps: torch.Tensor | None,
    advantages: torch.Tensor,
    completion_mask: torch.Tensor,
    counts: torch.Tensor,
    loss_type: str = "dapo",
    beta: float = 0.0,
    epsilon: float = 0.2,
    epsilon_high: float | None = None,
    importance_sampling_level: str = "token",
    max_completion_length: int = 512,  # TRL's default
    entropies: torch.Tensor | None = None,
    use_bias_correction_kl: bool = True,
    is_ratio: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(this micro-batch's share of the step's loss, its `metric_sums`). Per completion token, (B, T): the policy's
    log-probs, the old policy's (None: the policy's, detached), the reference's (needed for beta > 0), the completion
    mask; (B,) the advantages; `counts` the global [completions, completion tokens] (`batch_counts`, all-reduced).
    `epsilon_high` None is `epsilon` (TRL's). `use_bias_correction_kl` (TRL's, and its default): the KL term times the
    ratio r (with its gradient), the unbiased reverse-KL gradient of DeepSeek-V3.2. `is_ratio`: --use_vllm's
    importance-sampling weights ((B, T) or (B, 1), `vllm_is_ratio`), on the clipped term, not the KL (TRL's)."""
    check_loss_args(loss_type, importance_sampling_level, beta, max_completion_length)
    if beta > 0 and ref_logps is None:
        raise UsageError(f"beta {beta}: the KL term needs the reference's log-probs; pass ref_logps, or beta 0")
    mask = completion_mask.to(policy_logps.dtype)
    old_logps = policy_logps.detach() if old_logps is None else old_logps
    adv = advantages.to(policy_logps.dtype).unsqueeze(1)  # (B, 1)
    log_ratio = policy_logps - old_logps
    if importance_sampling_level == "sequence":  # GSPO: one ratio per completion, its tokens' mean log-ratio
        log_ratio = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    ratio = torch.exp(log_ratio)  # (B, T), or (B, 1) at sequence level
    eps_high = epsilon if epsilon_high is None else epsilon_high
    clipped = torch.clamp(ratio, 1 - epsilon, 1 + eps_high)
    per_token = -torch.min(ratio * adv, clipped * adv)
    if is_ratio is not None:
        per_token = per_token * is_ratio.to(per_token.dtype)
    kl = None
    if beta > 0:
        d = ref_logps - policy_logps
        kl = torch.exp(d) - d - 1  # k3
        if use_bias_correction_kl:
            kl = kl * ratio
        per_token = per_token + beta * kl
    per_token = per_token.expand_as(mask) * mask
    counts = counts.to(policy_logps.device, policy_logps.dtype)
    if loss_type == "grpo":
        loss = (per_token.sum(-1) / mask.sum(-1).clamp(min=1.0)).sum() / counts[0]
    elif loss_type == "dr_grpo":
        loss = per_token.sum() / (counts[0] * max_completion_length)
    else:  # dapo, bnpo: a mean over the global batch's completion tokens
        loss = per_token.sum() / counts[1].clamp(min=1.0)
    sums = metric_sums(ratio, adv, mask, kl, entropies, epsilon, eps_high)
    return loss, sums


IS_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")  # TRL's vllm_importance_sampling_mode


@torch.no_grad()
def vllm_is_ratio(
    old_logps: torch.Tensor,
    sampling_logps: torch.Tensor,
    completion_mask: torch.Tensor,
    mode: str = "sequence_mask",
    clip_min: float | None = None,
    clip_max: float | None = 3.0,
) -> torch.Tensor:
    """TRL's correction for vLLM's sampler not being the policy: exp(old − sampling log-prob) per token (B, T), or per
    completion from the sum over its tokens (B, 1); `*_truncate` clamps it to [clip_min, clip_max], `*_mask` sets
    what falls outside to 0. A token vLLM gave no log-prob for (NaN) counts as ratio 1."""
    diff = torch.nan_to_num((old_logps - sampling_logps) * completion_mask, nan=0.0)
    if mode.startswith("sequence"):
        diff = diff.sum(-1, keepdim=True)
    ratio = torch.exp(diff)
    if mode.endswith("truncate"):
        return torch.clamp(ratio, min=clip_min, max=clip_max)
    low = -math.inf if clip_min is None else clip_min
    high = math.inf if clip_max is None else clip_max
    return ratio.masked_fill((ratio < low) | (ratio > high), 0.0)


@torch.no_grad()
def metric_sums(
    ratio: torch.Tensor,
    adv: torch.Tensor,
    mask: torch.Tensor,
    kl: torch.Tensor | None,
    entropies: torch.Tensor | None,
    epsilon: float,
    epsilon_high: float,
) -> torch.Tensor:
    """(len(SUMS),) fp64: the sums of a micro-batch's logged metrics (0 for kl without β, entropy without
    entropies), then its completion tokens and the count the clip ratios are shares of (tokens, or completions at
    sequence level: TRL's)."""
    low = (ratio < 1 - epsilon) & (adv < 0)
    high = (ratio > 1 + epsilon_high) & (adv > 0)
    if ratio.shape[1] == 1:  # sequence level: shares of the completions
        weight, clipped_of = torch.ones_like(ratio), ratio.new_tensor(float(ratio.shape[0]))
    else:
        weight, clipped_of = mask, mask.sum()
    zero = mask.new_zeros(())
    values = [
        (kl * mask).sum() if kl is not None else zero,
        (low * weight).sum(),
        (high * weight).sum(),
        ((low | high) * weight).sum(),
        (entropies * mask).sum() if entropies is not None else zero,
        mask.sum(),
        clipped_of,
    ]
    return torch.stack([v.double() for v in values])


def metric_means(sums: torch.Tensor, beta: float, with_entropy: bool = False) -> dict[str, float]:
    """The logged metrics from `metric_sums` added over the global batch (kl only for β > 0, entropy only where the
    entropies were given)."""
    total = dict(zip(SUMS, sums.tolist()))
    tokens, clipped_of = max(total["tokens"], 1.0), max(total["clipped_of"], 1.0)
    out = {"kl": total["kl"] / tokens} if beta > 0 else {}
    for name in ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean"):
        out[name] = total[name] / clipped_of
    if with_entropy:
        out["entropy"] = total["entropy"] / tokens
    return out

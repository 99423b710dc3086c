"""The router auxiliary (load-balancing) loss of mixture-of-experts models, as a global-batch mean.

Mixtral, Qwen2-MoE and their kin add `router_aux_loss_coef × aux` to the loss when the config sets
`output_router_logits`; `aux` is computed over whatever batch the forward saw, so with gradient
accumulation and several ranks the step would sum W·A micro-batch values, each over a different
set of tokens: the result would depend on the world size and the micro-batch split. Here the aux
loss is computed per *row* of the global batch (the model's own `load_balancing_loss_func` over that
row's real tokens: its samples, not the padding that fills it to the micro-batch's widest row, whose
width depends on the split) and averaged over the G rows, so the step's loss is
    mean over target tokens of the cross-entropy + coef · mean over rows of the per-row aux,
a function of the global batch only. A LoRA adapter changes nothing: the base model's function and
numbers are used. Under context parallelism (a rank holds part of each row) the router logits of the C
parts are gathered first: every rank of a CP group computes the rows' aux losses whole and adds 1/C of
them (the gather's backward sums the C ranks' gradients back to each part's logits).
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
from torch import nn

from anygpu.data.collate import real_tokens
from anygpu.runtime import context_parallel
from anygpu.runtime.blocks import hf_model


def aux_loss_coef(model: nn.Module) -> float:
    """The weight of the router loss in the training loss (0 when the config leaves it out)."""
    model = hf_model(model)
    config = getattr(model, "config", None)
    if not getattr(config, "output_router_logits", False):
        return 0.0
    return float(getattr(model, "router_aux_loss_coef", None) or getattr(config, "router_aux_loss_coef", 0.0) or 0.0)


def eval_kwargs(model: nn.Module) -> dict[str, bool]:
    """Forward options for evaluation, whose loss is the cross-entropy alone."""
    return {"output_router_logits": False} if aux_loss_coef(model) else {}


def _balancing_fn(model: nn.Module):
    for cls in type(model).__mro__:
        fn = getattr(sys.modules.get(cls.__module__), "load_balancing_loss_func", None)
        if fn is not None:
            return fn
    raise ValueError(
        f"{type(model).__name__}: output_router_logits is set but its module has no load_balancing_loss_func; "
        "set output_router_logits false in the config."
    )


def per_sample_aux(model: nn.Module, router_logits: tuple[torch.Tensor, ...], mask: torch.Tensor) -> torch.Tensor:
    """The model's load-balancing loss of each row alone over its real tokens (`mask`, rows × length), shape (rows,)."""
    model = hf_model(model)
    fn = _balancing_fn(model)
    num_experts = getattr(model, "num_experts", None) or model.config.num_local_experts
    top_k = getattr(model, "num_experts_per_tok", None) or model.config.num_experts_per_tok
    rows = mask.shape[0]
    per_layer = [logits.reshape(rows, -1, logits.shape[-1]) for logits in router_logits]
    return torch.stack(
        [
            torch.as_tensor(fn(tuple(layer[i] for layer in per_layer), num_experts, top_k, mask[i : i + 1]))
            for i in range(rows)
        ]
    )


def global_batch_loss(
    model: nn.Module,
    output,
    batch: dict[str, torch.Tensor],
    global_batch_size: int,
    cp: context_parallel.CPGroup = context_parallel.NONE,
) -> torch.Tensor:
    """This micro-batch's share of the step's loss: the model's own, with its micro-batch aux loss
    replaced by the sum of its rows' aux losses / G (see the module docstring); `batch`: the whole rows."""
    coef = aux_loss_coef(model)
    if not coef or getattr(output, "aux_loss", None) is None:
        return output.loss
    cross_entropy = output.loss - coef * output.aux_loss.to(output.loss.device)
    logits, mask = output.router_logits, real_tokens(batch)
    if cp.size > 1:  # this rank's part of each row: the rows' logits whole, padded to a multiple of C
        rows = mask.shape[0]
        logits = tuple(context_parallel.gather_tokens(layer, cp, rows) for layer in logits)
        mask = F.pad(mask, (0, logits[0].shape[0] // rows - mask.shape[1]))
    aux = per_sample_aux(model, logits, mask)
    return cross_entropy + coef * aux.sum().to(cross_entropy.device) / (global_batch_size * cp.size)


# routers that draw random numbers in training, from the rank's own generator (dropout's masks are keyed per sample,
# `anygpu.model.dropout`; these are not): PhiMoE samples its experts (sparsemixer) whatever its config says
SAMPLING_ROUTERS = {"phimoe": "samples its experts in training (sparsemixer)"}


def random_router_note(model: nn.Module) -> str | None:
    """The banner's warning for a router whose training draws come from each rank's generator, else None."""
    config = hf_model(model).config
    sampling = SAMPLING_ROUTERS.get(config.model_type)
    noise = {k: v for k, v in config.to_dict().items() if "jitter" in k and isinstance(v, float) and v > 0}
    if sampling:  # PhiMoE's router_jitter_noise is its sampler's threshold, not noise
        noise.pop("router_jitter_noise", None)
    why = ([sampling] if sampling else []) + [
        f"{k} {v:g} multiplies its inputs by noise" for k, v in sorted(noise.items())
    ]
    if not why:
        return None
    fix = "" if sampling else "; set it to 0 in the config for an invariant curve"
    return (
        f"warning: the router {'; '.join(why)}, drawn from each rank's generator: the curve depends on the number of "
        f"ranks and the micro-batch (not keyed per sample like dropout){fix}"
    )

"""The router auxiliary (load-balancing) loss of mixture-of-experts models, as a global-batch mean.

Mixtral, Qwen2-MoE and their kin add `router_aux_loss_coef × aux` to the loss when the config sets
`output_router_logits`; `aux` is computed over whatever batch the forward saw, so with gradient
accumulation and several ranks the step would sum W·A micro-batch values, each over a different
set of tokens: the result would depend on the world size and the micro-batch split. Here the aux
loss is computed per *sample* (the model's own `load_balancing_loss_func` over one sequence's
tokens) and averaged over the G samples of the global batch, so the step's loss is
    mean over target tokens of the cross-entropy + coef · mean over samples of the per-sample aux,
a function of the global batch only.
"""
from __future__ import annotations

import sys

import torch
from torch import nn


def aux_loss_coef(model: nn.Module) -> float:
    """The weight of the router loss in the training loss (0 when the config leaves it out)."""
    config = getattr(model, "config", None)
    if not getattr(config, "output_router_logits", False):
        return 0.0
    return float(getattr(model, "router_aux_loss_coef", 0.0) or 0.0)


def eval_kwargs(model: nn.Module) -> dict[str, bool]:
    """Forward options for evaluation, whose loss is the cross-entropy alone."""
    return {"output_router_logits": False} if aux_loss_coef(model) else {}


def _balancing_fn(model: nn.Module):
    for cls in type(model).__mro__:
        fn = getattr(sys.modules.get(cls.__module__), "load_balancing_loss_func", None)
        if fn is not None:
            return fn
    raise ValueError(f"{type(model).__name__}: output_router_logits is set but its module has no load_balancing_loss_func; "
                     "set output_router_logits false in the config.")


def per_sample_aux(model: nn.Module, router_logits: tuple[torch.Tensor, ...], batch_size: int,
                   attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """The model's load-balancing loss of each sequence alone, shape (batch_size,)."""
    fn = _balancing_fn(model)
    num_experts = getattr(model, "num_experts", None) or model.config.num_local_experts
    top_k = model.num_experts_per_tok
    per_layer = [logits.reshape(batch_size, -1, logits.shape[-1]) for logits in router_logits]
    return torch.stack([
        torch.as_tensor(fn(tuple(layer[i] for layer in per_layer), num_experts, top_k,
                           None if attention_mask is None else attention_mask[i:i + 1]))
        for i in range(batch_size)
    ])


def global_batch_loss(model: nn.Module, output, batch_size: int, global_batch_size: int,
                      attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """This micro-batch's share of the step's loss: the model's own, with its micro-batch aux loss
    replaced by the sum of its samples' aux losses / G (see the module docstring)."""
    coef = aux_loss_coef(model)
    if not coef or getattr(output, "aux_loss", None) is None:
        return output.loss
    cross_entropy = output.loss - coef * output.aux_loss.to(output.loss.device)
    aux = per_sample_aux(model, output.router_logits, batch_size, attention_mask)
    return cross_entropy + coef * aux.sum().to(cross_entropy.device) / global_batch_size

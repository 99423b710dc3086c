"""Activation checkpointing of the decoder layers: full, or selective (torchtitan's per-op policy).

Both go through transformers' own mechanism (`activation_checkpointing_enable`), which checkpoints each decoder
layer's `forward`: module hooks (FSDP2's all-gathers) stay outside the recomputation, and a compiled layer
(`Module.compile` compiles the call that runs `forward`) traces the checkpoint itself, as torchtitan applies
checkpointing before compile. Non-reentrant checkpointing composes with FSDP2's hooks and with torch.compile.

- full: a layer keeps only its input; the backward recomputes its whole forward (one more forward: ~4/3 the
  step's FLOPs).
- selective: the outputs of the expensive ops are kept — every matrix multiplication (the q/k/v, output, gate, up
  and down projections, FP8's scaled ones included), the attention kernel (its output and log-sum-exp, so the
  attention is never recomputed) and the amax reductions FP8's scales come from — and the cheap elementwise rest
  (norms, rotary embeddings, activations, residual adds) is recomputed. At Llama shapes a layer then keeps about
  2·hidden + 2·intermediate + q + 2·kv values per token instead of hidden (full) or about twice as much (none), for
  almost no recomputed FLOPs (`anygpu.planning.memory_plan.activation_bytes` counts each).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

POLICIES = ("full", "selective")
_NOTE = "_anygpu_checkpointing"


def saved_ops() -> set[Any]:
    """The ops whose outputs selective checkpointing keeps (those this torch build has)."""
    aten = torch.ops.aten
    names = (
        "mm",
        "addmm",
        "_scaled_mm",
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_fused_attention_overrideable",
        "_flash_attention_forward",
        "_efficient_attention_forward",
    )
    ops = {getattr(aten, n).default for n in names if hasattr(aten, n)}
    ops.add(aten.max.default)  # an FP8 scale's amax: cheap to keep, and recomputing it could round differently
    flex = getattr(getattr(torch.ops, "higher_order", None), "flex_attention", None)
    if flex is not None:  # flex attention's output too (torchtitan's save list): GPU-only, untested on the CPU
        ops.add(flex)
    reduce_scatter = getattr(getattr(torch.ops, "_c10d_functional", None), "reduce_scatter_tensor", None)
    if reduce_scatter is not None:
        ops.add(reduce_scatter.default)
    return ops


def selective_context() -> tuple[Any, Any]:
    """The (forward, recompute) context pair `torch.utils.checkpoint` takes as `context_fn` for selective checkpointing."""
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    keep = saved_ops()

    def policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
        return CheckpointPolicy.MUST_SAVE if op in keep else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def checkpoint_kwargs(policy: str) -> dict[str, Any]:
    """The keyword arguments of `torch.utils.checkpoint.checkpoint` for `policy`."""
    if policy not in POLICIES:
        raise ValueError(f"checkpointing policy {policy!r}: use one of {', '.join(POLICIES)}")
    kwargs: dict[str, Any] = {"use_reentrant": False}
    if policy == "selective":
        context: Callable[[], tuple[Any, Any]] = selective_context
        kwargs["context_fn"] = context
    return kwargs


def enable(model: nn.Module, policy: str | None) -> None:
    """Checkpoint every decoder layer of `model` (a transformers model, possibly PEFT-wrapped) with `policy`;
    None: no checkpointing."""
    if policy is None:
        return
    model.activation_checkpointing_enable(activation_checkpointing_kwargs=checkpoint_kwargs(policy))
    setattr(model, _NOTE, policy)


def mark(model: nn.Module, policy: str) -> None:
    """Say in the banner that something else (Trainer) checkpoints the model's layers with `policy`."""
    setattr(model, _NOTE, policy)


def note(model: nn.Module) -> str | None:
    """The banner's line on activation checkpointing, or None without it."""
    policy = getattr(model, _NOTE, None)
    if policy == "selective":
        return "activation checkpointing: selective (matmul and attention outputs kept, the rest recomputed)"
    if policy == "full":
        return "activation checkpointing: full (each decoder layer recomputed in the backward)"
    return None

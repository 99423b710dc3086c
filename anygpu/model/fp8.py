"""FP8 training of the decoder layers' linear layers with torchao's float8 (`--fp8 tensorwise|rowwise`).

A model transform applied once on the meta model, before checkpointing, compile and sharding (torchtitan's
order): each `nn.Linear` inside a decoder layer whose two dimensions are multiples of 16 (what FP8 matmuls take)
becomes torchao's `Float8Linear`, which casts its input, weight and output gradient to FP8 with dynamic scales
and multiplies them in FP8; its weight stays a parameter of the training dtype under the same name, so
checkpoints, loading and the export are those of the model without FP8. Left in high precision: the output
projection (the lean loss multiplies by its weight itself, and the logits are where precision matters most),
MoE routers (a rounded router logit changes which expert a token goes to), layers FP8 cannot take, and a MoE's
routed experts (3-D weights computed by a grouped GEMM, not `nn.Linear`: torchao's FP8 grouped GEMM for them is a
prototype, not wired here).

Recipes (torchao's names):
- `rowwise`: one scale per row of each operand (per token for activations, per output feature for weights, and
  per feature over the micro-batch's tokens for the weight gradient), rounded to powers of two.
- `tensorwise`: one scale per tensor, rounded to powers of two here (torchao's default leaves them exact); under
  FSDP2 on a GPU the weights are all-gathered in FP8 (half the bytes), their scale taken over the whole weight.

What the same-curve promise keeps: a power-of-two scale only shifts an FP8 number's exponent, so a value rounds to
the same FP8 mantissa whatever the scale, except where it falls below FP8's normal range (under 2^-15 of the scaled
tensor's largest value: its sub-normals) or above it. Rowwise scales activations and output gradients per token and
weights per row; only the weight gradient's scale is taken over the micro-batch's tokens, and its sub-normals move
the gradients no more than float rounding does: one step's gradients are the same on any world size and micro-batch
to float tolerance. Tensorwise scales each activation over the whole micro-batch: another micro-batch size rounds the
sub-normals of its smaller rows differently, and FP8's rounding in the next layers magnifies that (one step's
gradients at micro-batch 1 and 4 are 5-7% apart at hidden 192-256, half FP8's own distance from fp32); at one
micro-batch size the world size changes only the order of the gradient sum. Weights are scaled over the whole
weight, sharded or not. Neither recipe keeps the curve to float tolerance over a run: a float-rounding difference
(the sum order, which the world size and the micro-batch change) now and then moves a value across an FP8 rounding
boundary, a difference of FP8's size (2^-4 relative) that moves more, so from the third step or so two layouts
differ like two FP8 runs, within FP8's own effect on the loss. The weight gradient in high precision (torchao's
`rowwise_with_gw_hp`) does not change that (measured: docs/fp8.md).

On a CPU there are no FP8 matmuls: torchao emulates them (the same casts and roundings, matmuls in high
precision), which the banner says; the FP8 all-gather is off there (gloo has no float8 type), which changes
nothing but the weights' scale rounding. GPUs without FP8 (NVIDIA before compute capability 8.9, AMD before
gfx942) are refused.
"""

from __future__ import annotations

import dataclasses
import logging

import torch
from torch import nn

from anygpu.errors import UsageError
from anygpu.runtime import expert_parallel, hardware
from anygpu.runtime.blocks import decoder_layer_classes

logger = logging.getLogger(__name__)

_NOTE = "_anygpu_fp8_note"
_ALL_GATHER = "_anygpu_fp8_all_gather"


def check_args(fp8: str | None, engine: str, use_peft: bool) -> None:
    """Refuse what FP8 cannot be combined with, from the arguments alone (the recipe name: `TrainArguments`)."""
    if fp8 is None:
        return
    if engine != "fsdp":
        raise UsageError(f"--fp8 {fp8}: FP8 training is the FSDP2 engine's: use --engine fsdp, or leave --fp8 out.")
    if use_peft:
        raise UsageError(
            f"--fp8 {fp8} with --use_peft true: the frozen base of a LoRA run is not converted to FP8; "
            "leave --fp8 out, or train without LoRA."
        )


def gpu_has_fp8() -> tuple[bool, str]:
    """(whether this process's GPU multiplies in FP8, what it is): NVIDIA compute capability ≥ 8.9 (Ada,
    Hopper, Blackwell), AMD gfx942 and later (MI300X, MI325X, MI355X)."""
    if hardware.vendor() == "nvidia":
        major, minor = torch.cuda.get_device_capability()
        return (major, minor) >= (8, 9), f"compute capability {major}.{minor}"
    arch = (getattr(torch.cuda.get_device_properties(0), "gcnArchName", "") or "").split(":")[0]
    return arch.startswith(("gfx942", "gfx950")), arch or "an unknown gfx architecture"


def check_hardware(fp8: str | None) -> None:
    """Refuse --fp8 on a GPU without FP8 matmuls (before any GPU work); a CPU emulates them."""
    if fp8 is None or hardware.vendor() == "cpu":
        return
    ok, what = gpu_has_fp8()
    if not ok:
        name = torch.cuda.get_device_name(0)
        raise UsageError(
            f"--fp8 {fp8}: {name} ({what}) has no FP8 matmuls (NVIDIA needs compute capability 8.9 or later, "
            "AMD gfx942 or later): leave --fp8 out and train in --bf16."
        )


def float8_config(recipe: str, emulate: bool, all_gather: bool):
    """torchao's recipe, with power-of-two scales and the FP8 all-gather as chosen."""
    from torchao.float8 import Float8LinearConfig

    config = Float8LinearConfig.from_recipe_name(recipe)
    changes = {"emulate": emulate, "round_scales_to_power_of_2": True}
    if recipe == "tensorwise":
        changes["enable_fsdp_float8_all_gather"] = all_gather
    return dataclasses.replace(config, **changes)


def _skip(name: str, module: nn.Linear) -> str | None:
    """Why this linear layer stays in high precision (None: it is converted)."""
    last = name.rsplit(".", 1)[-1]
    if last in ("gate", "router") or "router" in name:
        return "router"
    if module.in_features % 16 or module.out_features % 16:
        return "shape"
    return None


def convert(model: nn.Module, recipe: str | None, device: torch.device, sharded: bool) -> int:
    """Convert the decoder layers' linear layers in place (parameters may still be on meta); returns how many.
    `sharded`: the model will be FSDP2-sharded (tensorwise all-gathers FP8 weights there, on a GPU)."""
    if recipe is None:
        return 0
    from torchao.float8 import convert_to_float8_training

    emulate = device.type != "cuda"
    all_gather = recipe == "tensorwise" and sharded and not emulate
    layers = tuple(decoder_layer_classes(model))
    inside = {id(m) for layer in model.modules() if isinstance(layer, layers) for m in layer.modules()}
    skipped: dict[str, int] = {}

    def keep(module: nn.Module, name: str) -> bool:
        if not isinstance(module, nn.Linear) or type(module) is not nn.Linear:
            return True  # containers are visited; only plain linear layers are candidates
        why = "outside the decoder layers" if id(module) not in inside else _skip(name, module)
        if why:
            skipped[why] = skipped.get(why, 0) + 1
        return why is None

    experts = len(expert_parallel.experts_modules(model))
    if experts:
        skipped["experts"] = experts
    before = sum(type(m) is nn.Linear for m in model.modules())
    convert_to_float8_training(model, module_filter_fn=keep, config=float8_config(recipe, emulate, all_gather))
    converted = before - sum(type(m) is nn.Linear for m in model.modules())
    if converted == 0:
        raise UsageError(
            f"--fp8 {recipe}: none of {type(model).__name__}'s linear layers can train in FP8 (their dimensions "
            "must be multiples of 16, inside the decoder layers): leave --fp8 out."
        )
    setattr(model, _ALL_GATHER, all_gather)
    setattr(model, _NOTE, _note_text(recipe, converted, skipped, emulate, all_gather))
    return converted


SKIPPED = {
    "outside the decoder layers": "the output projection",
    "router": "{n} router(s)",
    "shape": "{n} with dimensions FP8 cannot take",
    "experts": "the routed experts of {n} MoE layer(s) (grouped 3-D weights, not linear layers)",
}


def _note_text(recipe: str, converted: int, skipped: dict[str, int], emulate: bool, all_gather: bool) -> str:
    kept = ", ".join(SKIPPED[why].format(n=n) for why, n in sorted(skipped.items()))
    how = "emulated on the CPU (FP8 casts, high-precision matmuls)" if emulate else "FP8 matmuls"
    scales = (
        "scales per token and weight row (the weight gradient's over the micro-batch's tokens: only its sub-normals "
        "move), powers of two: a step's gradients are the same on any GPU count and micro-batch"
        if recipe == "rowwise"
        else "scales per micro-batch tensor, powers of two: a step's gradients are the same on any GPU count at one "
        "micro-batch size, not across micro-batch sizes (their sub-normals round differently)"
    )
    promise = (
        f"{scales}; curves on other GPU counts and micro-batches agree to FP8's own effect on the loss, not to float "
        "tolerance (FP8 rounding magnifies float-rounding differences: docs/fp8.md)"
    )
    return (
        f"FP8 {recipe} (torchao float8): {converted} linear layers, {how}"
        + (", weights all-gathered in FP8" if all_gather else "")
        + (f"; kept in high precision: {kept}" if kept else "")
        + f"; {promise}"
    )


def note(model: nn.Module) -> str | None:
    """The banner's FP8 line, or None without --fp8."""
    return getattr(model, _NOTE, None)


def attach(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Keep the FP8 all-gather's weight scales current: after every optimizer step, and now."""
    if getattr(model, _ALL_GATHER, False):
        optimizer.register_step_post_hook(lambda *_: sync_scales(model))
        sync_scales(model)


def sync_scales(model: nn.Module) -> None:
    """After the weights change (an optimizer step, a load): the FP8 all-gather's weight scales, computed for every
    layer in one batched reduction (torchao's precompute) instead of one per layer inside the all-gather."""
    if getattr(model, _ALL_GATHER, False):
        from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

        precompute_float8_dynamic_scale_for_fsdp(model)


def plain(tensor: torch.Tensor) -> torch.Tensor:
    """A gathered weight as a plain tensor: torchao's FP8 all-gather wrapper unwrapped (the export and any state
    dict hold the training dtype, never FP8)."""
    inner = getattr(tensor, "_tensor", None)
    return inner if isinstance(inner, torch.Tensor) and type(tensor).__name__.startswith("WeightWith") else tensor

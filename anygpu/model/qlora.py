"""QLoRA: the frozen base's linear weights held in 4-bit NormalFloat (torchao's `NF4Tensor`), the adapter trained as
with LoRA (`anygpu.model.lora`).

The format is bitsandbytes' nf4 with nested quantisation: blocks of 64 weights share one absmax scale, and the
scales are quantised again to int8 in blocks of 256 (about their mean), so a weight costs 4 bits + 8/64 bits of
scale (~0.52 bytes per parameter instead of 2 in bf16). A linear layer's forward dequantises its weight to the
compute dtype (torchao's `linear_nf4`); its backward reaches the input only (the base is frozen).

The same curve on any world size: each weight is quantised whole — every rank reads the whole tensor (one at a time:
the largest is one 70B MLP matrix, 0.5 GB in bf16), quantises it as one process would, and keeps its rows. Quantising
only a rank's rows would give other scales (the scales' mean is over the whole tensor). FSDP2 then shards the
quantised tensor itself (`NF4Tensor.fsdp_pre_all_gather`: codes, scales and their factors gathered in 4 bits, the
base never exists in bf16 on a rank); a weight whose rows do not split into whole 64 × 256-element scale blocks
over the shard group (e.g. 4096 rows over 3 ranks) is kept whole on each rank instead (`nf4.unsplittable`: FSDP2's
`ignored_params`), which gives the same numbers with more memory; so is every one on a shard group of one rank, where
FSDP2 skips the all-gather and could not rebuild NF4 (see `nf4.unsplittable`). Which weights are 4-bit depends on
their shapes only (`quantisable`), never on the world size.

Which: every `nn.Linear` of the base but the output head (bitsandbytes' `load_in_4bit` keeps `lm_head` too), whose
weight's element count is a multiple of 64 × 256 (real models' are; a tiny model's smallest may not be, and stays in
the compute dtype, as the banner says). Embeddings, norms, biases and MoE expert banks (3-D) keep the compute dtype.
"""

from __future__ import annotations

import torch
from torch import nn

from anygpu.config import nf4
from anygpu.config.nf4 import BLOCK, SCALER_BLOCK, is_4bit
from anygpu.runtime import expert_parallel

_SHARDED = ("quantized_scalers", "quantization_factor", "quantized_data")  # split by rows; the rest is per tensor


def quantisable(name: str, module: nn.Module, head: nn.Module | None, frozen_only: bool = True) -> bool:
    """Whether `module`'s weight is held in 4 bits (see the module docstring); `frozen_only=False`: whether it would
    be, in a plain base whose weights all require gradients."""
    weight = getattr(module, "weight", None)
    return (
        type(module) is nn.Linear
        and module is not head
        and not name.endswith("lm_head")
        and weight is not None
        and not (frozen_only and weight.requires_grad)
        and nf4.fits(tuple(weight.shape))
    )


def modules(model: nn.Module) -> dict[str, nn.Linear]:
    """The base's linear layers whose weights are (or will be) 4-bit, by name."""
    head = model.get_output_embeddings()  # a PEFT model passes it on to its base
    return {name: m for name, m in model.named_modules() if quantisable(name, m, head)}


def convert(model: nn.Module) -> dict[str, nn.Linear]:
    """Replace the quantisable frozen weights of a meta model by (meta) NF4 tensors in their dtype, before FSDP2
    shards them; `assign` fills them. Returns the converted layers."""
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4

    found = modules(model)
    for module in found.values():
        module.weight = nn.Parameter(to_nf4(module.weight, BLOCK, SCALER_BLOCK), requires_grad=False)
    return found


@torch.no_grad()
def fill(param: torch.Tensor, full: torch.Tensor) -> None:
    """Quantise the whole `full` weight and keep this rank's rows of it in `param` (plain or FSDP2-sharded NF4)."""
    from torch.distributed.tensor import DTensor, Shard
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4

    local = param._local_tensor if isinstance(param, DTensor) else param  # not to_local(): that is a view
    quantised = to_nf4(full.to(local.quantized_data.device, param.dtype).contiguous(), BLOCK, SCALER_BLOCK)
    if isinstance(param, DTensor):
        for dim, placement in enumerate(param.placements):
            if isinstance(placement, Shard):
                mesh = param.device_mesh
                quantised = torch.chunk(quantised, mesh.size(dim), dim=0)[mesh.get_local_rank(dim)]
    for name in _SHARDED:
        getattr(local, name).copy_(getattr(quantised, name))
    # per tensor, not gathered: FSDP2 rebuilds the whole weight with the shard's own (the same on every rank)
    local.scaler_mean, local.nf4 = quantised.scaler_mean, quantised.nf4


def dequantised(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """What a 4-bit layer computes with: `weight` quantised as a run quantises it, then dequantised, in `dtype`."""
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4

    return to_nf4(weight.to(dtype).contiguous(), BLOCK, SCALER_BLOCK).get_original_weight()


@torch.no_grad()
def dequantise_base(model: nn.Module, dtype: torch.dtype) -> None:
    """A plain (unwrapped, unsharded) base's weights that a QLoRA run held in 4 bits, replaced by what it computed
    with (`dequantised`), in their own dtype: the base a merge goes over."""
    head = model.get_output_embeddings()
    for name, module in model.named_modules():
        if quantisable(name, module, head, frozen_only=False):
            module.weight.copy_(dequantised(module.weight, dtype).to(module.weight.dtype))


def quantised_from(model: nn.Module) -> torch.dtype | None:
    """The dtype a QLoRA run quantised its base from (its 4-bit weights' dtype), None without 4-bit weights."""
    layers = modules_4bit(model)
    return layers[0].weight.dtype if layers else None


def modules_4bit(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if isinstance(m, nn.Linear) and is_4bit(m.weight)]


def local_bytes(weight: torch.Tensor) -> int:
    """Bytes of a 4-bit weight this rank really holds (its NF4 tensors: codes, scales, factors, mean, code book)."""
    local = getattr(weight, "_local_tensor", weight)
    names = ("quantized_data", "quantized_scalers", "quantization_factor", "scaler_mean", "nf4")
    return sum(getattr(local, n).numel() * getattr(local, n).element_size() for n in names)


def note(model: nn.Module) -> str | None:
    """The banner's line: how many linear weights are 4-bit, what they weigh whole and on this rank (measured)."""
    layers = modules_4bit(model)
    if not layers:
        return None
    dtype = layers[0].weight.dtype
    whole = sum(nf4.nbytes(m.weight.numel(), dtype.itemsize) for m in layers)
    unquantised = sum(m.weight.numel() * dtype.itemsize for m in layers)
    here = sum(local_bytes(m.weight) for m in layers)
    kept = sum(1 for m in model.modules() if isinstance(m, nn.Linear) and not m.weight.requires_grad) - len(layers)
    name = str(dtype).removeprefix("torch.")
    experts = expert_parallel.experts_modules(model)
    routed = sum(p.numel() for module in experts for p in module.parameters() if not p.requires_grad)
    return (
        f"QLoRA: {len(layers)} linear weights in 4-bit NF4 (torchao, nested scales): {whole / 2**20:.3f} MiB instead "
        f"of {unquantised / 2**20:.3f} MiB in {name}, {here / 2**20:.3f} MiB of them on this rank"
        + (f"; {kept} kept in {name} (the output head, shapes not in whole 64 × 256 blocks)" if kept else "")
        + (
            f"; the routed experts of {len(experts)} MoE layers ({routed / 1e6:.1f}M parameters, 3-D weights, not "
            f"linear layers) kept in their dtype"
            if routed
            else ""
        )
    )


def apply(model: nn.Module, load_in_4bit: bool) -> nn.Module:
    """`convert` under --load_in_4bit, refused in one line for a model with nothing to quantise."""
    if load_in_4bit and not convert(model):
        from anygpu.errors import UsageError

        raise UsageError(
            f"--load_in_4bit true: {model.config.model_type} has no frozen nn.Linear weight (but its output "
            f"head) whose size is a multiple of {BLOCK} × {SCALER_BLOCK}, so nothing would be 4-bit: train LoRA "
            "over the base in its dtype (leave --load_in_4bit out)."
        )
    return model

"""Initial weights from the model's own `_init_weights`, the same whatever the sharding, engine or device.

Each model family initialises its weights its own way (GPT-2 scales its residual projections by
1/√(2·layers), Gemma's norms start at 0 because they compute 1 + weight, MoE routers and expert
banks have their own tensors). We run that scheme, not a generic one, but on a *scratch* copy of
the model built on the meta device: one unit at a time (a decoder layer with everything inside it,
or one module outside the layers with its own parameters) is materialised on the CPU, seeded from
(seed, unit name) and initialised by `_init_weights` in Hugging Face's order (children before
parents), then copied into the real model's parameters (plain tensors, or FSDP2 DTensor shards
through `distribute_tensor`) and dropped. The values depend only on the seed, the config and the
unit's name: not on the world size, the engine or the device (CPU generators everywhere), and no
process ever holds more than one decoder layer beyond its own shards.
"""

from __future__ import annotations

import hashlib
from typing import Iterator

import torch
from torch import nn

from anygpu.model import qlora


def unit_seed(seed: int, name: str) -> int:
    return int(hashlib.sha256(f"{seed}:init:{name}".encode()).hexdigest()[:15], 16)


def _units(model: nn.Module, layer_classes: tuple[type, ...]) -> Iterator[tuple[str, nn.Module, bool]]:
    """(name, module, whole_subtree) in post-order: decoder layers whole, other modules alone."""

    def walk(prefix: str, module: nn.Module) -> Iterator[tuple[str, nn.Module, bool]]:
        if isinstance(module, layer_classes):
            yield prefix, module, True
            return
        for name, child in module.named_children():
            yield from walk(f"{prefix}.{name}" if prefix else name, child)
        yield prefix, module, False

    yield from walk("", model)


@torch.no_grad()
def assign(param: torch.Tensor, full: torch.Tensor) -> None:
    """Copy a full tensor into a parameter: plain, or this rank's shard of an FSDP2 DTensor."""
    from torch.distributed.tensor import DTensor

    if hasattr(param, "ds_tensor"):  # DeepSpeed ZeRO-3 (zero.Init): this rank's slice of the flattened tensor
        _assign_partition(param, full)
        return
    if qlora.is_4bit(param):  # QLoRA's base: quantised whole, this rank's rows kept
        qlora.fill(param, full)
        return
    full = full.to(param.device, param.dtype)
    if isinstance(param, DTensor):
        param.to_local().copy_(distribute_tensor_local(full, param))
    else:
        param.copy_(full)


def _assign_partition(param, full: torch.Tensor) -> None:
    """DeepSpeed's partitioning of a ZeRO-3 parameter: rank r of its group holds elements [r·p, (r+1)·p) of the
    flattened tensor (p: the partition's size, the last one padded), as `zero.Init` cuts them."""
    import torch.distributed as dist

    part = param.ds_tensor
    size = part.ds_numel
    start = size * dist.get_rank(group=param.ds_process_group)
    count = max(0, min(size, param.ds_numel - start))
    if count:
        part.data[:count].copy_(full.reshape(-1)[start : start + count].to(part.device, part.dtype))


def distribute_tensor_local(full: torch.Tensor, param) -> torch.Tensor:
    from torch.distributed.tensor import distribute_tensor

    # src_data_rank=None: every rank holds the same full value, so no broadcast is needed
    return distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None).to_local()


@torch.no_grad()
def initialize(
    targets: dict[str, list[torch.Tensor]], scratch: nn.Module, seed: int, layer_classes: tuple[type, ...]
) -> None:
    """Fill the `targets` (base parameter name → the model's parameters that start from it; plain or
    sharded) with `scratch`'s own `_init_weights` scheme, unit by unit.

    `scratch`: the same architecture on the meta device (it is consumed: units are materialised
    and dropped again). Tied parameters are filled once, under their first name.
    """
    done: set[str] = set()
    for name, unit, whole in _units(scratch, layer_classes):
        own = list(unit.named_parameters(prefix=name, recurse=whole))
        if not any(n in targets and n not in done for n, _ in own):
            continue
        if whole:
            unit.to_empty(device="cpu")
        else:
            for pname, p in list(unit.named_parameters(recurse=False)):
                setattr(unit, pname, nn.Parameter(torch.empty_like(p, device="cpu"), requires_grad=p.requires_grad))
        with torch.random.fork_rng(devices=[]):  # the global CPU stream, which `_init_weights` draws from
            torch.manual_seed(unit_seed(seed, name))
            for module in _post_order(unit) if whole else [unit]:  # children first, as HF's smart_apply
                scratch._init_weights(module)
        for pname, p in unit.named_parameters(prefix=name, recurse=whole):
            if pname in targets and pname not in done:
                for target in targets[pname]:
                    assign(target, p)
                done.add(pname)
        _drop(unit, whole)
    missing = set(targets) - done
    if missing:
        raise RuntimeError(f"initial weights: no value for {sorted(missing)[:5]}")


def _drop(unit: nn.Module, whole: bool) -> None:
    """Back to the meta device: the unit's memory is freed before the next one is built."""
    if whole:
        unit.to_empty(device="meta")
    else:
        for pname, p in list(unit.named_parameters(recurse=False)):
            setattr(unit, pname, nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad))


def _post_order(module: nn.Module) -> Iterator[nn.Module]:
    for child in module.children():
        yield from _post_order(child)
    yield module

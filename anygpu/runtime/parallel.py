"""FSDP2 for the native engine: activation checkpointing → compile → `fully_shard` per
decoder layer → root (torchtitan's order: each wrap sees the module the previous one built).
Over a 1-D mesh of all ranks (FSDP2), or a 2-D (dp_replicate, dp_shard) mesh (HSDP: `fully_shard`
shards over the second dimension and replicates over the first; see `anygpu.runtime.mesh`). Under context
parallelism the shard dimension is dp_shard × cp flattened (torchtitan's `dp_shard_cp`): its C ranks are
consecutive within it, so the same 1-D or 2-D mesh holds it.
One fp32 process has nothing to shard: the model stays a plain module there (`needs_sharding`)."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from anygpu.config import nf4
from anygpu.config.optimizers import state_bytes
from anygpu.runtime import checkpointing as checkpointing_mod
from anygpu.runtime import expert_parallel, offload
from anygpu.runtime.blocks import decoder_layers
from anygpu.runtime.mesh import DIM_NAMES, MeshShape, fsdp_rows


def needs_sharding(world_size: int, bf16: bool, offload: bool = False) -> bool:
    """FSDP2 on one rank only costs per-step copies and hooks, so it is skipped there; bf16 keeps it at any
    world size because its mixed-precision policy (bf16 compute, fp32 master weights) defines the numerics, and
    --cpu_offload because FSDP2 is what moves the state to the host."""
    return world_size > 1 or bf16 or offload


def is_sharded(model: nn.Module) -> bool:
    return isinstance(model, FSDPModule)


def resharded(model: nn.Module) -> nn.Module:
    """`model` with every FSDP2 unit sharded again. A forward outside training (the reference's precompute pass by
    the policy itself) leaves the units FSDP2 keeps gathered for the backward (the root, the last layer, the head)
    registered with their gathered copies: an optimizer built then would hold those copies, which never get a
    gradient, and no name in the checkpoint's state dict."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()
    return model


def build_mesh(device: torch.device, shape: MeshShape):
    """The DeviceMesh FSDP2 runs on: 1-D over all ranks without replication (plain FSDP2, as before HSDP
    existed), else 2-D (dp_replicate, dp_shard) with consecutive ranks in a shard group (one node, by default);
    the shard dimension is S·C (dp_shard × cp)."""
    if not shape.is_hsdp:
        return init_device_mesh(device.type, (shape.shard_group,), mesh_dim_names=DIM_NAMES[1:])
    return init_device_mesh(device.type, (shape.dp_replicate, shape.shard_group), mesh_dim_names=DIM_NAMES)


def mesh_of(model: nn.Module) -> MeshShape | None:
    """The mesh the model's parameters really live on (R × the shard group S·C), or None for a plain module."""
    from torch.distributed.tensor import DTensor

    p = next(model.parameters(), None)
    if not isinstance(p, DTensor):
        return None
    sizes = p.device_mesh.shape
    return MeshShape(sizes[0], sizes[1]) if len(sizes) == 2 else MeshShape(1, sizes[0])


def shard_model(
    model: nn.Module,
    device: torch.device,
    mesh_shape: MeshShape,
    bf16: bool,
    checkpointing: bool | str | None,
    compile_blocks: bool,
    reshard_after_forward: bool = True,
    cpu_offload: bool = False,
    ep: int = 1,
) -> nn.Module:
    """Shard `model` (parameters still on meta) over `mesh_shape`; returns it wrapped in place (or plain, see
    `needs_sharding`: the same losses, and DCP checkpoints load either way on any world size and mesh).
    `checkpointing`: an activation checkpointing policy (`anygpu.runtime.checkpointing`; True is full), or None.
    `cpu_offload`: every unit's shards in host memory (`anygpu.runtime.offload`). `ep`: the experts split over
    E ranks first, each experts module a unit of its own over the copies left (`anygpu.runtime.expert_parallel`)."""
    layers = decoder_layers(model)
    checkpointing_mod.enable(model, "full" if checkpointing is True else checkpointing or None)
    if compile_blocks:
        for layer in layers:
            layer.compile()  # its `forward`, checkpointed or not (the checkpoint is traced inside)
    world_size = mesh_shape.world_size
    if not needs_sharding(world_size, bf16, cpu_offload):
        return model
    mesh = build_mesh(device, mesh_shape)
    experts, experts_mesh = [], None
    if ep > 1:  # before the layers' units: FSDP2 takes a child's parameters before its parent's
        ep_mesh, one_rank, experts_mesh = expert_parallel.meshes(device, mesh_shape, ep)
        experts = expert_parallel.split(model, ep_mesh, one_rank)
    off = offload.policy(cpu_offload, device)
    # bf16 compute and all-gathers, fp32 gradient reduction and master weights. The policy also casts the
    # floating-point forward inputs to bf16: the loss's token count (num_items_in_batch) is an integer for that.
    mp = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else MixedPrecisionPolicy()
    )
    # With one rank per shard group, resharding frees nothing worth the re-gather in the backward.
    reshard = reshard_after_forward and mesh_shape.shard_group > 1
    group = mesh_shape.shard_group
    for module in experts:
        expert_parallel.shard(
            module, experts_mesh, mesh_shape.world_size, mesh_shape.dp_replicate,
            mp_policy=mp, offload_policy=off, reshard_after_forward=reshard,
        )  # fmt: skip
    for i, layer in enumerate(layers):
        # The last layer's parameters are gathered again at once by the backward: keep them.
        last = i == len(layers) - 1
        fully_shard(
            layer, mesh=mesh, mp_policy=mp, offload_policy=off, reshard_after_forward=reshard and not last,
            ignored_params=nf4.unsplittable(layer, group) or None,
        )  # fmt: skip
    embedding, head = _own_units(model)
    if embedding is not None:  # gathered for the forward's first step and the backward's last only
        fully_shard(embedding, mesh=mesh, mp_policy=mp, offload_policy=off, reshard_after_forward=reshard)
    if head is not None:  # kept from the forward's end into the backward's start (the lean loss uses it there too)
        fully_shard(head, mesh=mesh, mp_policy=mp, offload_policy=off, reshard_after_forward=False)
    fully_shard(
        model, mesh=mesh, mp_policy=mp, offload_policy=off, reshard_after_forward=reshard,
        ignored_params=nf4.unsplittable(model, group) or None,
    )  # fmt: skip
    return model


def _own_units(model: nn.Module) -> tuple[nn.Module | None, nn.Module | None]:
    """The input embedding and the output projection as FSDP2 units of their own (torchtitan's and accelerate's
    layout), unless tied (one parameter belongs to one unit, the root then). In the root they would stay gathered
    through the whole forward and backward, with their full gradients until the backward's end: at a 128k
    vocabulary the largest tensors of the model, on every rank."""
    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
    weight = lambda m: getattr(m, "weight", None) if isinstance(m, nn.Module) else None  # noqa: E731
    if weight(embedding) is None or weight(head) is None or weight(embedding) is weight(head):
        return None, None
    return embedding, head


def set_gradient_reduction(model: nn.Module, last_micro_batch: bool) -> None:
    """Gradient accumulation under FSDP2. Sharded (dp_shard > 1): every micro-batch's gradients are
    reduce-scattered at once, so a rank only ever holds its shard of them (left unsharded until the last
    micro-batch, they would cost +1x the model's fp32 size per rank, which the memory plan does not count);
    under HSDP the all-reduce across replica groups still waits for the last micro-batch. With one rank per
    shard group there is nothing to shard: the whole reduction waits for the last micro-batch."""
    shape = mesh_of(model)
    if shape is not None and shape.dp_shard > 1:
        model.set_requires_gradient_sync(True)
        model.set_requires_all_reduce(last_micro_batch)
    else:
        model.set_requires_gradient_sync(last_micro_batch)


def state_bytes_per_rank(model: nn.Module, shard_group: int, optim: str = "adamw_torch") -> int:
    """The model state one rank holds (on the host under --cpu_offload), from the (meta or sharded) model's
    parameters: each trainable parameter's shard in fp32 with its fp32 gradient and AdamW's two moments (fp32, or
    low-bit under `optim`); each frozen one in its own dtype. Shards are 1/S of each tensor (FSDP2 pads a tensor's
    rows up to a multiple of S)."""
    total = 0
    for p in model.parameters():
        shard = fsdp_rows(tuple(p.shape), shard_group, 0)  # rank 0's: the first ranks hold the most
        if p.requires_grad:
            total += shard * (4 + 4) + state_bytes(tuple(p.shape), shard, optim)
        elif nf4.is_4bit(p):
            total += nf4.nbytes(nf4.held_elements(tuple(p.shape), shard_group), p.element_size())
        else:
            total += shard * p.element_size()
    return total


def local_bytes(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> int:
    """Bytes of parameters (and optimizer state) this rank actually holds."""
    from torch.distributed.tensor import DTensor

    def nbytes(t: torch.Tensor) -> int:
        t = t.to_local() if isinstance(t, DTensor) else t
        return t.numel() * t.element_size()

    total = sum(nbytes(p) for p in model.parameters())
    if optimizer is not None:
        for state in optimizer.state.values():
            total += sum(nbytes(v) for v in state.values() if isinstance(v, torch.Tensor) and v.dim() > 0)
    return total

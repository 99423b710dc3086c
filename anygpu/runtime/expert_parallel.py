"""Expert parallelism (`--ep E`, the FSDP2 engine): the experts of every mixture-of-experts layer split over E
ranks, each token sent to its experts' ranks and back with an all-to-all — transformers' own implementation (the
model's `base_model_ep_plan`: the experts' weights `Shard(0)` over the E ranks of an expert group,
`transformers.distributed.expert_parallel.AllToAllEP` in their forward), on a mesh of our own:

    dense  (dp_replicate, S·C)            every other parameter, FSDP2 or HSDP as without --ep
    expert (dp_replicate, S·C / E, E)      the experts: whole experts over E, FSDP2 over the S·C / E copies

The expert gradients are sums over the tokens of an expert group; FSDP2 reduces them over the copies and divides by
the data-parallel world size (W), as it divides the dense ones (each rank backpropagates W × its share of the loss),
so both are gradients of the same global-batch mean. The router, its auxiliary loss and everything outside the
experts do not change: the curve is `--ep 1`'s."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from anygpu.errors import UsageError
from anygpu.runtime import partitioned
from anygpu.runtime.blocks import hf_model
from anygpu.runtime.mesh import MeshShape

DISPATCH = "ep_dispatch_experts"  # transformers' style for an experts module whose forward dispatches tokens


def plan(model: nn.Module) -> dict[str, str]:
    """The model's expert-parallel plan, one entry per parameter and experts module (transformers' expansion)."""
    base = hf_model(model)
    rules = getattr(base, "ep_plan", None) or {}
    return base._expand_parallel_plan(rules) if rules else {}


def experts_modules(model: nn.Module) -> list[nn.Module]:
    """The experts modules the plan dispatches tokens to, in model order."""
    base = hf_model(model)
    return [base.get_submodule(name) for name, style in plan(model).items() if style == DISPATCH]


def num_experts(model: nn.Module) -> int:
    """The experts of each MoE layer, from the first experts module's weights (global shape: split, or partitioned by
    ZeRO-3, or not)."""
    modules = experts_modules(model)
    return partitioned.shape(next(modules[0].parameters()))[0] if modules else 0


def check(model: nn.Module, ep: int, shape: MeshShape) -> None:
    """Refuse an E the model or the mesh cannot take, naming what would work."""
    if ep == 1:
        return
    kind = getattr(model.config, "model_type", type(model).__name__)
    if not any(style == DISPATCH for style in plan(model).values()):
        raise UsageError(
            f"--ep {ep}: {kind} has no experts to split (a dense model, or a family whose transformers class has no "
            "expert-parallel plan); leave --ep out."
        )
    experts = num_experts(model)
    ok = [d for d in range(1, experts + 1) if experts % d == 0 and shape.shard_group % d == 0]
    if experts % ep:
        raise UsageError(f"--ep {ep} does not divide the {experts} experts of {kind}: use one of {ok}.")
    if shape.shard_group % ep:
        raise UsageError(
            f"--ep {ep} does not divide the {shape.shard_group} ranks of a shard group (dp_shard × cp): use one of {ok}."
        )
    check_adapter(model, ep)


def check_adapter(model: nn.Module, ep: int) -> None:
    """Refuse a LoRA adapter on the experts' own weights: peft wraps the experts module (ParamWrapper, one low-rank
    pair over all experts), and transformers' expert split finds neither the module nor its weights by their names."""
    base = hf_model(model)
    rules = plan(model)
    if not any(hasattr(base.get_submodule(name), "base_layer") for name, style in rules.items() if style == DISPATCH):
        return
    # the plan's own patterns: its expansion follows parameter names, which the wrapper has moved
    weights = {name.rsplit(".", 1)[-1] for name, style in base.ep_plan.items() if style != DISPATCH}
    targets = getattr(model.peft_config["default"], "target_parameters", None) or []
    adapted = sorted(t for t in targets if t.rsplit(".", 1)[-1] in weights)
    raise UsageError(
        f"--ep {ep} with LoRA on the experts' own weights ({', '.join(adapted)}; peft maps all-linear and the names "
        "gate_proj, up_proj and down_proj onto them, and so do its default targets for some families): expert "
        "parallelism does not split an adapter over the experts yet; adapt the attention (--lora_target_modules "
        f"{','.join(attention_linears(base))}), or use --ep 1."
    )


def attention_linears(model: nn.Module) -> list[str]:
    """The last name parts of the attention's linear layers (under a LoRA wrapper too): targets outside the experts."""
    names = set()
    for name, module in model.named_modules():
        name = name.removesuffix(".base_layer")
        if isinstance(module, nn.Linear) and ".lora_" not in name and ("attn" in name or "attention" in name):
            names.add(name.rsplit(".", 1)[-1])
    return sorted(names)


def meshes(device: torch.device, shape: MeshShape, ep: int) -> tuple[DeviceMesh, DeviceMesh, DeviceMesh]:
    """(the E ranks of each expert group, a one-rank group of each rank, the experts' FSDP2 mesh)."""
    efsdp = shape.shard_group // ep
    mesh = init_device_mesh(
        device.type, (shape.dp_replicate, efsdp, ep, 1), mesh_dim_names=("dp_replicate", "efsdp", "ep", "etp")
    )
    fsdp = mesh["dp_replicate", "efsdp"] if shape.is_hsdp else mesh["efsdp"]
    return mesh["ep"], mesh["etp"], fsdp


def split(model: nn.Module, ep_mesh: DeviceMesh, one_rank: DeviceMesh) -> list[nn.Module]:
    """Each experts module keeps its E-th of the experts (DTensors `Shard(0)` over the group, still on meta) and
    dispatches its tokens with all-to-all; returns the experts modules."""
    from transformers.distributed.expert_parallel import apply_expert_parallelism

    base = hf_model(model)
    modules = experts_modules(model)
    apply_expert_parallelism(base, ep_mesh, one_rank, plan(model), ep_implementation="all_to_all")
    return modules


def shard(experts: nn.Module, mesh: DeviceMesh, world_size: int, replicas: int = 1, **fsdp_kwargs) -> None:
    """FSDP2 over the copies of each expert (before its decoder layer's unit takes the rest). The gradients are to be
    divided by the data-parallel world size W; under HSDP FSDP2's all-reduce across the `replicas` groups averages
    (it divides by their count itself), so the factor set on the reduce-scatter is W / replicas."""
    from torch.distributed.fsdp import fully_shard

    fully_shard(experts, mesh=mesh, **fsdp_kwargs)
    experts.set_gradient_divide_factor(float(world_size // replicas))
    if mesh.size() > 1:
        # a divide factor other than the group size is a PREMUL_SUM, which gloo refuses: sum, then divide locally
        experts.set_force_sum_reduction_for_comms(True)


def describe(model: nn.Module, ep: int, shape: MeshShape) -> str:
    """The banner's line for the expert mesh."""
    experts, layers = num_experts(model), len(experts_modules(model))
    copies = shape.shard_group // ep
    held = f"FSDP2-sharded over its {copies} copies" if copies > 1 else "one copy"
    if shape.is_hsdp:
        held += f" in each of {shape.dp_replicate} replica groups"
    return (
        f"experts: {experts} in each of {layers} MoE layers split over {ep} ranks (--ep {ep}), {experts // ep} per "
        f"rank, each token sent to its experts' ranks and back (all-to-all); {held}"
    )

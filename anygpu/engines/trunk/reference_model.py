"""--objective dpo's frozen reference (--ref_model_name_or_path, else the starting model) as an FSDP2 model: sharded
over a mesh (the FSDP2 engine's; the HF engine's FSDP and ZeRO-3 runs shard it over every rank), no gradients, no
optimizer, held in the compute dtype (the mixed-precision forward casts to it anyway). Both engines build it here."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch

from anygpu.config.args import ModelArguments, TrainArguments
from anygpu.data.prepare import Prepared
from anygpu.model import dropout, lean_loss, lora, mask_hint, modeling
from anygpu.runtime import distributed, mesh, offload, parallel


def build(
    prep: Prepared,
    model_args: ModelArguments,
    train_args: TrainArguments,
    info: distributed.DistInfo,
    shape: mesh.MeshShape,
) -> torch.nn.Module:
    """The reference, sharded over `shape`'s mesh, its pretrained weights loaded, in eval mode."""
    args = dataclasses.replace(
        model_args,
        model_name_or_path=train_args.ref_model_name_or_path or model_args.model_name_or_path,
        config_name=None,
        use_peft=False,
        merge_lora=False,
    )
    config = modeling.fit_config_to_tokenizer(modeling.resolve_config(args), prep.tokenizer, from_scratch=False)
    model = modeling.build_meta_model(config, args).requires_grad_(False)
    if train_args.bf16:
        lora.hold_frozen_in(model, torch.bfloat16)
    dropout.disable(model)
    lean_loss.install(model, train_args.lean_loss)
    modeling.flatten_packed_rows(model)
    mask_hint.install(model, prep.collator is not None and prep.collator.packed)  # grpo: no collator
    buffers = {n: b.clone() for n, b in model.named_buffers()}
    parallel.shard_model(
        model, info.device, shape, train_args.bf16, None, False, cpu_offload=train_args.cpu_offload, ep=train_args.ep
    )
    offload.materialize(model, info.device, train_args.cpu_offload)
    if not parallel.is_sharded(model):
        model.tie_weights()
    modeling.restore_buffers(model, buffers)
    modeling.load_pretrained_weights(model, args.model_name_or_path)
    return model.eval()


def with_call(
    model: torch.nn.Module, call: Callable[..., Any] | None = None
) -> tuple[torch.nn.Module, Callable[..., Any]]:
    """(the reference, what runs its forward): itself, or `call` (the HF engine's autocast around it)."""
    return model, call or model


def over_every_rank(info: distributed.DistInfo) -> mesh.MeshShape:
    """One shard group of every rank (the HF engine's FSDP and ZeRO-3 shard over all processes)."""
    return mesh.resolve(1, info.world_size, info.world_size, mesh.local_world_size_from_env())

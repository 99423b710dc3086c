"""The final model: Hugging Face safetensors + config + tokenizer, or a PEFT adapter (and its merge).

`final/` is what `save_pretrained` writes for the family by default: the checkpoint's own names and layout
(transformers' reverse weight conversion: MoE experts one tensor per expert as the Hub stores them, Mixtral's
`block_sparse_moe`, and any legacy name the source used), in the export dtype (`--export_dtype`: by default the
source checkpoint's storage dtype), split into files of at most `--save_max_shard_size` with an index.

The library does the writing (`save_pretrained`: shard names, index, tied weights stored once, config,
generation config; transformers' `revert_weight_conversion` for the layout). The gather is ours: one tensor at a
time (`DTensor.full_tensor`, a collective every rank joins), cast to the export dtype on rank 0 as it arrives, so
rank 0 never holds the model in fp32: its host memory peaks at the model in the export dtype (2 bytes a
parameter in bf16) plus one decoder layer's tensors while that layer's layout is reverted. torch's
`get_model_state_dict(full_state_dict=True)` would gather the whole model in its fp32 master dtype first.
"""

from __future__ import annotations

import contextlib
import copy
import re
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from anygpu.model import hub_weights
from anygpu.runtime import distributed, faults, fs, lazy_deepspeed


# Every save_pretrained below unwraps the model through accelerate, which would import DeepSpeed (~3 s of CPU) in an
# export made before an engine's run: a tool's, a script's.
lazy_deepspeed.unwrap_without_importing_deepspeed()


def gather_full(model: nn.Module, trainable_only: bool = False) -> dict[str, torch.Tensor]:
    """The model's full tensors on rank 0's CPU (empty elsewhere); every rank calls it (collective).

    Works on FSDP2-sharded and plain modules, with or without a process group; not on ZeRO-3's
    partitioned parameters (the HF engine gathers those itself).
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=trainable_only)
    state = get_model_state_dict(model, options=options)
    # A tied weight (lm_head = input embedding) comes back as two gathered copies; save_pretrained stores
    # it once only when both names share one tensor, so share it again.
    first: dict[int, str] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        alias_of = first.setdefault(id(param), name)
        if alias_of != name and alias_of in state and name in state:
            state[name] = state[alias_of]
    return state


def gather_in(model: nn.Module, dtype: torch.dtype, rank: int) -> dict[str, torch.Tensor]:
    """The model's state dict as full tensors in `dtype` on rank 0's CPU (empty elsewhere), gathered one tensor at a
    time; a tied weight is gathered once and shared. Every rank calls it (collective)."""
    from torch.distributed.tensor import DTensor

    out: dict[str, torch.Tensor] = {}
    seen: dict[int, str] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():  # the parameters themselves: ties share an id
        if id(tensor) in seen:
            if rank == 0:
                out[name] = out[seen[id(tensor)]]
            continue
        seen[id(tensor)] = name
        full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
        if rank == 0:
            out[name] = full.detach().to("cpu", dtype if full.is_floating_point() else full.dtype, copy=True)
        del full
    return out


def cast_(state: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """`state`'s floating tensors in `dtype`, one at a time (each old one freed as its copy is made), ties kept."""
    done: dict[int, torch.Tensor] = {}
    for name, tensor in state.items():
        if id(tensor) not in done:
            done[id(tensor)] = tensor.to(dtype) if tensor.is_floating_point() else tensor
        state[name] = done[id(tensor)]
    return state


def layer_of(name: str) -> str:
    """The numbered layer a tensor's name is in (`model.layers.3.`), or "" (embeddings, final norm, head): a weight
    conversion never spans two."""
    match = re.match(r"(.*?\.\d+\.)", name)
    return match.group(1) if match else ""


def hub_layout(model: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`state` in the names and layout `save_pretrained` writes (transformers' reverse conversion), one decoder
    layer at a time so that only one layer's tensors exist twice (a conversion never spans layers)."""
    from transformers.core_model_loading import revert_weight_conversion

    groups: dict[str, list[str]] = {}
    for name in state:
        groups.setdefault(layer_of(name), []).append(name)
    out: dict[str, torch.Tensor] = {}
    with hub_weights.transformers_classes(model):  # FSDP2's classes would read as custom code: no conversions
        for names in groups.values():
            out.update(revert_weight_conversion(model, {n: state.pop(n) for n in names}))
    return out


def export_safetensors(
    model: nn.Module,
    config: Any,
    tokenizer: Any,
    out_dir: str | Path,
    rank: int,
    dtype: torch.dtype = torch.float32,
    max_shard_size: str | int = "5GB",
    state_dict: dict[str, torch.Tensor] | None = None,
) -> Path:
    """<out_dir> as Hugging Face safetensors (in `dtype`, the family's own layout) + config + generation config +
    tokenizer, replaced atomically.

    `model`: the Hugging Face model (FSDP2's fully_shard keeps its class); `state_dict`: full tensors the
    caller already gathered on rank 0 (the HF engine under ZeRO-3), else gathered here.
    """
    state = cast_(state_dict, dtype) if state_dict is not None else gather_in(model, dtype, rank)
    out = Path(out_dir)
    tmp = out.with_name(f".{out.name}.tmp")
    if rank == 0:
        state = hub_layout(model, state)
        shutil.rmtree(tmp, ignore_errors=True)
        with _no_progress_bar():  # no "Writing model shards" bar between the engine's log lines
            # save_original_format=False: `state` is in the original format already (reverted layer by layer)
            model.save_pretrained(str(tmp), state_dict=state, max_shard_size=max_shard_size, save_original_format=False)
        config = copy.deepcopy(config)  # the caller's config over the model's copy, as the export always wrote
        config.dtype = str(dtype).removeprefix("torch.")  # what from_pretrained(dtype="auto") loads it as
        config.use_cache = True  # off for training (modeling.fit_config_to_tokenizer); generation wants its KV cache
        config.save_pretrained(str(tmp))
        if tokenizer is not None:
            tokenizer.save_pretrained(str(tmp))
        fs.replace_dir(tmp, out)
        faults.at("export")
    del state
    _wait_for_rank0("the final export")
    return out


@contextlib.contextmanager
def _no_progress_bar() -> Iterator[None]:
    """transformers' progress bars off for the block, as they were after it."""
    from transformers.utils import logging as hf_logging

    was_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_on:
            hf_logging.enable_progress_bar()


def export_adapter(
    model: nn.Module,
    tokenizer: Any,
    base_path: str,
    out_dir: str | Path,
    rank: int,
    merge: bool,
    gathered: dict[str, torch.Tensor] | None = None,
    dtype: torch.dtype = torch.float32,
    max_shard_size: str = "5GB",
    quantised_from: torch.dtype | None = None,
) -> Path:
    """<out_dir> as a PEFT adapter (adapter_model.safetensors + adapter_config.json + tokenizer); with
    `merge`, also <out_dir>-merged, the base with the adapter merged in.

    `gathered`: full tensors already collected on rank 0 by the caller (the HF engine's ZeRO-3 gather);
    by default the trainable tensors are gathered here. peft keeps only the adapter's keys. `quantised_from`: QLoRA's
    base was 4-bit, quantised from this dtype (the merge is then over that base dequantised, see `merge_adapter`).
    """
    state = gathered if gathered is not None else gather_full(model, trainable_only=True)
    out = Path(out_dir)
    tmp = out.with_name(f".{out.name}.tmp")
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        model.peft_config["default"].base_model_name_or_path = str(
            base_path
        )  # PeftModel.from_pretrained's default base
        model.save_pretrained(str(tmp), state_dict=state)
        tokenizer.save_pretrained(str(tmp))
        fs.replace_dir(tmp, out)
        if merge:
            merge_adapter(base_path, out, tokenizer, dtype, max_shard_size, quantised_from)
        faults.at("export")
    del state
    _wait_for_rank0("the final adapter export" + (" and its merge" if merge else ""))
    return out


def _leave_zero3() -> None:
    """The run's end under ZeRO-3: transformers builds any model under deepspeed.zero.Init while the run's DeepSpeed
    config is registered, which broadcasts each parameter to ranks that are not building it (the merge is rank 0's
    alone): unregistered here, so the merge's model is a plain one (it hung before)."""
    if "transformers.integrations.deepspeed" in sys.modules:
        from transformers.integrations.deepspeed import unset_hf_deepspeed_config

        unset_hf_deepspeed_config()


def _wait_for_rank0(what: str) -> None:
    """The other ranks wait while rank 0 writes, for as long as it takes: a 70B export (or a merge) can outlast
    --ddp_timeout, which would end a barrier, and the job, at its very end; the job's store has no such limit."""
    distributed.wait_for_all(what)


def merge_adapter(
    base_path: str,
    adapter: Path,
    tokenizer: Any,
    dtype: torch.dtype = torch.float32,
    max_shard_size: str = "5GB",
    quantised_from: torch.dtype | None = None,
) -> Path:
    """<adapter>-merged: the base from its folder (never modified) with the adapter merged in (one process, CPU),
    in `dtype` and the base's own layout (from_pretrained records the conversions save_pretrained reverses).
    `quantised_from` (QLoRA): the base's 4-bit weights dequantised first, as the run computed with them (peft merges
    over a bitsandbytes base the same way), so the merged model computes what the trained one did."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from anygpu.model import qlora

    merged_dir = adapter.with_name(f"{adapter.name}-merged")
    tmp = merged_dir.with_name(f".{merged_dir.name}.tmp")
    _leave_zero3()
    base = AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32)
    if quantised_from is not None:
        qlora.dequantise_base(base, quantised_from)
    merged = PeftModel.from_pretrained(base, str(adapter)).merge_and_unload().to(dtype)
    merged.save_pretrained(str(tmp), max_shard_size=max_shard_size)
    tokenizer.save_pretrained(str(tmp))
    fs.replace_dir(tmp, merged_dir)
    return merged_dir

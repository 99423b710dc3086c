"""The final model: Hugging Face safetensors + config + tokenizer, or a PEFT adapter (and its merge).

The library does both jobs: torch's `get_model_state_dict` (full, CPU-offloaded, kept on rank 0) gathers,
and `save_pretrained` (transformers for the model, peft for the adapter) writes: HF shard names and index,
tied weights stored once, config, generation config, adapter config.

Memory: rank 0 holds the whole model in CPU memory (4 bytes per fp32 parameter) while it writes. The
hand-written gather this replaced held one 4 GiB shard at most, which for any model under 4 GiB was the
whole model too. Rank 0's peak RSS growth during the export, FSDP2 on 2 gloo ranks, old → new:
default preset (15.7M params, 60 MiB) 77 → 203 MiB (the extra is a fixed cost of the library's
imports); 156M params (594 MiB) 754 → 767 MiB. Beyond 4 GiB the old code stayed at one shard.
"""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from anygpu.runtime import distributed, faults, fs


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


def export_safetensors(
    model: nn.Module,
    config: Any,
    tokenizer: Any,
    out_dir: str | Path,
    rank: int,
    max_shard_bytes: int = 4 * 2**30,
    state_dict: dict[str, torch.Tensor] | None = None,
) -> Path:
    """<out_dir> as Hugging Face safetensors + config + generation config + tokenizer, replaced atomically.

    `model`: the Hugging Face model (FSDP2's fully_shard keeps its class); `state_dict`: full tensors the
    caller already gathered on rank 0 (the HF engine under ZeRO-3), else gathered here.
    """
    state = state_dict if state_dict is not None else gather_full(model)
    out = Path(out_dir)
    tmp = out.with_name(f".{out.name}.tmp")
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        with _no_progress_bar():  # no "Writing model shards" bar between the engine's log lines
            # save_original_format=False: keys as the model names them (as the export always wrote, and
            # as `modeling` reads a folder back), not transformers' legacy layout (MoE experts unfused).
            model.save_pretrained(
                str(tmp), state_dict=state, max_shard_size=max_shard_bytes, save_original_format=False
            )
        config.save_pretrained(str(tmp))  # the caller's config over the model's copy, as the export always wrote
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
) -> Path:
    """<out_dir> as a PEFT adapter (adapter_model.safetensors + adapter_config.json + tokenizer); with
    `merge`, also <out_dir>-merged, the base with the adapter merged in.

    `gathered`: full tensors already collected on rank 0 by the caller (the HF engine's ZeRO-3 gather);
    by default the trainable tensors are gathered here. peft keeps only the adapter's keys.
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
            merge_adapter(base_path, out, tokenizer)
        faults.at("export")
    del state
    _wait_for_rank0("the final adapter export" + (" and its merge" if merge else ""))
    return out


def _wait_for_rank0(what: str) -> None:
    """The other ranks wait while rank 0 writes, for as long as it takes: a 70B export (or a merge) can outlast
    --ddp_timeout, which would end a barrier, and the job, at its very end; the job's store has no such limit."""
    distributed.wait_for_all(what)


def merge_adapter(base_path: str, adapter: Path, tokenizer: Any) -> Path:
    """<adapter>-merged: the base from its folder (never modified) with the adapter merged in (one process, CPU)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    merged_dir = adapter.with_name(f"{adapter.name}-merged")
    tmp = merged_dir.with_name(f".{merged_dir.name}.tmp")
    base = AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32)
    merged = PeftModel.from_pretrained(base, str(adapter)).merge_and_unload()
    merged.save_pretrained(str(tmp))
    tokenizer.save_pretrained(str(tmp))
    fs.replace_dir(tmp, merged_dir)
    return merged_dir

"""The final model: Hugging Face safetensors + config + tokenizer, or a PEFT adapter (and its merge)."""
from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import torch
from torch import nn

from anygpu.runtime import distributed, fs


def export_safetensors(
    model: nn.Module, config: Any, tokenizer: Any, out_dir: str | Path, rank: int, max_shard_bytes: int = 4 * 2**30
) -> Path:
    """<out_dir> as Hugging Face safetensors + config + tokenizer.

    Each sharded parameter is all-gathered alone and written by rank 0 into shards of at most
    `max_shard_bytes`, so no process ever holds the whole model.
    """
    from safetensors.torch import save_file
    from torch.distributed.tensor import DTensor

    out = Path(out_dir)
    tmp = out.with_name(f".{out.name}.tmp")
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    shard: dict[str, torch.Tensor] = {}
    files: list[list[str]] = []
    total = 0

    def flush() -> None:
        nonlocal shard
        if shard and rank == 0:
            save_file(shard, str(tmp / f"part-{len(files):05d}.safetensors"), metadata={"format": "pt"})
            files.append(list(shard))
        shard = {}

    # named_parameters() lists a tied weight once, under its first name (the input embedding), as
    # HF stores it; state_dict() also lists the alias (lm_head.weight), which is skipped here.
    params = dict(model.named_parameters())
    buffers = dict(model.named_buffers())
    for name in model.state_dict().keys():
        tensor = params.get(name, buffers.get(name))
        if tensor is None:
            continue
        with torch.no_grad():
            full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
        if rank == 0:
            t = full.detach().to("cpu").contiguous()
            if sum(v.numel() * v.element_size() for v in shard.values()) + t.numel() * t.element_size() > max_shard_bytes:
                flush()
            shard[name] = t
            total += t.numel() * t.element_size()
        del full
    flush()
    if rank == 0:
        _name_shards(tmp, files, total)
        config.save_pretrained(str(tmp))
        if getattr(model, "generation_config", None) is not None:
            model.generation_config.save_pretrained(str(tmp))
        if tokenizer is not None:
            tokenizer.save_pretrained(str(tmp))
        fs.replace_dir(tmp, out)
    distributed.barrier()
    return out


def _name_shards(folder: Path, files: list[list[str]], total_bytes: int) -> None:
    """HF names: model.safetensors, or model-0000i-of-0000n.safetensors plus an index."""
    n = len(files)
    if n == 1:
        os.replace(folder / "part-00000.safetensors", folder / "model.safetensors")
        return
    weight_map = {}
    for i, keys in enumerate(files):
        name = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        os.replace(folder / f"part-{i:05d}.safetensors", folder / name)
        weight_map.update({k: name for k in keys})
    fs.write_json(folder / "model.safetensors.index.json", {"metadata": {"total_size": total_bytes}, "weight_map": weight_map})


def export_adapter(model: nn.Module, tokenizer, base_path: str, out_dir: str | Path, rank: int, merge: bool,
                   gathered: dict[str, torch.Tensor] | None = None) -> Path:
    """<out_dir> as a PEFT adapter (adapter_model.safetensors + adapter_config.json + tokenizer), gathered
    one tensor at a time; with `merge`, also <out_dir>-merged, the base with the adapter merged in.

    `gathered`: full tensors already collected on rank 0 by the caller (the HF engine's ZeRO-3 gather);
    by default trainable DTensors are all-gathered here."""
    from peft import get_peft_model_state_dict
    from safetensors.torch import save_file
    from torch.distributed.tensor import DTensor


    out = Path(out_dir)
    tmp = out.with_name(f".{out.name}.tmp")
    trainable = {}
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        if gathered is not None:
            if rank == 0:
                trainable[name] = gathered[name].contiguous()
            continue
        full = param.full_tensor() if isinstance(param, DTensor) else param
        trainable[name] = full.detach().to("cpu").contiguous()
    if rank == 0:
        state = get_peft_model_state_dict(model, state_dict=trainable)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        save_file({k: v.contiguous() for k, v in state.items()}, str(tmp / "adapter_model.safetensors"), metadata={"format": "pt"})
        config = model.peft_config["default"]
        config.base_model_name_or_path = str(base_path)
        config.save_pretrained(str(tmp))
        tokenizer.save_pretrained(str(tmp))
        fs.replace_dir(tmp, out)
        if merge:
            merge_adapter(base_path, out, tokenizer)
    distributed.barrier()
    return out


def merge_adapter(base_path: str, adapter: Path, tokenizer) -> Path:
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

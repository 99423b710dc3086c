"""Pretrained weights from a Hugging Face folder into a (possibly FSDP2-sharded) model, by transformers' own rules.

`from_pretrained` does not read tensors by name: it renames checkpoint keys and converts tensors with the
family's conversion mapping (`transformers.conversion_mapping.get_model_conversion_mapping`: one expert per
tensor on the Hub → the fused `experts.gate_up_proj` / `experts.down_proj` the model holds, Mixtral's
`block_sparse_moe` → `mlp`, legacy names, a base-model checkpoint without the `model.` prefix). We take the same
mapping and the same operations (`rename_source_key`, each `WeightConverter`'s `convert`), so a family loads here
the day transformers supports it. What we do not take is the last step, `convert_and_load_state_dict_in_model`:
it sets a new `nn.Parameter` on the module, which would drop FSDP2's sharded parameter, a LoRA adapter's base
names and a tied weight. Our loop copies into the parameters the model already has, under their base names
(`lora.base_targets`).

Memory: one target tensor at a time (one expert bank of one layer at most). A rank reads only its own part
where the conversion allows it (transformers' `DtensorShardOperation`: a dense tensor's rows, an expert bank's
own experts, straight from the safetensors file); a 4-bit weight (QLoRA) is read whole, to be quantised as one
process quantises it (`anygpu.model.qlora`); any other conversion (e.g. a fused qkv chunked into q, k, v)
is read whole, converted, and this rank's shard copied. Storage in bf16/fp16 is cast to the parameter's dtype.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
from copy import deepcopy
from pathlib import Path

import torch
from torch import nn

from anygpu.errors import UsageError
from anygpu.config.nf4 import is_4bit
from anygpu.model import lora
from anygpu.runtime.blocks import hf_model

INDEX = "model.safetensors.index.json"


def weight_files(path: str) -> list[Path]:
    """The folder's safetensors files (those its index lists, when it has one); a Hub id is downloaded first."""
    folder = Path(path)
    if not folder.is_dir():
        from huggingface_hub import snapshot_download

        folder = Path(snapshot_download(path, allow_patterns=["*.safetensors", "*.json"]))
    if (folder / INDEX).is_file():
        return [folder / f for f in sorted(set(json.loads((folder / INDEX).read_text())["weight_map"].values()))]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise UsageError(
            f"--model_name_or_path {path}: no *.safetensors weights found (convert .bin weights with save_pretrained)."
        )
    return files


SAMPLE_BYTES = 1 << 16  # read from each end of each file's tensor data


def weights_fingerprint(path: str) -> str:
    """A cheap fingerprint of a folder's weights: each safetensors file's name, size, header and the first and last
    64 KiB of its tensor data (weights of one shape but other values differ there; a 70B folder reads ~4 MB)."""
    digest = hashlib.sha256()
    for file in weight_files(path):
        size = file.stat().st_size
        with open(file, "rb") as f:
            header = int.from_bytes(f.read(8), "little")
            digest.update(f"{file.name}|{size}|".encode() + f.read(header) + f.read(SAMPLE_BYTES))
            f.seek(max(8 + header, size - SAMPLE_BYTES))
            digest.update(f.read(SAMPLE_BYTES))
    return digest.hexdigest()[:16]


SAFETENSORS_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F64": torch.float64}


def storage_dtype(path: str) -> torch.dtype:
    """The dtype a checkpoint stores its floating-point weights in (the one most of its elements have)."""
    from safetensors import safe_open

    counts: dict[torch.dtype, int] = {}
    for file in weight_files(path):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for key in f.keys():
                piece = f.get_slice(key)
                dtype = SAFETENSORS_DTYPES.get(piece.get_dtype())
                if dtype is not None:
                    counts[dtype] = counts.get(dtype, 0) + math.prod(piece.get_shape())
    return max(counts, key=counts.get) if counts else torch.float32


@contextlib.contextmanager
def transformers_classes(model: nn.Module):
    """For the block: every module that FSDP2's `fully_shard` gave a class of its own (`FSDPQwen2MoeForCausalLM`,
    defined outside transformers) is of its transformers class again. transformers takes a class defined outside
    it for custom code and gives it no conversion mapping (`PreTrainedModel.is_custom_code`), so without this a
    sharded model would load and export without its family's renames."""
    swapped = []
    for module in model.modules():
        cls = type(module)
        if not cls.__module__.startswith("transformers."):
            own = next((c for c in cls.__mro__ if c.__module__.startswith("transformers.")), None)
            if own is not None and own.__name__ in cls.__name__:
                swapped.append((module, cls))
                module.__class__ = own
    try:
        yield
    finally:
        for module, cls in swapped:
            module.__class__ = cls


def conversion_mapping(model: nn.Module) -> list:
    """transformers' weight conversions for the model's family, as `from_pretrained` takes them."""
    from transformers.conversion_mapping import get_model_conversion_mapping

    with transformers_classes(model):
        return get_model_conversion_mapping(model)


def targets_of(model: nn.Module) -> tuple[dict[str, list[torch.Tensor]], dict[str, torch.Tensor]]:
    """(base name → parameters, base name → persistent buffer): what a checkpoint fills."""
    params = lora.base_targets(model)
    persistent = set(model.state_dict().keys())
    buffers = {}
    for name, buf in model.named_buffers():
        base = lora.base_name(name)
        if name in persistent and base is not None and base not in params:
            buffers[base] = buf
    return params, buffers


def _shards_on_read(mapping, params: list[torch.Tensor]) -> bool:
    """Whether this rank may read only its own part of the checkpoint tensors behind `mapping`: a plain rename, or
    a stack of per-expert tensors (concatenated along a later dim) into a bank sharded along its expert dim."""
    from torch.distributed.tensor import DTensor
    from transformers.core_model_loading import Concatenate, MergeModulelist, WeightConverter

    if len(params) != 1 or not isinstance(params[0], DTensor) or is_4bit(params[0]):
        return False  # a 4-bit weight is quantised whole (`qlora.fill`)
    if any(getattr(p, "dim", 0) != 0 for p in params[0].placements if hasattr(p, "dim")):
        return False
    if not isinstance(mapping, WeightConverter):
        return True
    ops = mapping.operations
    return (
        isinstance(ops[0], MergeModulelist)
        and ops[0].dim == 0
        and all(isinstance(op, Concatenate) and op.dim > 0 for op in ops[1:])
    )


def _reader(handle, key: str, params: list[torch.Tensor], shard: bool, tensor_idx: int | None):
    """A deferred read of checkpoint tensor `key`: this rank's part (or None: another rank's expert), or all of it."""
    from transformers.distributed.sharding_utils import DtensorShardOperation

    dtype = params[0].dtype

    def read():
        if shard:
            return DtensorShardOperation(params[0]).shard_tensor(handle.get_slice(key), tensor_idx, "cpu", dtype)
        return handle.get_tensor(key).to(dtype)

    return read


def plan_groups(model: nn.Module, handles: dict[str, object], params, buffers) -> dict[str, object]:
    """Target name → a transformers WeightTransform holding deferred reads of its checkpoint tensors, built as
    `convert_and_load_state_dict_in_model` builds them (same renaming, same order, one converter per target)."""
    from transformers.core_model_loading import WeightConverter, WeightRenaming, dot_natural_key, rename_source_key

    base = hf_model(model)
    mapping_list = conversion_mapping(base)
    renamings = [m for m in mapping_list if isinstance(m, WeightRenaming)]
    converters = [m for m in mapping_list if isinstance(m, WeightConverter)]
    by_pattern = {p: c for c in converters for p in c.source_patterns}
    known = {**params, **buffers}
    groups: dict[str, object] = {}
    for key in sorted(handles, key=dot_natural_key):
        target, pattern = rename_source_key(key, renamings, converters, base.base_model_prefix, known)
        if target not in known and key in known:  # as transformers: a key already in the model's own name
            target, pattern = key, None
        if target not in known:
            continue  # an unexpected key (from_pretrained warns and drops it, e.g. a tied lm_head stored twice)
        group = groups.setdefault(target, deepcopy(by_pattern[pattern]) if pattern else WeightRenaming(key, target))
        pattern = pattern or key
        targets = params.get(target, [buffers.get(target)])
        index = len(group.collected_tensors.get(pattern, [])) if isinstance(group, WeightConverter) else None
        group.add_tensor(
            target, key, pattern, _reader(handles[key], key, targets, _shards_on_read(group, targets), index)
        )
    # as from_pretrained records them: the export reverses the transforms this checkpoint used (its own layout)
    base._weight_conversions = [m for m in mapping_list if m.was_used()]
    return groups


@torch.no_grad()
def load(model: nn.Module, path: str) -> None:
    """Fill `model` (plain, FSDP2-sharded, or under a LoRA adapter) from the folder's safetensors, as
    `from_pretrained` would fill it; a parameter no checkpoint tensor maps to is refused in one line."""
    from safetensors import safe_open

    from anygpu.model.init_weights import assign

    params, buffers = targets_of(model)
    missing = set(params)
    with contextlib.ExitStack() as stack:
        handles = {}
        for file in weight_files(path):
            f = stack.enter_context(safe_open(str(file), framework="pt", device="cpu"))
            handles.update(dict.fromkeys(f.keys(), f))
        for first, group in plan_groups(model, handles, params, buffers).items():
            targets = params.get(first, [buffers.get(first)])
            if _shards_on_read(group, targets) and targets[0].to_local().numel() == 0:
                missing.discard(first)  # this rank holds none of it (more ranks than rows or experts)
                continue
            for name, value in group.convert(first, model=hf_model(model), config=hf_model(model).config).items():
                value = value[0] if isinstance(value, list) else value
                for target in params.get(name, [buffers[name]] if name in buffers else []):
                    if _shards_on_read(group, [target]):
                        target.to_local().copy_(value)
                    else:
                        assign(target, value)
                missing.discard(name)
    if missing:
        raise UsageError(f"--model_name_or_path {path}: weights missing for {sorted(missing)[:5]}…")

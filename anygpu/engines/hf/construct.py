"""How the HF engine builds its model: no rank holds a whole fp32 copy where the strategy shards.

- DeepSpeed ZeRO-3 with `zero3_init_flag: true` (the shipped configs): every parameter is partitioned as
  its module is built (`deepspeed.zero.Init`). Pretrained: `from_pretrained` does it itself (rank 0 reads
  the files, each rank keeps its partition); from scratch: built empty under zero.Init and filled with the
  engine's seeded initial values one unit at a time, each rank writing only its own partition
  (`anygpu.model.init_weights.assign`), the same values as the FSDP2 engine and as an unsharded build.
- FSDP2 with `fsdp_cpu_ram_efficient_loading: true` (the shipped configs): rank 0 builds the model (pretrained
  or seeded), every other rank builds it on the meta device; accelerate shards the meta model and broadcasts
  rank 0's tensors one at a time (`fsdp2_load_full_state_dict`).
- Anything else (DDP, one process, ZeRO-1/2, ZeRO-3 with `zero3_init_flag: false`): every rank builds it whole.

Host memory per node while loading a 70B model on 8 ranks in fp32 (280 GB a copy): 8 copies (2.2 TB) before;
now one copy on node 0 under FSDP2 (rank 0), and one partition per rank under ZeRO-3 (280 GB per node in all,
plus one module's full tensors at a time).
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, Iterator

import torch
from torch import nn

from anygpu.config.args import ModelArguments
from anygpu.engines.hf import strategy as hf_strategy
from anygpu.model import modeling
from anygpu.runtime import partitioned

FULL, ZERO3, META = "full", "zero3", "meta"


def kind(plan: hf_strategy.Plan, deepspeed_plugin: Any, rank: int) -> str:
    """How this rank builds the model: FULL, ZERO3 (partitioned while built) or META (FSDP2's other ranks)."""
    if plan.kind == "deepspeed" and (plan.request.zero_stage or 2) >= 3:
        init = deepspeed_plugin is not None and deepspeed_plugin.is_zero3_init_enabled()
        return ZERO3 if init else FULL
    if plan.kind == "fsdp" and rank != 0 and fsdp_broadcasts():
        return META
    return FULL


def fsdp_broadcasts(env=None) -> bool:
    """Whether accelerate's FSDP2 set-up broadcasts rank 0's weights (`fsdp_cpu_ram_efficient_loading`, which
    `accelerate launch` passes as FSDP_CPU_RAM_EFFICIENT_LOADING, as transformers' `is_fsdp_enabled` reads it)."""
    env = os.environ if env is None else env
    return env.get("FSDP_CPU_RAM_EFFICIENT_LOADING", "false").strip().lower() in ("1", "true", "yes")


def build(how: str, config, model_args: ModelArguments, seed: int, deepspeed_plugin: Any) -> nn.Module:
    """The model built `how` (see `kind`), with the engine's seeded initial values or the pretrained ones."""
    if how == META:
        return modeling.build_meta_model(config, model_args)  # real buffers: accelerate keeps the non-persistent ones
    if how == ZERO3:
        if model_args.model_name_or_path:  # transformers partitions as it loads (zero.Init; rank 0 reads the files)
            return modeling.build_full_model(config, model_args, seed)
        return _zero3_from_scratch(config, model_args, seed, deepspeed_plugin)
    with plain_model_construction(deepspeed_plugin):
        return modeling.build_full_model(config, model_args, seed)


def _zero3_from_scratch(config, model_args: ModelArguments, seed: int, deepspeed_plugin: Any) -> nn.Module:
    """Partitioned while built (transformers' own zero.Init contexts, less its initialisation: ours follows),
    then the seeded initial values, each rank writing its partitions only."""
    import deepspeed
    from transformers import AutoModelForCausalLM
    from transformers.initialization import no_init_weights
    from transformers.integrations.deepspeed import deepspeed_config, prevent_arange_dtype_change
    from transformers.modeling_utils import set_zero3_state

    with no_init_weights(), prevent_arange_dtype_change(), deepspeed.zero.Init(config_dict_or_path=deepspeed_config()):
        with set_zero3_state():  # zero.Init is entered: from_config must not enter it again
            model = AutoModelForCausalLM.from_config(
                config,
                attn_implementation=model_args.attn_implementation,
                trust_remote_code=model_args.trust_remote_code,
                dtype=torch.float32,
            )
    model.tie_weights()  # no_init_weights skipped the tying that init_weights does
    with plain_model_construction(
        deepspeed_plugin
    ):  # the initialisation's scratch copy is built on meta, unpartitioned
        modeling.init_parameters(model, config, seed, model_args.trust_remote_code)
    return model


def size_zero3_buffers(deepspeed_plugin: Any, model: nn.Module, world_size: int) -> None:
    """ZeRO-3's buffer and cache sizes, where the DeepSpeed config leaves them unset (accelerate's config files do):
    - `reduce_bucket_size`, `stage3_prefetch_bucket_size`, `stage3_param_persistence_threshold`: "auto", which
      accelerate fills from the hidden size (Hugging Face's recommended ZeRO-3 config); DeepSpeed's own defaults
      (5e8, 5e7, 1e5 elements) hold up to 5e8 gradient elements in one bucket: below that every rank kept the whole
      model's gradients until the backward's end;
    - `stage3_max_live_parameters`, `stage3_max_reuse_distance`: DeepSpeed keeps gathered parameters for reuse up to
      these (defaults 1e9 each), so a model below 1e9 parameters stayed gathered whole on every rank from the second
      step on. Bounded by one rank's share of the parameters (at 8B and up DeepSpeed's 1e9 stays), but never below
      what prefetching needs (`prefetch_floor`): DeepSpeed prefetches only up to the live cap minus what is
      gathered, so a cap of one rank's share (8B on 64 GPUs: 125M, less than its 525M embedding) turned it off.
    On 4 CPU ranks with an 85M model: 1.74 GB per rank before, 0.76 GB after (docs/memory.md)."""
    config = getattr(deepspeed_plugin, "deepspeed_config", None) or {}
    zero = config.get("zero_optimization", {})
    if zero.get("stage") != 3:
        return
    for key in ("reduce_bucket_size", "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold"):
        zero.setdefault(key, "auto")
    total = sum(partitioned.numel(p) for p in model.parameters())
    share = max(1, total // max(1, world_size))
    live = max(min(10**9, share), prefetch_floor(model, zero["stage3_prefetch_bucket_size"]))
    for key in ("stage3_max_live_parameters", "stage3_max_reuse_distance"):
        if zero.get(key) in (None, "auto"):
            zero[key] = live


def prefetch_floor(model: nn.Module, prefetch_bucket: int | float | str) -> int:
    """The fewest live parameters (elements) with which ZeRO-3 still prefetches: the largest module's own parameters
    (gathered while it runs) plus one prefetch bucket ("auto": 0.9 × hidden², as accelerate fills it)."""
    if prefetch_bucket == "auto":
        hidden = getattr(getattr(model, "config", None), "hidden_size", 0) or 0
        prefetch_bucket = 0.9 * hidden * hidden
    largest = max((sum(partitioned.numel(p) for p in m.parameters(recurse=False)) for m in model.modules()), default=0)
    return largest + int(prefetch_bucket)


@contextlib.contextmanager
def plain_model_construction(deepspeed_plugin: Any) -> Iterator[None]:
    """Build the model as an ordinary module even where transformers sees ZeRO-3 (`zero3_init_flag: false`).

    accelerate registers its DeepSpeed config with transformers whatever that flag says, and with ZeRO-3
    `from_config` then partitions the model while it is built. Unregister it for the build; DeepSpeed
    partitions the finished model when training starts.
    """
    if deepspeed_plugin is None:
        yield
        return
    from transformers.integrations import unset_hf_deepspeed_config

    unset_hf_deepspeed_config()
    try:
        yield
    finally:
        deepspeed_plugin.set_deepspeed_weakref()

"""LoRA with `peft`, TRL's options: the frozen base is sharded like any model, only the adapter trains.

The adapter is added on the meta device, before sharding, so FSDP2 shards the base and the adapter
of each decoder layer together; under --bf16 the frozen base is held in bf16 (`hold_frozen_in`); the base weights are then loaded (or initialised) under their base
names, and the adapter's own tensors start as peft starts them (A: Kaiming-uniform, B: zeros), drawn
from CPU generators seeded by name: the same on any world size, in both engines. Only parameters that
require gradients get an optimizer (AdamW state is measured in the tests). `final/` is a PEFT adapter
(`PeftModel.from_pretrained(base, final)`); `--merge_lora true` also writes `final-merged/`, a full model.

Without `--lora_target_modules` the adapted modules are peft's choice for the model type where peft has one
(its table covers ~40 types: Llama, Mistral, Mixtral, Qwen2, Gemma, GPT-2, Phi...); for any other type the
attention's query and value projections, found by name among the model's linear layers (peft's choice for the
types it lists); where no such name exists, every linear layer but the output head (peft's `all-linear`) — for a
mixture of experts every linear layer of the attention instead (DeepSeek-V3's latent projections): peft's
`all-linear` there adapts the routed experts' 3-D weights too, which takes no dropout and no `--ep`.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import hashlib
import math

import torch
from torch import nn

from anygpu.errors import UsageError
from anygpu.runtime import expert_parallel, partitioned

PREFIX = "base_model.model."
# the query and value projections' names across transformers' families (attention inputs, fused or not)
QUERY_VALUE = {"q_proj", "v_proj", "query", "value", "query_key_value", "qkv_proj", "c_attn", "Wqkv", "qkv"}


def default_targets(model: nn.Module) -> list[str] | str:
    """The modules to adapt when --lora_target_modules is left out (see the module docstring)."""
    from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as PEFT_DEFAULTS
    from transformers.pytorch_utils import Conv1D

    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type in PEFT_DEFAULTS:
        return PEFT_DEFAULTS[model_type]
    linear = {name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, (nn.Linear, Conv1D))}
    if linear & QUERY_VALUE:
        return sorted(linear & QUERY_VALUE)
    if expert_parallel.experts_modules(model):
        # peft's all-linear adapts a MoE's routed experts too (their 3-D weights: no dropout, not split by --ep)
        return expert_parallel.attention_linears(model) or "all-linear"
    return "all-linear"


def wrap(model: nn.Module, args, dropout_off: bool = False) -> nn.Module:
    """The model with a LoRA adapter (parameters still on meta), or the model itself without --use_peft.
    `dropout_off`: the objective runs without dropout (DPO, GRPO), so the adapter is built without any: peft's adapter
    on a MoE's expert weights takes none, and the default --lora_dropout would refuse it for nothing."""
    if not args.use_peft:
        return model
    from peft import LoraConfig, get_peft_model

    target = args.lora_target_modules
    if target is not None and target != ["all-linear"]:
        check_targets(model, target)
    target = target or default_targets(model)
    if target == ["all-linear"]:
        target = "all-linear"  # a string to peft (any other string is a regex on the full module name)
    config = LoraConfig(
        r=args.lora_r,
        lora_alpha=args.lora_alpha,
        lora_dropout=0.0 if dropout_off else args.lora_dropout,
        target_modules=target,
        modules_to_save=args.lora_modules_to_save,
        task_type="CAUSAL_LM",
    )
    try:
        return get_peft_model(model, config)
    except ValueError as err:
        if "lora_dropout" not in str(err):
            raise
        # peft adapts the 3-D expert weights of a MoE (all-linear, or gate_proj/up_proj/down_proj, map onto them)
        # through ParamWrapper, which has no dropout
        targets = ",".join(args.lora_target_modules) if args.lora_target_modules else "left out (peft's choice)"
        raise UsageError(
            f"--lora_dropout {args.lora_dropout} with --lora_target_modules {targets} on {model.config.model_type}: "
            "peft adapts the experts' own weights there, and its adapter for them takes no dropout; use "
            "--lora_dropout 0, or target modules outside the experts (e.g. q_proj,k_proj,v_proj,o_proj)."
        ) from None


def hold_frozen_in(model: nn.Module, dtype: torch.dtype) -> None:
    """The frozen base in the compute dtype (--bf16), as peers load it: half its memory, and the compute casts it to
    that dtype anyway. Trainable parameters (the adapter, modules to save) keep fp32 master weights. Works on meta."""
    for param in model.parameters():
        if not param.requires_grad and param.is_floating_point():
            param.data = param.data.to(dtype)


def linear_names(model: nn.Module) -> list[str]:
    """The last name part of every linear layer (what --lora_target_modules matches), lm_head left out."""
    kinds = (nn.Linear,) + tuple(t for t in (_conv1d(),) if t is not None)
    return sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, kinds)} - {"lm_head"})


def _conv1d():
    try:
        from transformers.pytorch_utils import Conv1D  # GPT-2's linear layers
    except ImportError:
        return None
    return Conv1D


def check_targets(model: nn.Module, targets: list[str]) -> None:
    """Every --lora_target_modules name matches a module (as peft matches: the name or its last parts)."""
    names = [name for name, _ in model.named_modules()]
    missing = [t for t in targets if not any(_matches(n, t) for n in names)]
    if missing:
        raise UsageError(
            f"--lora_target_modules {','.join(missing)}: the model has no such module. Its linear modules: "
            f"{','.join(linear_names(model))} (or all-linear)."
        )


def _matches(name: str, target: str) -> bool:
    """Whether the module `name` is what peft takes `target` for: the name itself or its last parts."""
    return name == target or name.endswith("." + target)


def check_untied_saves(model: nn.Module, modules_to_save: list[str] | None) -> None:
    """The FSDP2 engine's: --lora_modules_to_save names no output head tied to the input embeddings (peft trains a
    copy of it, which the engine's re-tying of the materialised model cannot hold: a KeyError before)."""
    head, embedding = model.get_output_embeddings(), model.get_input_embeddings()
    tied = head is not None and embedding is not None and getattr(head, "weight", None) is embedding.weight
    name = next((n for n, m in model.named_modules() if m is head), None) if tied else None
    if name and any(_matches(name, t) for t in modules_to_save or ()):
        raise UsageError(
            f"--lora_modules_to_save {','.join(modules_to_save)}: {name} is tied to the input embeddings "
            "(tie_word_embeddings), which the FSDP2 engine keeps tied; train a copy of it with the HF engine "
            "(run_hf_standalone.py), or leave it out."
        )


@contextlib.contextmanager
def adapters_off(model: nn.Module) -> Iterator[None]:
    """The base model's forward (LoRA's reference): each LoRA layer's disabled flag set, and restored. Not peft's
    `disable_adapter`, which also flips the adapters' requires_grad off and on: after a GRPO round's generation
    (`generation.gathered`) that toggle on a 4-bit base's FSDP2 units changed the next backward (2 ranks' grad norm
    10% off 1 rank's); the forward needs only the flag."""
    layers = [m for m in model.modules() if hasattr(m, "_disable_adapters")]
    was = [m._disable_adapters for m in layers]
    for m in layers:
        m._disable_adapters = True
    try:
        yield
    finally:
        for m, flag in zip(layers, was):
            m._disable_adapters = flag


def is_peft(model: nn.Module) -> bool:
    return hasattr(model, "peft_config")


def base_name(name: str) -> str | None:
    """The base model's name of a parameter of a PEFT model (None for the adapter's own A/B tensors)."""
    if ".lora_" in name:
        return None
    name = name.removeprefix(PREFIX)
    for part in (".base_layer", ".original_module", ".modules_to_save.default"):
        name = name.replace(part, "")
    return name


def base_targets(model: nn.Module) -> dict[str, list[torch.Tensor]]:
    """Base name → the parameters that start from that base tensor (a module to save has two copies)."""
    out: dict[str, list[torch.Tensor]] = {}
    for name, param in model.named_parameters():
        base = base_name(name)
        if base is not None:
            out.setdefault(base, []).append(param)
    return out


@torch.no_grad()
def init_adapter(model: nn.Module, seed: int) -> None:
    """peft's initial A (Kaiming-uniform, a=√5) and B (zeros), from CPU generators seeded by name."""
    from anygpu.model.init_weights import assign

    for name, param in model.named_parameters():
        if ".lora_" not in name:
            continue
        value = torch.zeros(param.shape)
        if ".lora_A." in name or ".lora_embedding_A." in name:
            gen = torch.Generator().manual_seed(
                int(hashlib.sha256(f"{seed}:lora:{name}".encode()).hexdigest()[:15], 16)
            )
            bound = 1.0 / math.sqrt(param.shape[1])  # kaiming_uniform_(a=√5) on a (r, in) matrix
            value.uniform_(-bound, bound, generator=gen)
        assign(param, value)


def trainable_line(model: nn.Module) -> str:
    trainable = sum(partitioned.numel(p) for p in model.parameters() if p.requires_grad)
    total = sum(partitioned.numel(p) for p in model.parameters())
    config = model.peft_config["default"]
    targets = config.target_modules
    targets = ", ".join(sorted(targets)) if isinstance(targets, (set, list, tuple)) else targets
    if getattr(config, "target_parameters", None):  # peft adapts a MoE's experts (3-D weights) by parameter name
        targets += f"; parameters {', '.join(sorted(config.target_parameters))}"
    return f"LoRA: {trainable / 1e6:.3f}M trainable / {total / 1e6:.1f}M parameters ({100 * trainable / total:.2f}%); targets {targets}"

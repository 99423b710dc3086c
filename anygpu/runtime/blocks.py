"""The model's decoder-layer classes: the unit FSDP2 shards, activation checkpointing recomputes,
initialisation runs one at a time and the preemption heartbeat watches."""

from __future__ import annotations

from torch import nn

from anygpu.errors import UsageError


def hf_model(model: nn.Module) -> nn.Module:
    """The transformers model inside a PEFT wrapper (or the model itself)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def decoder_layer_classes(model: nn.Module) -> tuple[type, ...]:
    """The transformer block classes to shard and checkpoint one by one (HF's `_no_split_modules`)."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    classes = {type(m) for m in model.modules() if type(m).__name__ in names}
    if not classes:
        raise UsageError(
            f"{type(model).__name__} names no decoder layer class (_no_split_modules={sorted(names)}): cannot shard it per layer."
        )
    return tuple(classes)


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The decoder layers in order (their classes found once: per module, a walk per module was quadratic,
    19 s of `anygpu plan` for a 70B model)."""
    classes = decoder_layer_classes(model)
    return [m for m in model.modules() if isinstance(m, classes)]

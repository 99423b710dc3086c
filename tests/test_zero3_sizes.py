"""The HF engine's ZeRO-3 sizes where the DeepSpeed config leaves them unset (anygpu/engines/hf/construct.py): the
live-parameter cap divides with the ranks, but never below what DeepSpeed needs to go on prefetching."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from anygpu.engines.hf.construct import prefetch_floor, size_zero3_buffers


def meta_llama(**shape):
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM, LlamaConfig

    with init_empty_weights():
        return AutoModelForCausalLM.from_config(LlamaConfig(**shape))


LLAMA_8B = dict(
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    vocab_size=128256,
)
MEMORY_MODEL = dict(
    hidden_size=512, intermediate_size=1408, num_hidden_layers=24, num_attention_heads=8, vocab_size=8192
)


def sized(model, world_size: int, **given) -> dict:
    plugin = SimpleNamespace(deepspeed_config={"zero_optimization": {"stage": 3, **given}})
    size_zero3_buffers(plugin, model, world_size)
    return plugin.deepspeed_config["zero_optimization"]


@pytest.mark.parametrize("world_size", [8, 64, 512])
def test_the_live_cap_leaves_room_to_prefetch_at_any_world_size(world_size):
    """Llama-3-8B: the cap is at least the largest module (the 525M-parameter embedding, gathered while it runs) plus
    one prefetch bucket (accelerate's auto, 0.9 × 4096²), so DeepSpeed's prefetch (up to the cap minus what is
    gathered) is never 0; one rank's share alone (8.0B / 64 = 125M) was below the embedding."""
    model = meta_llama(**LLAMA_8B)
    zero = sized(model, world_size)
    bucket = int(0.9 * 4096 * 4096)
    embedding = 128256 * 4096
    assert zero["stage3_max_live_parameters"] - embedding >= bucket
    assert zero["stage3_max_live_parameters"] == max(min(10**9, 8_030_261_248 // world_size), embedding + bucket)
    assert zero["stage3_max_reuse_distance"] == zero["stage3_max_live_parameters"]


def test_a_small_model_on_few_ranks_keeps_the_share_and_given_values_stay():
    """The 85M benchmark model on 4 ranks: one rank's share (what halved its ZeRO-3 memory, docs/memory.md) is
    above the prefetch floor, so it stays; values the config gives are the user's, its prefetch bucket counted."""
    model = meta_llama(**MEMORY_MODEL)
    total = sum(p.numel() for p in model.parameters())
    assert prefetch_floor(model, "auto") < total // 4
    assert sized(model, 4)["stage3_max_live_parameters"] == total // 4
    given = sized(model, 4, stage3_max_live_parameters=123, stage3_prefetch_bucket_size=10**8)
    assert given["stage3_max_live_parameters"] == 123  # the user's
    assert given["stage3_max_reuse_distance"] == 8192 * 512 + 10**8  # the embedding and the bucket the config gives

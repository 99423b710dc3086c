"""MFU's two halves: the training FLOPs per token of the model as it trains, and the peak of the device it runs on."""

from __future__ import annotations

import types

import pytest

import torch

from anygpu.config.args import ModelArguments
from anygpu.engines.trunk import startup
from anygpu.model import lora, modeling
from anygpu.runtime import hardware
from anygpu.train import metrics


def meta_model(preset: str, **lora_args):
    args = ModelArguments(config_name=preset)
    config = modeling.resolve_config(args)
    model = modeling.build_meta_model(config, args)
    if lora_args:
        model = lora.wrap(model, types.SimpleNamespace(use_peft=True, lora_modules_to_save=None, **lora_args))
    return model, config


def flops_per_token(model, config, block_size: int) -> float:
    """What both engines' start-up gives the run's log for its MFU."""
    prep = types.SimpleNamespace(config=config, block_size=block_size)
    flops, _ = startup.throughput_facts(
        prep, model, types.SimpleNamespace(bf16=True, fp16=False), False, torch.device("cpu")
    )
    return flops.at(block_size)


def test_a_tied_embedding_model_counts_its_output_projection():
    """Llama-3.2-1B (tied embeddings, 1,235,814,400 parameters): the output projection is a 128256 × 2048
    matmul per token even though its weight is the input embedding's; leaving it out read MFU ~21% low."""
    model, config = meta_model("llama-1b")
    assert config.tie_word_embeddings
    fpt = flops_per_token(model, config, 2048)
    assert fpt == 6 * 1_235_814_400 + 12 * 16 * 2048 * 2048


def test_an_untied_model_counts_every_matmul_once():
    model, config = meta_model("tiny")  # vocab 8192 × hidden 64, untied
    every = sum(p.numel() for p in model.parameters())
    assert flops_per_token(model, config, 64) == 6 * (every - 8192 * 64) + 12 * 2 * 64 * 64


def test_lora_counts_the_frozen_weights_at_4n():
    """Frozen weights need the forward (2N) and the gradient to their input (2N), not their own (2N)."""
    model, config = meta_model("tiny", lora_r=4, lora_alpha=8, lora_dropout=0.0, lora_target_modules=["q_proj"])
    adapter = sum(p.numel() for p in model.parameters() if p.requires_grad)
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad) - 8192 * 64  # less the input lookup
    assert adapter == 2 * (4 * 64 + 64 * 4)  # two layers' q_proj: A (4 × 64) and B (64 × 4)
    assert flops_per_token(model, config, 64) == 6 * adapter + 4 * frozen + 12 * 2 * 64 * 64


@pytest.mark.parametrize("name", ["NVIDIA H100 80GB HBM3 MIG 1g.10gb", "NVIDIA A100-SXM4-40GB MIG 3g.20gb"])
def test_a_mig_slice_is_not_given_the_whole_gpus_peak(name):
    assert hardware.peak_flops(name.split(" MIG")[0], "bf16") is not None  # the whole GPU is known
    assert hardware.peak_flops(name, "bf16") is None  # a slice's share is not: no MFU rather than a wrong one


def test_the_console_says_gib():
    """torch.cuda.max_memory_allocated / 2**30 is GiB (metrics.jsonl keeps its key max_memory_allocated_gb)."""
    line = metrics.format_line({"step": 1, "max_memory_allocated_gb": 12.5}, 10)
    assert "mem 12.5 GiB" in line


def test_a_mixture_of_experts_counts_the_experts_a_token_is_sent_to():
    """Qwen3-30B-A3B (its published config; 30.5B parameters, 3.3B activated): a token is multiplied by its top 8 of
    128 experts, not all of them; counting every expert read its MFU ~9x too high and `anygpu plan`'s step time
    ~9x too long."""
    from transformers import AutoConfig

    config = AutoConfig.for_model(
        "qwen3_moe", hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=48,
        num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
        vocab_size=151936, tie_word_embeddings=False, max_position_embeddings=40960,
    )  # fmt: skip
    model = modeling.build_meta_model(config, ModelArguments())
    every = sum(p.numel() for p in model.parameters())
    embedding = model.get_input_embeddings().weight.numel()
    assert abs(every - 30.5e9) < 0.05e9
    trainable, frozen = modeling.matmul_parameters(model)
    assert frozen == 0 and abs(trainable + embedding - 3.3e9) < 0.1e9, trainable  # Qwen's "3.3B activated"
    experts = 48 * 128 * 3 * 2048 * 768
    assert trainable == every - embedding - experts + experts * 8 // 128
    assert flops_per_token(model, config, 4096) == 6 * trainable + 12 * 48 * 2048 * 4096


@pytest.mark.parametrize("model_type", ["llama", "qwen3_moe"])
def test_zero3s_partitioned_parameters_count_as_the_model(model_type):
    """deepspeed.zero.Init leaves each parameter an empty placeholder (its size in ds_numel, its shape in ds_shape):
    the banner's parameter count and the MFU's FLOPs read those, not the empty tensors (they said 0.0M and 0), and a
    MoE's routed experts count at top_k of their number (read from the placeholder, it was all of them)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    small = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                 num_key_value_heads=1, num_experts=4, num_experts_per_tok=1, moe_intermediate_size=16)  # fmt: skip
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **small))
    whole = modeling.count_parameters(model), modeling.matmul_parameters(model)
    assert modeling.active_share(model) == (0.25 if model_type == "qwen3_moe" else 1.0)
    for p in model.parameters():  # as ZeRO-3 leaves them
        p.ds_numel, p.ds_shape, p.data = p.numel(), p.shape, torch.empty(0)
    assert whole[0] > 0 and (modeling.count_parameters(model), modeling.matmul_parameters(model)) == whole

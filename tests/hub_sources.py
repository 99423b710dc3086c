"""Tiny pretrained folders as `save_pretrained` writes them (the Hub's layout): MoE families with one tensor per
expert (Mixtral's `block_sparse_moe.experts.E.w1`, Qwen/OLMoE/DeepSeek's `mlp.experts.E.gate_proj`), gpt-oss's
fused experts with biases, and a dense Llama with tied embeddings stored in bf16 across several files with an index; each with a small
BPE tokenizer so the engines train on it as a user's download."""

from __future__ import annotations

import json
from pathlib import Path

SMALL = dict(
    vocab_size=320,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
)
EXPERTS = dict(moe_intermediate_size=16, num_experts_per_tok=2)
# a Qwen3-MoE whose attention weights fill whole NF4 blocks (64 × 256 elements): QLoRA's MoE tests
WIDE_MOE = dict(
    model_type="qwen3_moe", **{**SMALL, "hidden_size": 128, "intermediate_size": 256}, moe_intermediate_size=64,
    head_dim=32, num_experts=4, num_experts_per_tok=2,
)  # fmt: skip
# name → (config, storage dtype, max_shard_size)
SOURCES = {
    "qwen2_moe": (
        dict(model_type="qwen2_moe", **SMALL, **EXPERTS, num_experts=4, shared_expert_intermediate_size=32),
        "float32",
        "50GB",
    ),
    "qwen3_moe": (dict(model_type="qwen3_moe", **SMALL, **EXPERTS, num_experts=4, head_dim=8), "float32", "50GB"),
    "mixtral": (
        dict(model_type="mixtral", **SMALL, num_local_experts=4, num_experts_per_tok=2),
        "bfloat16",
        "20KB",
    ),
    "olmoe": (dict(model_type="olmoe", **SMALL, num_experts=4, num_experts_per_tok=2), "float32", "50GB"),
    "deepseek_v3": (
        dict(
            model_type="deepseek_v3",
            **{**SMALL, "num_key_value_heads": 4},  # multi-head latent attention: as many kv heads as heads
            **EXPERTS,
            n_routed_experts=4,
            n_shared_experts=1,
            first_k_dense_replace=1,
            n_group=1,
            topk_group=1,
            kv_lora_rank=16,
            q_lora_rank=16,
            qk_rope_head_dim=8,
            qk_nope_head_dim=8,
            v_head_dim=8,
        ),
        "float32",
        "50GB",
    ),
    "gpt_oss": (
        dict(model_type="gpt_oss", **SMALL, num_local_experts=4, num_experts_per_tok=2, head_dim=8, sliding_window=32),
        "float32",
        "50GB",
    ),
    "llama_bf16": (dict(model_type="llama", **SMALL, tie_word_embeddings=True), "bfloat16", "20KB"),
}
MOE = [name for name in SOURCES if name != "llama_bf16"]
# QLoRA's one-rank bf16 runs (test_qlora.py): Llamas with linear weights of whole NF4 blocks (64 × 256 elements), not
# in SOURCES (whose non-Llama entries the family tests train). Untied, grouped-query, bf16: the MLP and q/o are 4-bit
# (q/o, one block, not split over 2 ranks); fp32, tied, hidden 192 with 12 heads: only the MLP is. Weights at std
# 0.25, so that the loss moves with the (dequantised) weights.
NF4_SOURCES = {
    "llama_nf4_bf16": (
        dict(
            SMALL,
            model_type="llama",
            hidden_size=128,
            intermediate_size=256,
            tie_word_embeddings=False,
            initializer_range=0.25,
        ),
        "bfloat16",
        "50GB",
    ),
    "llama_nf4_fp32": (
        dict(
            SMALL,
            model_type="llama",
            hidden_size=192,
            intermediate_size=512,
            num_attention_heads=12,
            num_key_value_heads=4,
            tie_word_embeddings=True,
            initializer_range=0.25,
        ),
        "float32",
        "50GB",
    ),
}
EAGER = {"gpt_oss"}  # transformers has no SDPA path for its attention sinks


def attention(name: str) -> str:
    return "eager" if name in EAGER else "sdpa"


def tokenizer():
    """A byte-level BPE of 300 tokens (< every source's 320) trained on this Python's json package: offline, fixed."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    texts = [p.read_text(errors="ignore") for p in sorted(Path(json.__file__).parent.glob("*.py"))]
    bpe = Tokenizer(models.BPE(unk_token=None))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    special = ["<s>", "</s>", "<pad>"]
    bpe.train_from_iterator(
        texts,
        trainers.BpeTrainer(
            vocab_size=300, special_tokens=special, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
        ),
    )
    return PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<s>", eos_token="</s>", pad_token="<pad>")


def build(root: Path, names=SOURCES) -> dict[str, Path]:
    """root/hub-<name>: each source folder, written by save_pretrained in its storage dtype and shard size."""
    tok = tokenizer()
    out = {}
    for name in names:
        data, dtype, shard = {**SOURCES, **NF4_SOURCES}[name]
        # not a family's own name: tests/scripts/families.py names runs by it
        out[name] = write(root / f"hub-{name}", data, dtype, shard, tok, attention(name))
    return out


def write(folder: Path, config: dict, dtype: str, shard: str = "50GB", tok=None, attn: str | None = None) -> Path:
    """`config` (a dict with its model_type) as a Hub folder: weights drawn with seed 0, saved by save_pretrained in
    `dtype` and shards of `shard`, with the test tokenizer (`tok`, else a new one) whose special ids it takes;
    `attn` None: transformers' default (sdpa, eager for a family without it)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    tok = tok or tokenizer()
    data = dict(config, pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(
        AutoConfig.for_model(data.pop("model_type"), **data), attn_implementation=attn
    )
    with torch.no_grad():  # DeepSeek's router bias is a buffer that starts at 0: give it values to carry
        for key, buf in model.named_buffers():
            if "e_score_correction_bias" in key:
                buf.normal_()
    model.to(getattr(torch, dtype)).save_pretrained(folder, max_shard_size=shard)
    tok.save_pretrained(folder)
    return folder


def tensors(folder: Path) -> dict:
    """Every tensor of a folder's safetensors files, by name."""
    from safetensors.torch import load_file

    return {k: v for f in sorted(Path(folder).glob("*.safetensors")) for k, v in load_file(f).items()}

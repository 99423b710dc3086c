"""A one-layer Llama and a word-level tokenizer of `vocab` words t0 … t<vocab-1> (t0 pads, t1 ends): the models the
GRPO loss and objective tests hand to TRL and to anygpu alike."""

from __future__ import annotations


def llama(vocab: int, **overrides):
    """A tiny Llama (hidden 16, 2 heads, 32 positions) with weights drawn from torch's current seed."""
    from transformers import LlamaConfig, LlamaForCausalLM

    shape = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                 num_key_value_heads=2, max_position_embeddings=32)  # fmt: skip
    return LlamaForCausalLM(LlamaConfig(vocab_size=vocab, **{**shape, **overrides}))


def word_tokenizer(vocab: int):
    """Whitespace-split words t0 … t<vocab-1>, each its own id: t0 pads (and stands for unknown words), t1 ends."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=words, pad_token="t0", eos_token="t1")

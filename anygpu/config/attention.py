"""The attention implementations the engines take (--attn_implementation), and which of them need a mask."""

IMPLEMENTATIONS = ("sdpa", "eager", "flash_attention_2", "flash_attention_3", "flex_attention")
# Packed rows reach these as a dense (T × T) mask; flash attention takes the samples' boundaries as offsets and flex
# attention a block mask, neither of them dense.
DENSE_MASK = ("sdpa", "eager")

"""The attention implementations the engines take (--attn_implementation), and which of them need a mask; the
experts implementations of mixture-of-experts families (--experts_implementation, transformers' `ExpertsInterface`)."""

IMPLEMENTATIONS = ("sdpa", "eager", "flash_attention_2", "flash_attention_3", "flex_attention")
# Packed rows reach these as a dense (T × T) mask; flash attention takes the samples' boundaries as offsets and flex
# attention a block mask, neither of them dense.
DENSE_MASK = ("sdpa", "eager")

# grouped_mm: one grouped GEMM over all experts (torch's grouped_mm where the device has it, transformers' per-expert
# loop elsewhere); eager: the family's own per-expert loop; batched_mm: each token's experts' weights gathered
EXPERTS = ("grouped_mm", "eager", "batched_mm")


def check_device(attn_implementation: str, on_gpu: bool) -> None:
    """torch (2.13) has no FlexAttention backward on a CPU (`_validate_device`): refused before any work, not a
    traceback at the first backward."""
    from anygpu.errors import UsageError

    if attn_implementation == "flex_attention" and not on_gpu:
        raise UsageError(
            "--attn_implementation flex_attention: torch has no FlexAttention backward on a cpu, so it cannot train "
            "there: use --attn_implementation sdpa (the same losses)."
        )

"""The attention implementations the engines take (--attn_implementation), and which of them need a mask; the
experts implementations of mixture-of-experts families (--experts_implementation, transformers' `ExpertsInterface`)."""

VARLEN = "varlen_attention"  # torch's own varlen kernel (anygpu.model.varlen_attention)
IMPLEMENTATIONS = ("sdpa", "eager", "flash_attention_2", "flash_attention_3", "flex_attention", VARLEN)
# Packed rows reach these as a dense (T × T) mask; flash attention and torch's varlen kernel take the samples'
# boundaries as offsets (OFFSETS: the rows flattened into one, the offsets computed by the collator) and flex
# attention a block mask, neither of them dense.
DENSE_MASK = ("sdpa", "eager")
OFFSETS = ("flash_attention_2", "flash_attention_3", VARLEN)

# grouped_mm: one grouped GEMM over all experts (torch's grouped_mm where the device has it, transformers' per-expert
# loop elsewhere); eager: the family's own per-expert loop; batched_mm: each token's experts' weights gathered
EXPERTS = ("grouped_mm", "eager", "batched_mm")


def varlen_kernel_available() -> bool:
    """Whether this torch has its varlen attention kernel (torch.nn.attention.varlen: 2.9 and later)."""
    import importlib.util

    return importlib.util.find_spec("torch.nn.attention.varlen") is not None


def check_device(attn_implementation: str, on_gpu: bool, half: bool = True) -> None:
    """torch (2.13) has no FlexAttention backward on a CPU (`_validate_device`): refused before any work, not a
    traceback at the first backward. torch's varlen kernel is flash attention's: a GPU and 16-bit inputs (`half`),
    in a torch that has it (2.9 and later); on a CPU it runs as sdpa over the samples' blocks."""
    from anygpu.errors import UsageError

    if attn_implementation == VARLEN and on_gpu:
        if not varlen_kernel_available():
            raise UsageError(
                f"--attn_implementation {VARLEN}: this torch has no torch.nn.attention.varlen (torch 2.9 or later "
                "has): upgrade torch, or use --attn_implementation sdpa."
            )
        if not half:
            raise UsageError(
                f"--attn_implementation {VARLEN} on a GPU needs --bf16 (its flash attention kernel has no fp32 "
                "inputs): add it, or use --attn_implementation sdpa."
            )
    if attn_implementation == "flex_attention" and not on_gpu:
        raise UsageError(
            "--attn_implementation flex_attention: torch has no FlexAttention backward on a cpu, so it cannot train "
            "there: use --attn_implementation sdpa (the same losses)."
        )

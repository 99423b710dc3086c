"""The 4-bit NF4 format's sizes (QLoRA's base, `anygpu.model.qlora`), without torch: what the plan counts.

bitsandbytes' nf4 with nested quantisation, as torchao's `NF4Tensor` stores it: 4-bit codes two to a byte, one
int8 scale per block of 64 weights, one factor (in the weight's dtype) per block of 256 scales, and per tensor the
scales' mean and the 16-value code book.
"""

from __future__ import annotations

BLOCK = 64  # weights per absmax scale (bitsandbytes' and torchao's)
SCALER_BLOCK = 256  # scales per int8 block of the nested quantisation
QUANTUM = BLOCK * SCALER_BLOCK  # a 4-bit weight's element count is a multiple of this
PER_TENSOR = 1 + 16  # the scales' mean and the code book, in the weight's dtype, on every rank


def fits(shape: tuple[int, ...]) -> bool:
    """Whether a weight of this shape can be held in NF4 (2-D, whole scale blocks)."""
    return len(shape) == 2 and shape[0] * shape[1] % QUANTUM == 0


def splits(shape: tuple[int, ...], ranks: int) -> bool:
    """Whether a weight's rows split evenly over `ranks` at whole scale blocks (what sharding NF4 rows needs)."""
    rows, cols = shape
    return rows % ranks == 0 and (rows // ranks * cols) % QUANTUM == 0


def held_elements(shape: tuple[int, ...], ranks: int) -> int:
    """The elements of a 4-bit weight one rank of a shard group of `ranks` holds: its rows, or all where they do
    not split (the weight is then kept whole on each rank)."""
    whole = shape[0] * shape[1]
    return whole // ranks if splits(shape, ranks) else whole


def nbytes(elements: int, dtype_bytes: int) -> int:
    """Bytes of `elements` weights in NF4 (a whole tensor or a rank's rows of one), `dtype_bytes` the weight's
    dtype (the scales' factors and the per-tensor values are in it)."""
    return elements // 2 + elements // BLOCK + elements // QUANTUM * dtype_bytes + PER_TENSOR * dtype_bytes


def is_4bit(tensor) -> bool:
    """Whether `tensor` (plain or a DTensor) holds NF4; by its type's name: importing torchao costs seconds."""
    return type(getattr(tensor, "_local_tensor", tensor)).__name__ == "NF4Tensor"


def unsplittable(layer, ranks: int) -> set:
    """`layer`'s 4-bit weights that FSDP2 must leave whole on each rank (its `ignored_params`) over `ranks`: those
    whose rows do not split, and all of them in a shard group of one rank (--bf16 keeps FSDP2 there), where FSDP2
    skips the all-gather and rebuilds a parameter from its first all-gather input alone, not NF4's three (codes,
    scales, factors); that rank holds each weight whole either way."""
    return {p for p in layer.parameters() if is_4bit(p) and (ranks == 1 or not splits(tuple(p.shape), ranks))}

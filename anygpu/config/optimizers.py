"""The optimizers `--optim` names (Hugging Face's names) and what their state costs, free of torch (the plan reads it).

Low-bit AdamW keeps each moment as one byte (8-bit) or half a byte (4-bit) per element and one fp32 scale per
block of elements. The blocks lie within a parameter's rows (dim 0, the dim FSDP2 shards), so a rank's shard holds
whole blocks, quantised exactly as in one process: the state, and the curve, do not depend on the world size.
"""

from __future__ import annotations

import math

ADAMW = ("adamw_torch", "adamw_torch_fused")  # torch's AdamW (fused kernel where the device has one)
LOW_BIT = {"adamw_torch_8bit": 8, "adamw_torch_4bit": 4}  # HF's names for torchao's 8- and 4-bit AdamW
OPTIMIZERS = (*ADAMW, *LOW_BIT)
# torchao's block sizes (AdamW8bit 256, AdamW4bit 128); a row whose length they do not divide gets the largest power
# of two that does, down to MIN_BLOCK; below it the scales would cost more than the bits save, and the moment stays fp32.
MAX_BLOCK = {8: 256, 4: 128}
MIN_BLOCK = 32
MIN_QUANTISED = 4096  # bitsandbytes' and torchao's threshold: smaller tensors keep fp32 moments


def row_block(shape: tuple[int, ...], optim: str) -> int | None:
    """The quantisation block of a parameter of this shape under `optim` (elements, dividing its row length), or None
    where its moments stay fp32 (full-precision AdamW, 1-D or small tensors, rows no block of MIN_BLOCK divides)."""
    bits = LOW_BIT.get(optim)
    if bits is None or len(shape) < 2 or math.prod(shape) < MIN_QUANTISED:
        return None
    block = math.gcd(math.prod(shape[1:]), MAX_BLOCK[bits])
    return block if block >= MIN_BLOCK else None


def state_bytes(shape: tuple[int, ...], elements: int, optim: str) -> int:
    """Bytes of AdamW's two moments for `elements` (a whole number of rows) of a parameter of this shape."""
    block = row_block(shape, optim)
    if block is None:
        return 8 * elements
    return 2 * (elements * LOW_BIT[optim] // 8 + 4 * (elements // block))

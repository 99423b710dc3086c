"""The optimizers `--optim` names (Hugging Face's names) and what their state costs, free of torch (the plan reads it).

bf16 AdamW (`adamw_anyprecision` with bf16 moments) keeps each moment as two bytes per element. Low-bit AdamW keeps each moment as one byte (8-bit) or half a byte (4-bit) per element and one fp32 scale per
block of elements. The blocks lie within a parameter's rows (dim 0, the dim FSDP2 shards), so a rank's shard holds
whole blocks, quantised exactly as in one process: the state, and the curve, do not depend on the world size.
"""

from __future__ import annotations

import math

ADAMW = ("adamw_torch", "adamw_torch_fused")  # torch's AdamW (fused kernel where the device has one)
LOW_BIT = {"adamw_torch_8bit": 8, "adamw_torch_4bit": 4}  # HF's names for torchao's 8- and 4-bit AdamW
# HF's name for AdamW whose moments take the dtypes its --optim_args give (torchdistx's AnyPrecisionAdamW there)
ANYPRECISION = "adamw_anyprecision"
OPTIMIZERS = (*ADAMW, *LOW_BIT, ANYPRECISION)
# The state kinds (what a run keeps as AdamW's moments; the plan's and the optimizer's key): fp32, low-bit, bf16
FP32, BF16 = "adamw_torch", "adamw_anyprecision(bfloat16)"
BF16_ARGS = "momentum_dtype=bfloat16,variance_dtype=bfloat16"
ANYPRECISION_ARGS = ("momentum_dtype", "variance_dtype", "use_kahan_summation", "compensation_buffer_dtype")
# torchao's block sizes (AdamW8bit 256, AdamW4bit 128); a row whose length they do not divide gets the largest power
# of two that does, down to MIN_BLOCK; below it the scales would cost more than the bits save, and the moment stays fp32.
MAX_BLOCK = {8: 256, 4: 128}
MIN_BLOCK = 32
MIN_QUANTISED = 4096  # bitsandbytes' and torchao's threshold: smaller tensors keep fp32 moments


def state_kind(optim: str, optim_args: str | None = None) -> str:
    """What --optim (with --optim_args) keeps as AdamW's moments: FP32, a LOW_BIT name, or BF16 (adamw_anyprecision
    with both moments in bfloat16; in float32, its default, it is AdamW). ValueError says what cannot be used."""
    if optim != ANYPRECISION:
        if optim_args:
            raise ValueError(
                f"--optim_args {optim_args!r} is for --optim {ANYPRECISION}: leave it out with --optim {optim}."
            )
        return FP32 if optim in ADAMW else optim
    given = dict(
        part.split("=", 1) if "=" in part else (part, "")
        for part in (optim_args or "").replace(" ", "").split(",")
        if part
    )
    unknown = sorted(set(given) - set(ANYPRECISION_ARGS))
    if unknown:
        raise ValueError(
            f"--optim_args {optim_args!r}: {', '.join(unknown)} unknown; {ANYPRECISION} takes {', '.join(ANYPRECISION_ARGS)}."
        )
    if given.get("use_kahan_summation", "false").lower() not in ("false", "0"):
        raise ValueError(
            f"--optim_args {optim_args!r}: use_kahan_summation compensates bf16 weights; the weights here are fp32 "
            "masters (only the moments are bf16): leave it out."
        )
    dtypes = {given.get("momentum_dtype", "float32"), given.get("variance_dtype", "float32")}
    if dtypes == {"float32"}:
        return FP32
    if dtypes == {"bfloat16"}:
        return BF16
    raise ValueError(f"--optim_args {optim_args!r}: both moments in bfloat16 ({BF16_ARGS}) or both in float32.")


def flag(kind: str) -> str:
    """The engines' options that give a state kind."""
    return f"--optim {ANYPRECISION} --optim_args {BF16_ARGS}" if kind == BF16 else f"--optim {kind}"


def row_block(shape: tuple[int, ...], optim: str) -> int | None:
    """The quantisation block of a parameter of this shape under `optim` (elements, dividing its row length), or None
    where its moments stay fp32 (full-precision AdamW, 1-D or small tensors, rows no block of MIN_BLOCK divides)."""
    bits = LOW_BIT.get(optim)
    if bits is None or len(shape) < 2 or math.prod(shape) < MIN_QUANTISED:
        return None
    block = math.gcd(math.prod(shape[1:]), MAX_BLOCK[bits])
    return block if block >= MIN_BLOCK else None


def state_bytes(shape: tuple[int, ...], elements: int, optim: str) -> int:
    """Bytes of AdamW's two moments for `elements` (a whole number of rows) of a parameter of this shape; `optim` a
    state kind (`state_kind`)."""
    if optim == BF16:
        return 4 * elements
    block = row_block(shape, optim)
    if block is None:
        return 8 * elements
    return 2 * (elements * LOW_BIT[optim] // 8 + 4 * (elements // block))

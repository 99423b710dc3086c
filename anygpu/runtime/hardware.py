"""What accelerator this process has: vendor, devices, capability, peak FLOP/s, TF32.

ROCm builds of torch keep the `torch.cuda` API and set `torch.version.hip`, so one code
path serves NVIDIA and AMD; the vendor only changes names, peak numbers and defaults.
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

# Dense peak TFLOP/s per GPU (no sparsity), from the vendors' data sheets, by precision of the matmuls:
# (bf16/fp16 tensor cores, TF32/XF32 tensor cores or None where the part has no such format, fp32).
# Keys are matched on whole words of the normalised device name (`_name_words`), longest key first:
# "NVIDIA GB200" is a GB200, never a B200; "NVIDIA A10G" never an A10.
PEAK_TFLOPS: dict[str, tuple[float, float | None, float]] = {
    "H200 NVL": (835.0, 417.5, 60.0),
    "H200": (989.0, 494.7, 66.9),
    "H100 NVL": (835.0, 417.5, 60.0),
    "H100 PCIe": (756.0, 378.0, 51.2),
    "H100": (989.0, 494.7, 66.9),  # SXM (named "H100 80GB HBM3")
    "H800": (989.0, 494.7, 66.9),
    "GH200": (989.0, 494.7, 66.9),
    "B200": (2250.0, 1100.0, 75.0),
    "GB200": (2500.0, 1250.0, 80.0),
    "A100": (312.0, 156.0, 19.5),
    "A800": (312.0, 156.0, 19.5),
    "A10G": (70.0, 35.0, 31.2),
    "A10": (125.0, 62.5, 31.2),
    "L40S": (362.0, 183.0, 91.6),
    "L40": (181.0, 90.5, 90.5),
    "L4": (121.0, 60.0, 30.3),
    "RTX 4090": (165.2, 82.6, 82.6),
    "RTX 3090": (71.0, 35.6, 35.6),
    "V100": (125.0, None, 15.7),  # fp16 tensor cores; no bf16, no TF32
    "MI355X": (2500.0, None, 157.3),
    "MI325X": (1307.0, 653.7, 163.4),
    "MI300X": (1307.0, 653.7, 163.4),
    "MI300A": (980.6, 490.3, 122.6),
    "MI250X": (383.0, None, 95.7),
    "MI250": (362.1, None, 90.5),
    "MI210": (181.0, None, 45.3),
}


@dataclass(frozen=True)
class DeviceInfo:
    index: int
    name: str
    total_memory_gb: float
    capability: str  # "9.0" on NVIDIA, the gfx arch (e.g. "gfx942") on AMD


def vendor() -> str:
    """'nvidia', 'amd' or 'cpu' for this process's torch build and machine."""
    if not torch.cuda.is_available():
        return "cpu"
    return "amd" if getattr(torch.version, "hip", None) else "nvidia"


def on_nvidia_gpu(device) -> bool:
    """Whether `device` is a CUDA device of an NVIDIA build (a ROCm build names its GPUs cuda too)."""
    return getattr(device, "type", "cpu") == "cuda" and vendor() == "nvidia"


def devices() -> list[DeviceInfo]:
    if vendor() == "cpu":
        return []
    out = []
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        cap = getattr(p, "gcnArchName", None) if vendor() == "amd" else f"{p.major}.{p.minor}"
        out.append(DeviceInfo(i, p.name, p.total_memory / 2**30, cap or f"{p.major}.{p.minor}"))
    return out


def _name_words(name: str) -> list[str]:
    """'NVIDIA A100-SXM4-80GB' → ['NVIDIA', 'A100', 'SXM4', '80GB']."""
    return re.sub(r"[-_/,()]", " ", name).upper().split()


def matmul_precision(bf16: bool, fp16: bool, tf32: bool) -> str:
    """The precision of the training matmuls: 'bf16', 'fp16', 'tf32' or 'fp32'."""
    return "bf16" if bf16 else "fp16" if fp16 else "tf32" if tf32 else "fp32"


def peak_flops(device_name: str, precision: str) -> float | None:
    """Peak dense FLOP/s of one GPU at `precision` (see `matmul_precision`), or None (with a warning)
    for a part not in PEAK_TFLOPS. TF32 on a part without it is its fp32 peak."""
    words = _name_words(device_name)
    if "MIG" in words:  # "NVIDIA A100-SXM4-40GB MIG 3g.20gb": a slice has a share of the SMs, not the whole peak
        logger.warning("%r is a MIG slice: its peak FLOP/s is not known, MFU is not reported", device_name)
        return None
    for key in sorted(PEAK_TFLOPS, key=lambda k: -len(_name_words(k))):
        kw = _name_words(key)
        if any(words[i : i + len(kw)] == kw for i in range(len(words) - len(kw) + 1)):
            half, tf32, fp32 = PEAK_TFLOPS[key]
            value = half if precision in ("bf16", "fp16") else (tf32 or fp32) if precision == "tf32" else fp32
            return value * 1e12
    logger.warning("peak FLOP/s of %r unknown: MFU is not reported (add it to PEAK_TFLOPS)", device_name)
    return None


def peak_bf16_flops(device_name: str) -> float | None:
    return peak_flops(device_name, "bf16")


def has_tf32() -> bool:
    """TF32-class matmuls: NVIDIA compute capability ≥ 8.0 (Ampere and later); on AMD the gfx942 parts
    (MI300X, MI325X, MI300A: XF32 through hipBLASLt). MI250 and MI355X have none (PEAK_TFLOPS: no TF32 peak)."""
    if vendor() == "nvidia":
        return torch.cuda.get_device_capability()[0] >= 8
    if vendor() == "amd":
        return (getattr(torch.cuda.get_device_properties(0), "gcnArchName", "") or "").startswith("gfx942")
    return False


ROCM_TF32_ENV = "HIPBLASLT_ALLOW_TF32"  # without =1, ROCm's torch keeps fp32 matmuls IEEE whatever the flags say


def configure_tf32(enabled: bool | None) -> bool:
    """Allow TF32 matmuls/convolutions (default on where the GPU has them); return whether they are on, as the
    hardware will run them: the banner and the MFU peak follow this.

    On ROCm the flags take effect only with HIPBLASLT_ALLOW_TF32=1: exported by the launchers, set here
    when the caller left it unset (before the first matmul); a caller's other value keeps TF32 off.
    On CPU nothing changes.
    """
    on = (vendor() != "cpu") if enabled is None else bool(enabled)
    if vendor() == "cpu" or not has_tf32():
        on = False
    if on and vendor() == "amd" and os.environ.setdefault(ROCM_TF32_ENV, "1") != "1":
        logger.info("TF32 off: %s=%s (set it to 1 for TF32 matmuls)", ROCM_TF32_ENV, os.environ[ROCM_TF32_ENV])
        on = False
    _set_tf32_flags(on)
    return on


def _set_tf32_flags(on: bool) -> None:
    """The legacy switches, then (torch ≥ 2.9) the new ones, to the same value: torch 2.9-2.10 raise when a reader of
    one API (inductor and Trainer read the legacy flags) finds the other set differently."""
    torch.backends.cuda.matmul.allow_tf32 = on
    torch.backends.cudnn.allow_tf32 = on
    if _has_fp32_precision_api():
        precision = "tf32" if on else "ieee"
        torch.backends.cuda.matmul.fp32_precision = precision
        torch.backends.cudnn.conv.fp32_precision = precision


# Set by `anygpu verify` for the runs it compares: the same kernels from run to run, so what differs between two
# world sizes is the split of the batch, not the kernels' choice of summation order.
DETERMINISTIC_ENV = "ANYGPU_DETERMINISTIC"


def configure_determinism() -> bool:
    """Deterministic algorithms (cuDNN too) where ANYGPU_DETERMINISTIC=1; return whether on.

    warn_only: an op without a deterministic kernel warns instead of stopping the run. cuBLAS needs
    CUBLAS_WORKSPACE_CONFIG in the environment before its first call (verify sets it)."""
    if os.environ.get(DETERMINISTIC_ENV) != "1":
        return False
    torch.use_deterministic_algorithms(True, warn_only=True)
    # Filling every new tensor with NaN (determinism's default, for reads of uninitialised memory) costs a write per
    # allocation and changes nothing a correct step computes.
    torch.utils.deterministic.fill_uninitialized_memory = False
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    return True


def _has_fp32_precision_api() -> bool:
    return hasattr(torch.backends.cuda.matmul, "fp32_precision") and hasattr(
        getattr(torch.backends.cudnn, "conv", None), "fp32_precision"
    )


def supports_bf16() -> bool:
    return vendor() != "cpu" and torch.cuda.is_bf16_supported()


def host_memory_bytes(field: str = "MemAvailable", meminfo: Path = Path("/proc/meminfo")) -> int | None:
    """A line of Linux's /proc/meminfo in bytes: MemAvailable (what it can give without swapping), MemTotal; None
    where it does not say."""
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def describe() -> str:
    """One line per device, for the banner and `anygpu info`."""
    if vendor() == "cpu":
        return f"CPU only (torch {torch.__version__}, {torch.get_num_threads()} threads)"
    lines = [
        f"{vendor().upper()} (torch {torch.__version__}, {'HIP ' + torch.version.hip if vendor() == 'amd' else 'CUDA ' + str(torch.version.cuda)})"
    ]
    lines += [f"  [{d.index}] {d.name}, {d.total_memory_gb:.0f} GiB, {d.capability}" for d in devices()]
    return "\n".join(lines)

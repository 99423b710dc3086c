"""What accelerator this process has: vendor, devices, capability, peak FLOP/s, TF32.

ROCm builds of torch keep the `torch.cuda` API and set `torch.version.hip`, so one code
path serves NVIDIA and AMD; the vendor only changes names, peak numbers and defaults.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)

# Dense bf16 peak TFLOP/s (no sparsity), per GPU, from the vendors' data sheets.
# Matched by substring of torch.cuda.get_device_name(); the first match wins.
PEAK_BF16_TFLOPS: list[tuple[str, float]] = [
    ("H200", 989.0),
    ("H100 NVL", 835.0),
    ("H100 PCIe", 756.0),
    ("H100", 989.0),  # SXM
    ("H800", 989.0),
    ("GH200", 989.0),
    ("B200", 2250.0),
    ("GB200", 2500.0),
    ("A100", 312.0),
    ("A800", 312.0),
    ("A10G", 70.0),
    ("A10", 125.0),
    ("L40S", 362.0),
    ("L40", 181.0),
    ("L4", 121.0),
    ("RTX 4090", 165.0),
    ("RTX 3090", 71.0),
    ("V100", 125.0),  # fp16 tensor cores; V100 has no bf16
    ("MI355X", 2500.0),
    ("MI325X", 1307.0),
    ("MI300X", 1307.0),
    ("MI300A", 980.6),
    ("MI250X", 383.0),
    ("MI250", 362.1),
    ("MI210", 181.0),
]


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


def devices() -> list[DeviceInfo]:
    if vendor() == "cpu":
        return []
    out = []
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        cap = getattr(p, "gcnArchName", None) if vendor() == "amd" else f"{p.major}.{p.minor}"
        out.append(DeviceInfo(i, p.name, p.total_memory / 2**30, cap or f"{p.major}.{p.minor}"))
    return out


def peak_bf16_flops(device_name: str) -> float | None:
    """Peak dense bf16 FLOP/s of one GPU, or None (with a warning) for a part not in the table."""
    for key, tflops in PEAK_BF16_TFLOPS:
        if key.lower() in device_name.lower():
            return tflops * 1e12
    logger.warning("peak bf16 FLOP/s of %r unknown: MFU is not reported (add it to PEAK_BF16_TFLOPS)", device_name)
    return None


def has_tf32() -> bool:
    """TF32 tensor cores: NVIDIA compute capability ≥ 8.0 (Ampere and later)."""
    return vendor() == "nvidia" and torch.cuda.get_device_capability()[0] >= 8


def configure_tf32(enabled: bool | None) -> bool:
    """Allow TF32 matmuls/convolutions (default on where the GPU has them); return whether on.

    On ROCm torch's flags are set the same way; whether matmuls then use a reduced format
    (XF32 on MI300-class parts through hipBLASLt) depends on the GPU and ROCm version, and on
    older Instinct parts they stay fp32. On CPU nothing changes.
    """
    on = (vendor() != "cpu") if enabled is None else bool(enabled)
    if vendor() == "nvidia" and not has_tf32():
        on = False
    if _has_fp32_precision_api():
        precision = "tf32" if on else "ieee"
        torch.backends.cuda.matmul.fp32_precision = precision
        torch.backends.cudnn.conv.fp32_precision = precision
    else:  # torch < 2.9
        torch.backends.cuda.matmul.allow_tf32 = on
        torch.backends.cudnn.allow_tf32 = on
    return on


def _has_fp32_precision_api() -> bool:
    return hasattr(torch.backends.cuda.matmul, "fp32_precision") and hasattr(getattr(torch.backends.cudnn, "conv", None), "fp32_precision")


def supports_bf16() -> bool:
    return vendor() != "cpu" and torch.cuda.is_bf16_supported()


def describe() -> str:
    """One line per device, for the banner and `anygpu info`."""
    if vendor() == "cpu":
        return f"CPU only (torch {torch.__version__}, {torch.get_num_threads()} threads)"
    lines = [f"{vendor().upper()} (torch {torch.__version__}, {'HIP ' + torch.version.hip if vendor() == 'amd' else 'CUDA ' + str(torch.version.cuda)})"]
    lines += [f"  [{d.index}] {d.name}, {d.total_memory_gb:.0f} GiB, {d.capability}" for d in devices()]
    return "\n".join(lines)

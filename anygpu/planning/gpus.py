"""GPUs `anygpu plan --gpu NAME` knows, for planning on a machine that does not have them.

Memory is what torch reports per device (GiB), a little under the marketed figure; an MI250X shows
as two devices of 64 GiB. Peak FLOP/s come from runtime.hardware.PEAK_TFLOPS by the device name.
"""

from __future__ import annotations

from typing import NamedTuple


class KnownGpu(NamedTuple):
    device_name: str  # as torch names it (what PEAK_TFLOPS is matched against)
    memory_gib: float


GPUS: dict[str, KnownGpu] = {
    "h100": KnownGpu("NVIDIA H100 80GB HBM3", 79.6),
    "h100-pcie": KnownGpu("NVIDIA H100 PCIe", 79.6),
    "h100-nvl": KnownGpu("NVIDIA H100 NVL", 93.1),
    "h200": KnownGpu("NVIDIA H200", 139.8),
    "b200": KnownGpu("NVIDIA B200", 178.4),
    "a100-80gb": KnownGpu("NVIDIA A100-SXM4-80GB", 79.3),
    "a100-40gb": KnownGpu("NVIDIA A100-SXM4-40GB", 39.4),
    "l40s": KnownGpu("NVIDIA L40S", 44.4),
    "l4": KnownGpu("NVIDIA L4", 22.0),
    "a10g": KnownGpu("NVIDIA A10G", 22.0),
    "rtx4090": KnownGpu("NVIDIA GeForce RTX 4090", 23.6),
    "v100": KnownGpu("Tesla V100-SXM2-32GB", 31.7),
    "mi300x": KnownGpu("AMD Instinct MI300X", 192.0),
    "mi325x": KnownGpu("AMD Instinct MI325X", 256.0),
    "mi250x": KnownGpu("AMD Instinct MI250X", 64.0),
    "mi250": KnownGpu("AMD Instinct MI250", 64.0),
    "mi210": KnownGpu("AMD Instinct MI210", 64.0),
}

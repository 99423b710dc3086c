"""The environment the launchers export: vendor presets, each kept when the caller set it.

Standard library only. Every preset carries the reason it exists; docs/launchers.md repeats
them for the reader, and ``--dry-run`` prints what was exported and what was kept.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Mapping, Sequence

from anygpu.launch.detect import AMD, NVIDIA


@dataclass(frozen=True)
class Preset:
    name: str
    value: str
    why: str
    # Other names for the same knob: when the caller set any of them, this preset is skipped
    # (e.g. torch reads PYTORCH_ALLOC_CONF before PYTORCH_CUDA_ALLOC_CONF).
    aliases: tuple[str, ...] = ()


def cpu_count() -> int:
    """CPUs this process may run on (cgroup/Slurm affinity aware), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


# The tables below, each in the order it is exported; presets() picks the ones that apply to a job.
RESTART_PRESETS = (
    Preset(
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE",
        "1",
        "with --max-restarts: the workers of a restarted attempt get a fresh store; sharing "
        "the rendezvous store (torch's default) hands them the previous attempt's addresses, "
        "and the restart fails or hangs (pytorch/pytorch#135712)",
    ),
)
# TORCH_NCCL_ASYNC_ERROR_HANDLING is left to torch: its default (3, since torch 2.2) already aborts the
# communicator and ends the process when a collective fails or times out; 1 would add nothing measured here.
GPU_PRESETS = (
    Preset("NCCL_DEBUG", "WARN", "NCCL/RCCL problems are printed without the INFO flood; set NCCL_DEBUG=INFO to debug"),
)
# torch >= 2.9 reads the allocator's settings from PYTORCH_ALLOC_CONF on CUDA and ROCm alike; the CUDA-named
# variable still works but warns in every rank. The vendor names are aliases: a caller's value is kept.
ALLOC_ALIASES = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF")
NVIDIA_PRESETS = (
    Preset(
        "CUDA_DEVICE_ORDER",
        "PCI_BUS_ID",
        "CUDA numbers the GPUs as nvidia-smi does (CUDA's default puts the fastest first), so "
        "indices in CUDA_VISIBLE_DEVICES and --gpus mean the GPUs the launcher printed",
    ),
    Preset(
        "PYTORCH_ALLOC_CONF",
        "expandable_segments:True",
        "the caching allocator grows segments instead of fragmenting memory when shapes vary; "
        "not compatible with CUDA graphs, set your own value (or an empty one) to use them",
        aliases=ALLOC_ALIASES,
    ),
)
AMD_ROCM7_PRESETS = (  # ROCm >= 7.0
    Preset(
        "PYTORCH_ALLOC_CONF",
        "expandable_segments:True",
        "less fragmentation, as on NVIDIA; set only on ROCm >= 7.0, where expandable segments work",
        aliases=ALLOC_ALIASES,
    ),
)
AMD_PRESETS = (
    Preset(
        "HSA_NO_SCRATCH_RECLAIM",
        "1",
        "scratch memory stays with its queue; avoids RCCL crashes on older firmware "
        "(ROCm's Megatron recipe default; costs some VRAM)",
    ),
    Preset(
        "HIP_FORCE_DEV_KERNARG",
        "1",
        "kernel arguments in device memory, lower launch latency (the default since ROCm 6.2; set for older ROCm)",
    ),
    Preset("RCCL_MSCCL_ENABLE", "0", "avoids a past RCCL data-mismatch bug in MSCCL (ROCm guidance)"),
    Preset(
        "HIPBLASLT_ALLOW_TF32",
        "1",
        "ROCm's torch honours the TF32 switch (--tf32, on by default on MI300-class GPUs) only with it, "
        "from the process start; --tf32 false still keeps fp32 matmuls IEEE",
    ),
)
AMD_MULTI_GPU_PRESETS = (  # more than one process on the node
    Preset(
        "HSA_FORCE_FINE_GRAIN_PCIE",
        "1",
        "peer-to-peer transfers between PCIe GPUs (needs large BAR); fixed a reported DDP hang",
    ),
    Preset(
        "GPU_MAX_HW_QUEUES",
        "2",
        "with TORCH_NCCL_HIGH_PRIORITY: RCCL gets high-priority streams that overlap FSDP's "
        "compute (ROCm MI300X tuning guide)",
    ),
    Preset("TORCH_NCCL_HIGH_PRIORITY", "1", "see GPU_MAX_HW_QUEUES"),
)
MI300_PRESETS = (  # several MI300X/MI325X on the node
    Preset("NCCL_MIN_NCHANNELS", "112", "more RCCL channels use MI300X/MI325X's bandwidth (ROCm workload guide)"),
)


def presets(
    vendor: str,
    *,
    use_gpus: bool,
    nproc_per_node: int,
    gpu_names: Sequence[str] = (),
    rocm_version: tuple[int, int] | None = None,
    num_cpus: int | None = None,
    restarts: bool = False,
) -> list[Preset]:
    """The variables to export for one node; ``use_gpus`` is False for a CPU run, ``restarts``
    True when torchrun may restart the workers (--max-restarts)."""
    threads = max(1, (num_cpus or cpu_count()) // max(1, nproc_per_node))
    out = [
        Preset(
            "PYTHONUNBUFFERED",
            "1",
            "every rank's log lines appear at once and in order, also when piped to a file or a job log",
        ),
        Preset(
            "OMP_NUM_THREADS",
            str(threads),
            f"the node's CPUs split between its {nproc_per_node} process(es); unset, each process "
            "would start one thread per core (oversubscription), and torchrun would force 1 with a warning",
        ),
        *(RESTART_PRESETS if restarts else ()),
    ]
    if not use_gpus:
        return out
    if vendor == NVIDIA:
        return [*out, *GPU_PRESETS, *NVIDIA_PRESETS]
    if vendor == AMD:
        return [*out, *GPU_PRESETS, *amd_presets(nproc_per_node, gpu_names, rocm_version)]
    raise ValueError(f"unknown vendor {vendor!r}")


def amd_presets(nproc_per_node: int, gpu_names: Sequence[str], rocm_version: tuple[int, int] | None) -> list[Preset]:
    """AMD's own: the allocator on ROCm >= 7, RCCL's and HIP's settings, and more for several GPUs per node."""
    out = [*(AMD_ROCM7_PRESETS if rocm_version is not None and rocm_version >= (7, 0) else ()), *AMD_PRESETS]
    if nproc_per_node > 1:
        out += AMD_MULTI_GPU_PRESETS
        if any(re.search(r"MI3(00|25)X", n, re.IGNORECASE) for n in gpu_names):
            out += MI300_PRESETS
    return out


def apply(env: dict[str, str], wanted: Sequence[Preset]) -> tuple[dict[str, str], dict[str, str]]:
    """Set each preset in ``env`` unless the caller set it (or an alias); returns (exported, kept).

    A variable counts as set when it is in the environment at all, even empty; a kept value no process could
    read is refused (ValueError, one line) rather than passed on to crash every rank.
    """
    refuse_unreadable(env)
    exported: dict[str, str] = {}
    kept: dict[str, str] = {}
    for p in wanted:
        mine = [n for n in (p.name, *p.aliases) if n in env]
        if mine:
            for n in mine:
                kept[n] = env[n]
            continue
        env[p.name] = p.value
        exported[p.name] = p.value
    return exported, kept


def refuse_unreadable(env: Mapping[str, str]) -> None:
    """OMP_NUM_THREADS must be a whole number >= 1 when the caller sets it: accelerate launch reads it with int()
    (an empty value, i.e. an unset shell variable, or 'abc' ends in a ValueError traceback) and OpenMP ignores
    anything else with a warning in every process."""
    value = env.get("OMP_NUM_THREADS")
    if value is not None and not (value.strip().isdigit() and int(value) >= 1):
        raise ValueError(
            f"OMP_NUM_THREADS={value!r} is not a number of threads: unset it (the launcher then gives each process "
            "its share of the CPUs) or give a whole number >= 1, e.g. OMP_NUM_THREADS=4"
        )


def parse_rocm_version(hip_version: str | None) -> tuple[int, int] | None:
    """'6.4.43482-0f2d60242' (torch.version.hip) -> (6, 4)."""
    m = re.match(r"(\d+)\.(\d+)", hip_version or "")
    return (int(m[1]), int(m[2])) if m else None

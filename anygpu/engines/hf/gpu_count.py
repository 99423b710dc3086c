"""More processes on this node than visible GPUs: stop before loading anything, saying what to pass.

The shipped accelerate configs carry `num_processes: 8` (TRL's convention: the common node), so
`accelerate launch --config_file accelerate_configs/fsdp.yaml run_hf_standalone.py` works as typed
on an 8-GPU node. Elsewhere torchrun would start 8 processes on fewer GPUs; this check turns that
into one line naming the `--num_processes` this node can take, or the vendor launcher that counts.
"""

from __future__ import annotations

import os
from typing import Mapping

from anygpu.errors import UsageError
from anygpu.launch import detect as gpu_detect

LAUNCHER = {gpu_detect.NVIDIA: "run_nvidia_all.sh", gpu_detect.AMD: "run_amd_all.sh"}


def visible_gpus(env: Mapping[str, str]) -> tuple[int, str | None]:
    """(count, vendor) of the GPUs this job may use: torch's count on a GPU build of torch; with a
    CPU-only torch, what the smi tools list under the visibility variables (no GPU: (0, None))."""
    import torch

    if torch.cuda.is_available():
        return torch.cuda.device_count(), gpu_detect.AMD if getattr(torch.version, "hip", None) else gpu_detect.NVIDIA
    for vendor in gpu_detect.VENDORS:
        found = gpu_detect.probe(vendor, env=env)
        if found.gpus:
            return len(gpu_detect.visible_gpus(vendor, found.gpus, env, found.migs).gpus), vendor
    return 0, None


def check_processes_per_node(env: Mapping[str, str] | None = None, count: tuple[int, str | None] | None = None) -> None:
    """Raise UsageError when the launcher started more processes on this node than it has GPUs."""
    env = os.environ if env is None else env
    local = int(env.get("LOCAL_WORLD_SIZE", "1") or 1)
    if local <= 1:
        return
    num_gpus, vendor = visible_gpus(env) if count is None else count
    if num_gpus == 0 or local <= num_gpus:  # no GPU: CPU processes over gloo, any number
        return
    nodes = int(env.get("WORLD_SIZE", str(local))) // local
    total = f"{num_gpus * nodes} ({num_gpus} per node × {nodes} nodes)" if nodes > 1 else str(num_gpus)
    script = LAUNCHER.get(vendor or "", "run_nvidia_all.sh or run_amd_all.sh")
    raise UsageError(
        f"{local} processes on this node but only {num_gpus} visible GPU(s) (the accelerate configs carry "
        f"num_processes: 8, the common node): pass --num_processes {total} to accelerate launch, "
        f"or use the vendor launcher, which counts the GPUs for you (bash {script})."
    )

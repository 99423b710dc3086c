"""Rank side of benchmarks/memory_scaling.py: several trainings in one launch, each rank's peak memory above its
baseline per training (`accelerate launch … _peak_memory_runs.py LABEL ENGINE ARGS [::: LABEL ENGINE ARGS …]`,
ENGINE `fsdp` or `hf`; the native engine's runs first: the HF engine's ZeRO-3 registers its DeepSpeed config
with transformers for the rest of the process).

Peak memory on CPU is the process's peak resident set (VmHWM), reset before each training (`/proc/self/clear_refs`
5, after the allocator gave back what it could: `malloc_trim`); a training's figure is that peak minus the
resident set at the reset. glibc is told to give freed allocations of 1 MiB and more back to the system at once
(`mallopt(M_MMAP_THRESHOLD)`, as MALLOC_MMAP_THRESHOLD_=1048576 would): by default it keeps freed tensors below
32 MiB in per-thread heaps, so the resident set would measure the allocator's reuse, not the tensors held.
Each rank prints `PEAK <label> <rank> <bytes>` on one line of its own.
"""

import ctypes
import gc
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import anygpu  # noqa: E402

anygpu.set_offline_defaults()

from anygpu.config.args import parse_args  # noqa: E402
from anygpu.engines import fsdp as fsdp_engine  # noqa: E402
from anygpu.engines.hf import engine as hf_engine  # noqa: E402
from anygpu.engines.hf.engine import HFEngineArguments  # noqa: E402
from anygpu.reliability import run_guard  # noqa: E402
from anygpu.runtime import distributed  # noqa: E402

SEP = ":::"
M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter
LIBC = ctypes.CDLL("libc.so.6")


def status_kib(key: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {key}")


def reset_peak() -> int:
    """Resident bytes now, with the peak reset to them."""
    gc.collect()
    LIBC.malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return status_kib("VmRSS") * 1024


def groups(argv: list[str]) -> list[list[str]]:
    out, cur = [], []
    for a in argv:
        if a == SEP:
            out.append(cur)
            cur = []
        else:
            cur.append(a)
    return [*out, cur]


if __name__ == "__main__":
    LIBC.mallopt(M_MMAP_THRESHOLD, 1 << 20)
    info = distributed.init_distributed()  # one process group for all runs
    for label, engine, *args in groups(sys.argv[1:]):
        distributed.barrier()
        base = reset_peak()
        try:
            if engine == "fsdp":
                fsdp_engine.run(*parse_args(args))
            else:
                hf_engine.run(*parse_args(args, extra=(HFEngineArguments,)))
        finally:
            run_guard.release_locks()
        peak = status_kib("VmHWM") * 1024 - base
        os.write(1, f"PEAK {label} {info.rank} {peak}\n".encode())  # one write: the ranks' lines do not interleave
        distributed.barrier()
    distributed.destroy()

"""One process per GPU (gloo on CPU): all-reduces of a few sizes with the job's real backend.

    python -m torch.distributed.run --standalone --nproc-per-node N -m anygpu.tools.collective [sizes in bytes]

Rank 0 prints one JSON line: per size the time, algorithm bandwidth (bytes / time) and bus bandwidth
as nccl-tests defines it for all-reduce (algbw × 2(n−1)/n), and whether every result was right.
"""

from __future__ import annotations

import json
import sys
import time

import torch
import torch.distributed as dist

from anygpu.runtime import distributed

DEFAULT_SIZES_GPU = (1 << 20, 16 << 20, 256 << 20)
DEFAULT_SIZES_CPU = (64 << 10, 1 << 20, 8 << 20)


def measure(size_bytes: int, info: distributed.DistInfo, iters: int = 5) -> dict:
    n = max(1, size_bytes // 4)
    x = torch.full((n,), float(info.rank + 1), device=info.device)
    dist.all_reduce(x)  # warm-up (and NCCL's communicator set-up)
    expected = info.world_size * (info.world_size + 1) / 2
    correct = bool(torch.all(x == expected).item())
    sync = torch.cuda.synchronize if info.device.type == "cuda" else (lambda: None)
    sync()
    dist.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        dist.all_reduce(x)
    sync()
    seconds = (time.perf_counter() - start) / iters
    algbw = n * 4 / seconds
    busbw = algbw * 2 * (info.world_size - 1) / info.world_size
    return {
        "bytes": n * 4,
        "seconds": seconds,
        "algbw_gbps": algbw / 1e9,
        "busbw_gbps": busbw / 1e9,
        "correct": correct,
    }


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    info = distributed.init_distributed(timeout_s=120)
    sizes = [int(a) for a in argv] or (DEFAULT_SIZES_GPU if info.device.type == "cuda" else DEFAULT_SIZES_CPU)
    results = [measure(s, info) for s in sizes]
    if info.is_main:
        print(
            "COLLECTIVE "
            + json.dumps({"backend": dist.get_backend(), "world_size": info.world_size, "results": results}),
            flush=True,
        )
    distributed.destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())

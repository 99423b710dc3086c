"""Context parallelism's memory: a rank's peak memory above its baseline for one training micro-batch of one
sequence at block 4096 with activation checkpointing, for C = 1, 2, 4 ranks splitting it (CPU: peak RSS;
on a GPU: max_memory_allocated), printed as the ratio to C = 1 (target ≤ 0.6 at C = 2).

    .venv/bin/python benchmarks/cp_memory.py [--block_size 4096] [--cps 1,2,4]

Each C is one torchrun launch of C CPU ranks (gloo) running this file as a worker: a Llama-shaped model
(hidden 256, 4 layers, 8 heads, 4 KV heads), sdpa attention, FSDP2 over the C ranks, the sequence split
by `anygpu.runtime.context_parallel.split`; the baseline is taken after the model is built, sharded and
warmed up on a short sequence (so allocator pools of the first step do not count as activations).
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _peak_bytes(device) -> int:
    import torch

    if device.type == "cuda":
        return torch.cuda.max_memory_allocated()
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _current_bytes(device) -> int:
    import torch

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
        return torch.cuda.memory_allocated()
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def worker(block_size: int) -> None:
    import torch
    import torch.distributed as dist
    from transformers import LlamaConfig, LlamaForCausalLM

    from anygpu.runtime import context_parallel, parallel
    from anygpu.runtime.mesh import MeshShape

    dist.init_process_group("gloo" if not torch.cuda.is_available() else "nccl")
    cp = dist.get_world_size()
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if torch.cuda.is_available() else torch.device("cpu")
    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        vocab_size=8192,
        max_position_embeddings=block_size,
        attn_implementation="sdpa",
        use_cache=False,
    )
    model = LlamaForCausalLM(config).to(device)
    parallel.shard_model(model, device, MeshShape(1, 1, cp), False, True, False)
    group = context_parallel.new_group(cp)

    def step(length: int) -> None:
        ids = torch.randint(0, 8192, (1, length), generator=torch.Generator().manual_seed(1)).to(device)
        batch = {"input_ids": ids, "labels": ids.clone()}
        with context_parallel.split(model, batch, group) as inputs:
            out = model(**inputs, use_cache=False)
            out.loss.backward()
        model.zero_grad(set_to_none=True)

    step(64 * cp)  # warm-up: FSDP2's buffers, the all-to-all's and autograd's first allocations
    dist.barrier()
    base = _current_bytes(device)
    step(block_size)
    peak = _peak_bytes(device)
    delta = torch.tensor([float(peak - base)])
    dist.all_reduce(delta, op=dist.ReduceOp.MAX)
    if dist.get_rank() == 0:
        print(f"RESULT {cp} {delta.item():.0f}", flush=True)
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--block_size", type=int, default=4096, help="Tokens of the sequence (default 4096).")
    p.add_argument("--cps", default="1,2,4", help="Values of C to measure, comma-separated (default 1,2,4).")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args.block_size)
        return
    torchrun = str(Path(sys.executable).parent / "torchrun")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES", "")}
    figures = {}
    for cp in (int(c) for c in args.cps.split(",")):
        cmd = [torchrun, "--standalone", "--nproc-per-node", str(cp), __file__, "--worker"]
        out = subprocess.run(
            [*cmd, "--block_size", str(args.block_size)], cwd=ROOT, env=env, capture_output=True, text=True
        )
        line = next((ln for ln in out.stdout.splitlines() if ln.startswith("RESULT")), None)
        if line is None:
            sys.exit(f"C = {cp} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
        figures[cp] = float(line.split()[2])
    first = figures[min(figures)]
    for cp, value in figures.items():
        print(f"cp {cp}: peak above baseline {value / 2**20:.1f} MiB, ratio to cp {min(figures)} {value / first:.2f}")


if __name__ == "__main__":
    main()

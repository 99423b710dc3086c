"""A stand-in training script for the launcher's failure tests: gloo all-reduces every step,
and rank 1 raises at step 3 (``--fail-rank``/``--fail-step`` change that). The others are then
blocked in the next collective; the launcher must bring them down within seconds.
``--fail-attempts N`` fails only in the first N attempts (torchrun's TORCHELASTIC_RESTART_COUNT),
so a job with ``--max-restarts`` >= N then finishes."""

import argparse
import os
import time

import torch
import torch.distributed as dist

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=1000)
p.add_argument("--fail-rank", type=int, default=1)
p.add_argument("--fail-step", type=int, default=3)
p.add_argument("--fail-attempts", type=int, default=1 << 30)
args = p.parse_args()
attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))

dist.init_process_group("gloo")
rank = dist.get_rank()
for step in range(1, args.steps + 1):
    if rank == args.fail_rank and step == args.fail_step and attempt < args.fail_attempts:
        raise RuntimeError(f"rank {rank} fails at step {step} on purpose")
    t = torch.ones(1)
    dist.all_reduce(t)  # blocks until every rank joins: a dead rank leaves the others waiting here
    print(f"rank {rank} step {step} sum {int(t.item())} pid {os.getpid()}", flush=True)
    time.sleep(0.1)
print(f"rank {rank} finished {args.steps} steps in attempt {attempt}", flush=True)
dist.destroy_process_group()

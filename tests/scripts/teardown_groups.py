"""Join a 2-rank gloo group, train a DDP model a step, all-reduce Python tensors, end the group with
`distributed.destroy` and free the model, ITERATIONS times in one process, as a run's end does.

torch frees a gloo group in its destructor, which joins the group's worker threads. Where the last reference
is the DDP reducer's (freed with the GIL held) while a worker is still releasing its last work (whose tensors'
Python objects it must free under the GIL), the process deadlocks: rare in one run's end, frequent here."""

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.getcwd())
from anygpu.runtime import distributed  # noqa: E402

rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
folder = sys.argv[1]
for i in range(int(sys.argv[2])):
    dist.init_process_group("gloo", init_method=f"file://{folder}/store{i}", rank=rank, world_size=world)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(32, 32))
    model(torch.randn(4, 32)).sum().backward()
    for _ in range(3):  # as a run's last metrics: each tensor's Python object dropped while a work holds it
        distributed.any_rank(False, torch.device("cpu"))
    distributed.destroy()
    del model  # the reducer's reference goes last, as when a finished run's trainer is freed
# then as an engine's process ends: the launcher's group (env://, torchrun's store), ended, and the process exits
distributed.init_distributed(cpu_only=True)
distributed.any_rank(False, torch.device("cpu"))
distributed.destroy()
print(f"rank {rank}: {int(sys.argv[2]) + 1} groups ended", flush=True)

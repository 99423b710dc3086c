"""Under torchrun: build the FSDP2 model, take one optimizer step, print each rank's held bytes (BYTES: parameters
and optimizer state) and, for --cpu_offload, what it holds on the host against what the engine's check counts
(OFFLOAD: host bytes of parameters, gradients and optimizer state, the planned bytes, FSDP2's offload flags) and
each rank's optimizer state bytes (OPTIM)."""

import json
import sys

import anygpu

anygpu.set_offline_defaults()

import torch.distributed as dist  # noqa: E402

from anygpu.config.args import parse_args  # noqa: E402
from anygpu.data.prepare import prepare  # noqa: E402
from anygpu.engines import fsdp as fsdp_engine  # noqa: E402
from anygpu.runtime import distributed, parallel  # noqa: E402
from anygpu.train import optim  # noqa: E402

model_args, data_args, train_args = parse_args(sys.argv[1:])
info = distributed.init_distributed()
prep = prepare(model_args, data_args, train_args, info)
model = fsdp_engine.build_model(prep, model_args, train_args, info)
opt = optim.build_optimizer(model, train_args, info.device)
fsdp_engine.train_step(model, prep, 0, info)
opt.step()  # creates the (sharded) AdamW state
mine = parallel.local_bytes(model, opt)
every = [None] * info.world_size
dist.all_gather_object(every, mine)
if info.is_main:
    print("BYTES " + json.dumps(every))


def local_nbytes(t) -> int:
    t = t.to_local() if hasattr(t, "to_local") else t
    return t.numel() * t.element_size()


states = [v for s in opt.state.values() for v in s.values() if hasattr(v, "dim") and v.dim() > 0]
every = [None] * info.world_size
dist.all_gather_object(every, sum(local_nbytes(v) for v in states))  # the optimizer's own tensors, measured
if info.is_main:
    print("OPTIM " + json.dumps(every))
if train_args.cpu_offload:
    from torch.distributed.fsdp import FSDPModule

    def host(t) -> int:
        t = t.to_local() if hasattr(t, "to_local") else t
        return t.numel() * t.element_size() if t.device.type == "cpu" else 0

    groups = [m._get_fsdp_state()._fsdp_param_group for m in model.modules() if isinstance(m, FSDPModule)]
    report = {
        "host": sum(host(p) + host(p.grad) for p in model.parameters()) + sum(host(v) for v in states),
        "planned": parallel.state_bytes_per_rank(model, info.world_size, train_args.optim),
        "offloaded": [fp.offload_to_cpu for g in groups if g is not None for fp in g.fsdp_params],
    }
    every = [None] * info.world_size
    dist.all_gather_object(every, report)
    if info.is_main:
        print("OFFLOAD " + json.dumps(every))
distributed.destroy()

"""Under torchrun: one optimizer step of the FSDP2 engine's train_step with several accumulation steps; after every
micro-batch's backward, print the gradient bytes this rank holds: its sharded gradients plus whatever FSDP2 keeps
unsharded for a later reduction (read from its parameter groups).

    torchrun --nproc-per-node 2 accumulation_bytes.py [engine args]   one GRAD_BYTES line per rank: [after each backward]
"""

import json
import os
import sys

import anygpu

anygpu.set_offline_defaults()

import torch  # noqa: E402
from torch.distributed.fsdp import FSDPModule  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

from anygpu.config.args import parse_args  # noqa: E402
from anygpu.data.prepare import prepare  # noqa: E402
from anygpu.engines import fsdp as fsdp_engine  # noqa: E402
from anygpu.runtime import distributed  # noqa: E402


def nbytes(t: torch.Tensor | None) -> int:
    if t is None:
        return 0
    t = t.to_local() if isinstance(t, DTensor) else t
    return t.numel() * t.element_size()


def held_gradient_bytes(model: torch.nn.Module) -> int:
    """Sharded gradients (param.grad) and FSDP2's unsharded accumulations, which wait for a later reduce-scatter."""
    total = sum(nbytes(p.grad) for p in model.parameters())
    for module in model.modules():
        group = module._get_fsdp_state()._fsdp_param_group if isinstance(module, FSDPModule) else None
        # HSDP: the reduce-scattered gradients summed until the all-reduce across replica groups (a shard's size)
        total += nbytes(getattr(group, "_partial_reduce_output", None))
        for fsdp_param in group.fsdp_params if group is not None else ():
            total += nbytes(getattr(fsdp_param, "unsharded_accumulated_grad", None))
            unsharded = getattr(fsdp_param, "_unsharded_param", None)  # its .grad: kept for the reduction to come
            total += nbytes(unsharded.grad if unsharded is not None else None)
    return total


info = distributed.init_distributed()
model_args, data_args, train_args = parse_args(sys.argv[1:])
prep = prepare(model_args, data_args, train_args, info)
model = fsdp_engine.build_model(prep, model_args, train_args, info)
held: list[int] = []
backward = torch.Tensor.backward


def measured_backward(self, *args, **kwargs):
    backward(self, *args, **kwargs)
    held.append(held_gradient_bytes(model))


torch.Tensor.backward = measured_backward
fsdp_engine.train_step(model, prep, 0, info)
torch.Tensor.backward = backward
shard = sum(nbytes(p) for p in model.parameters() if p.requires_grad)
line = f"GRAD_BYTES {info.rank} " + json.dumps({"after_each_backward": held, "sharded_parameters": shard})
os.write(1, (line + "\n").encode())  # one write: the ranks' lines must not interleave
distributed.destroy()

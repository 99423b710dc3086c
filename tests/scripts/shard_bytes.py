"""Under torchrun: build the FSDP2 model, take one optimizer step, print each rank's held bytes."""

import json
import sys

import anygpu

anygpu.set_offline_defaults()

import torch.distributed as dist  # noqa: E402

from anygpu.config.args import parse_args  # noqa: E402
from anygpu.data.prepare import prepare  # noqa: E402
from anygpu.engines import fsdp as fsdp_engine  # noqa: E402
from anygpu.runtime import distributed, parallel
from anygpu.train import optim

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
distributed.destroy()

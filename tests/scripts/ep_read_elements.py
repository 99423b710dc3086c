"""Under torchrun: build the FSDP2 engine's model from a Hub folder for each set of arguments (sets apart by `:::`,
e.g. with --ep) and print, gathered on rank 0, how many elements of the checkpoint's expert tensors and of the
others each rank read (`READ [...]`, a line per set), by counting what the loader's deferred reads
(`hub_weights._reader`) return."""

import json
import sys

import anygpu

anygpu.set_offline_defaults()

import torch.distributed as dist  # noqa: E402

from anygpu.config.args import parse_args  # noqa: E402
from anygpu.data.prepare import prepare  # noqa: E402
from anygpu.engines import fsdp as fsdp_engine  # noqa: E402
from anygpu.model import hub_weights  # noqa: E402
from anygpu.runtime import distributed  # noqa: E402

counts = {"experts": 0, "other": 0}
reader = hub_weights._reader


def counting_reader(handle, key, params, shard, tensor_idx):
    read = reader(handle, key, params, shard, tensor_idx)

    def counted():
        value = read()
        if value is not None:
            counts["experts" if ".experts." in key else "other"] += value.numel()
        return value

    return counted


hub_weights._reader = counting_reader
info = distributed.init_distributed()
sets, argv = [[]], sys.argv[1:]
for arg in argv:
    sets.append([]) if arg == ":::" else sets[-1].append(arg)
for one in sets:
    counts.update(experts=0, other=0)
    model_args, data_args, train_args = parse_args(one)
    prep = prepare(model_args, data_args, train_args, info)
    fsdp_engine.build_model(prep, model_args, train_args, info)
    every = [None] * info.world_size
    dist.all_gather_object(every, dict(counts))
    if info.is_main:
        print("READ " + json.dumps(every), flush=True)

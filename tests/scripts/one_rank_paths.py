"""One process: train a few steps with the plain (unsharded) model and with FSDP2 forced on; print both losses."""

import json
import sys

import anygpu

anygpu.set_offline_defaults()


from anygpu.config.args import parse_args  # noqa: E402
from anygpu.data.prepare import prepare  # noqa: E402
from anygpu.engines import fsdp as fsdp_engine  # noqa: E402
from anygpu.runtime import distributed, parallel  # noqa: E402
from anygpu.train import optim

model_args, data_args, train_args = parse_args(sys.argv[1:])
info = distributed.init_distributed()
prep = prepare(model_args, data_args, train_args, info)


def train(force_fsdp: bool) -> list[float]:
    real = parallel.needs_sharding
    if force_fsdp:
        parallel.needs_sharding = lambda *args: True
    try:
        model = fsdp_engine.build_model(prep, model_args, train_args, info)
    finally:
        parallel.needs_sharding = real
    assert parallel.is_sharded(model) == force_fsdp
    opt = optim.build_optimizer(model, train_args, info.device)
    out = []
    for step in range(train_args.max_steps):
        out.append(float(fsdp_engine.train_step(model, prep, step, info)))
        fsdp_engine.clip_gradients(model, train_args.max_grad_norm)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return out


print("LOSSES " + json.dumps({"plain": train(False), "fsdp": train(True)}))
distributed.destroy()

"""Under torchrun: build the FSDP2 engine's model, run one step, print each rank's held bytes of
parameters, gradients and optimizer state, measured from the sharded tensors themselves.

    torchrun … state_bytes.py tiny,default [engine args]   one BYTES line per preset or config.json (one start-up for all),
                                                           labelled by its name (a file: its stem), '+bf16' under --bf16
    torchrun … state_bytes.py pretrained --model_name_or_path DIR [--use_peft true …]   the model of DIR
    torchrun … state_bytes.py GROUP ::: GROUP …   several of the above in one launch (also plain python: 1 rank)
A preset may carry a label, tiny:hsdp, to tell apart two groups of one preset in the BYTES lines."""

import json
import sys
from pathlib import Path

import anygpu

anygpu.set_offline_defaults()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

from anygpu.config.args import parse_args  # noqa: E402
from anygpu.data.prepare import prepare  # noqa: E402
from anygpu.engines import fsdp as fsdp_engine  # noqa: E402
from anygpu.runtime import distributed  # noqa: E402
from anygpu.train import optim
from argv_groups import split_args  # noqa: E402


def nbytes(t: torch.Tensor | None) -> int:
    if t is None:
        return 0
    t = t.to_local() if isinstance(t, DTensor) else t
    return t.numel() * t.element_size()


def held_gradient_bytes(model: torch.nn.Module) -> int:
    """Gradients held after a micro-batch's backward: the sharded ones and whatever FSDP2 keeps unsharded for a
    later reduction (an accumulation buffer)."""
    from torch.distributed.fsdp import FSDPModule

    total = sum(nbytes(p.grad) for p in model.parameters())
    for module in model.modules():
        group = module._get_fsdp_state()._fsdp_param_group if isinstance(module, FSDPModule) else None
        for fsdp_param in group.fsdp_params if group is not None else ():
            total += nbytes(getattr(fsdp_param, "unsharded_accumulated_grad", None))
            unsharded = getattr(fsdp_param, "_unsharded_param", None)
            total += nbytes(unsharded.grad if unsharded is not None else None)
    return total


info = distributed.init_distributed()
groups = split_args(sys.argv[1:])
for presets, *args in groups:
    for preset in presets.split(","):
        name = preset.split(":")[0]
        model_args, data_args, train_args = parse_args(
            [*(["--config_name", name] if name != "pretrained" else []), *args]
        )
        prep = prepare(model_args, data_args, train_args, info)
        model = fsdp_engine.build_model(prep, model_args, train_args, info)
        opt = optim.build_optimizer(model, train_args, info.device)
        held: list[int] = []
        backward = torch.Tensor.backward

        def measured_backward(self, *a, _model=model, **kw):
            backward(self, *a, **kw)
            held.append(held_gradient_bytes(_model))

        torch.Tensor.backward = measured_backward  # every micro-batch's backward (A of them)
        try:
            fsdp_engine.train_step(model, prep, 0, info)
        finally:
            torch.Tensor.backward = backward
        trainable = [p for p in model.parameters() if p.requires_grad]
        mine = {
            "parameters": sum(nbytes(p) for p in model.parameters()),
            "gradients": sum(nbytes(p.grad) for p in trainable if p.grad is not None),
            "gradients_held": max(held),  # the most after any micro-batch's backward
            "micro_batches": len(held),
        }
        opt.step()  # creates the (sharded) AdamW state; the 0-dim step counters are not state memory
        mine["optimizer"] = sum(
            nbytes(v) for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor) and v.dim() > 0
        )
        mine["vocab_size"] = prep.config.vocab_size
        every = [None] * info.world_size
        dist.all_gather_object(every, mine)
        label = (Path(preset).stem if preset.endswith(".json") else preset) + ("+bf16" if train_args.bf16 else "")
        if info.is_main:
            print(f"BYTES {label} " + json.dumps(every), flush=True)
        del model, opt
distributed.destroy()

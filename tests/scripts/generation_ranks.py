"""GRPO sampling on 2 gloo ranks under FSDP2 (tests/test_generation.py): a tiny Llama sharded per decoder layer
+ root, completions generated inside `gathered` with different prompt counts per rank (none on rank 1 in the
second round), every collective counted. Rank 0 prints `RESULT <json: one object per rank>`."""

import copy
import json
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from test_generation import SAMPLING, tiny_model  # noqa: E402

from anygpu.train.generation import gathered, generate, sample_keys  # noqa: E402

COLLECTIVES = ("all_gather_single", "all_gather_into_tensor", "all_gather", "all_reduce", "broadcast",
               "reduce_scatter_tensor", "all_to_all_single", "barrier")  # fmt: skip
counts = {name: 0 for name in COLLECTIVES}


def counting(name: str, fn):
    def wrapper(*args, **kwargs):
        counts[name] += 1
        return fn(*args, **kwargs)

    return wrapper


dist.init_process_group("gloo", timeout=timedelta(seconds=60))  # a rank left waiting fails within a minute
rank = dist.get_rank()
model = tiny_model()
plain = copy.deepcopy(model)
mesh = init_device_mesh("cpu", (2,))
for layer in model.model.layers:
    fully_shard(layer, mesh=mesh)
fully_shard(model, mesh=mesh)
units = sum(isinstance(m, FSDPModule) for m in model.modules())
for name in COLLECTIVES:  # FSDP2 calls them through the module (`dist.all_gather_single`): these wrappers count
    if hasattr(dist, name):
        setattr(dist, name, counting(name, getattr(dist, name)))

# Each rank its own prompts (global indices), lengths and counts; rank 1 has none in round 1.
ROUNDS = [
    {0: [[5, 6], [7, 8, 9, 10, 11], [12, 13, 14, 15, 16, 17, 18]], 1: [[40, 41, 42, 43]]},
    {0: [[30, 31, 32], [40]], 1: []},
]
forwards = [0]
model.register_forward_hook(lambda *_: forwards.__setitem__(0, forwards[0] + 1))
result = {"rank": rank, "units": units, "gathered_rounds": []}
model.train()
for r, prompts_of in enumerate(ROUNDS):
    prompts = prompts_of[rank]
    first = sum(len(prompts_of[k]) for k in range(rank))
    keys = sample_keys(0, r, range(first, first + len(prompts)), [0] * len(prompts), "cpu")
    counts.update(dict.fromkeys(counts, 0))
    forwards[0] = 0
    with gathered(model):
        out = generate(model, prompts, keys, SAMPLING)
    gathers = counts["all_gather_single"] + counts["all_gather_into_tensor"] + counts["all_gather"]
    result["gathered_rounds"].append(
        {
            "all_gathers": gathers,
            "other_collectives": sum(counts.values()) - gathers,
            "same_as_unsharded": out == generate(plain, prompts, keys, SAMPLING),
            "forwards": forwards[0],
        }
    )
assert model.training
result["sharded_after"] = all(isinstance(p, DTensor) for p in model.parameters())

# Outside `gathered` every forward all-gathers: HF's synced_gpus steps both ranks until both are done.
prompts = [[3, 4, 5]] if rank == 0 else [[6, 7], [8, 9, 10, 11]]
keys = sample_keys(0, 9, range(rank * 2, rank * 2 + len(prompts)), [1] * len(prompts), "cpu")
counts.update(dict.fromkeys(counts, 0))
out = generate(model, prompts, keys, SAMPLING)
result["synced"] = {
    "same_as_unsharded": out == generate(plain, prompts, keys, SAMPLING),
    "all_reduces": counts["all_reduce"],
}

# Each layer resharded after its forward as before `gathered` (the root keeps its own: FSDP's default), and
# training runs as on the unsharded copy.
batch = torch.tensor([[5, 6, 7, 8, 9, 10], [11, 12, 13, 14, 15, 16]])
loss = model(input_ids=batch, labels=batch).loss
result["layers_reshard_after_forward"] = all(isinstance(p, DTensor) for p in model.model.layers.parameters())
result["root_keeps_after_forward"] = not isinstance(model.model.embed_tokens.weight, DTensor)
loss.backward()
plain_loss = plain(input_ids=batch, labels=batch).loss
result["loss_matches"] = abs(loss.item() - plain_loss.item()) < 1e-5
result["grads_sharded"] = all(isinstance(p.grad, DTensor) for p in model.parameters())

gathered_results = [None, None]
dist.all_gather_object(gathered_results, result)
if rank == 0:
    print("RESULT " + json.dumps(gathered_results), flush=True)
dist.destroy_process_group()

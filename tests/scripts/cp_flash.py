"""A varlen path under context parallelism, on CPU (torchrun, 2 ranks, gloo): the stand-in kernel of
test_flash_attention.py as "flash_attention_2", or the attention named by the first argument (varlen_attention:
torch's varlen kernel, on a CPU its blockwise sdpa), three packed rows (6 samples) in one micro-batch. Prints, on
rank 0, `LOSSES <one process, flattened rows> <cp 2> <cp 2, its gradient norm> <one process, its gradient norm>`."""

import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from test_flash_attention import flash_stand_in, packed_rows  # noqa: E402
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS  # noqa: E402

from anygpu.config.args import ModelArguments  # noqa: E402
from anygpu.data.collate import Collator, count_targets  # noqa: E402
from anygpu.model import modeling  # noqa: E402
from anygpu.runtime import context_parallel  # noqa: E402

ALL_ATTENTION_FUNCTIONS["flash_attention_2"] = flash_stand_in
dist.init_process_group("gloo")
args = ModelArguments(config_name="tiny")
model = modeling.build_full_model(modeling.resolve_config(args), args, seed=0)
modeling.flatten_packed_rows(model)
model.config._attn_implementation = sys.argv[1] if len(sys.argv) > 1 else "flash_attention_2"
batch = Collator(0, packed=True, varlen=True).collate(packed_rows())
n = torch.tensor(count_targets(batch))


def loss_and_norm(split: context_parallel.CPGroup) -> tuple[float, float]:
    model.zero_grad(set_to_none=True)
    with context_parallel.split(model, batch, split) as inputs:
        loss = model(**inputs, use_cache=False, num_items_in_batch=n).loss
        loss.backward()
    grads = torch.cat([p.grad.flatten() for p in model.parameters()])
    total = torch.stack([loss.detach(), torch.zeros(())])
    if split.size > 1:  # each rank's part of the loss; each parameter's gradient summed over the group
        dist.all_reduce(total)
        dist.all_reduce(grads)
    return total[0].item(), grads.norm().item()


whole = loss_and_norm(context_parallel.NONE)
split = loss_and_norm(context_parallel.new_group(2))
if dist.get_rank() == 0:
    print("LOSSES", whole[0], split[0], split[1], whole[1], flush=True)
dist.destroy_process_group()

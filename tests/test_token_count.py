"""The global target-token count reaches the model's loss exactly, whatever the precision.

FSDP2's mixed-precision policy casts the floating-point tensors among a module's forward inputs to its
compute dtype: a float count of 257 targets would reach the loss as bf16's 256 (65432 as 65536), scaling
every bf16 step's loss and gradient by up to 0.4%."""

from __future__ import annotations

import sys

import pytest
from conftest import ROOT, run

# One bf16 FSDP2 step of the native engine's `train_step` on a real 1-rank gloo group, on a micro-batch
# with 257 targets (not a bf16 number); the model's loss function records the count it is given.
BF16_STEP = r"""
import types, torch, torch.distributed as dist
from transformers.loss.loss_utils import ForCausalLMLoss
from anygpu.config.args import ModelArguments
from anygpu.data.collate import Collator
from anygpu.data.loader import StepCollate
from anygpu.engines import fsdp
from anygpu.model import modeling
from anygpu.runtime import parallel
from anygpu.runtime.distributed import DistInfo
from anygpu.runtime.mesh import MeshShape

dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
args = ModelArguments(config_name="tiny")
config = modeling.resolve_config(args)
model = modeling.build_meta_model(config, args)
buffers = {n: b.clone() for n, b in model.named_buffers()}
parallel.shard_model(model, torch.device("cpu"), MeshShape(1, 1), True, False, False)
assert parallel.is_sharded(model)
model.to_empty(device="cpu")
modeling.restore_buffers(model, buffers)
modeling.init_parameters(model, config, 0)
seen = []
def loss_function(logits, labels, vocab_size, num_items_in_batch=None, **kwargs):
    seen.append(num_items_in_batch)
    return ForCausalLMLoss(logits, labels, vocab_size, num_items_in_batch, **kwargs)
model.loss_function = loss_function
ids = [[(7 * i) % 8000 + 3 for i in range(258)]]
cpu = StepCollate(Collator(0))((0, [[0]], [{"input_ids": ids}]))
prep = types.SimpleNamespace(plan=types.SimpleNamespace(global_batch_size=1))
fsdp.train_step(model, prep, 0, DistInfo(0, 0, 1, torch.device("cpu")), cpu)
(count,) = seen
print(repr(count.dtype), float(count))
dist.destroy_process_group()
"""


@pytest.mark.slow  # a process of its own
def test_bf16_fsdp2_loss_gets_the_exact_target_count():
    p = run(
        [sys.executable, "-c", BF16_STEP], timeout=120, extra_env={"PYTHONPATH": str(ROOT)}
    )  # exit 0, or its output
    dtype, count = p.stdout.split()
    assert count == "257.0", f"the loss was normalised by {count} ({dtype}) targets, not 257"
    assert dtype not in ("torch.bfloat16", "torch.float16")

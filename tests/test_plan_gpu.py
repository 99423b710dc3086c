"""`anygpu plan` against a GPU's allocator: the planned peak of one training step of the ~1B preset
(one GPU, bf16 autocast, AdamW) within 15% of `torch.cuda.max_memory_allocated`, at two block sizes,
with and without activation checkpointing. Skipped without a GPU (CI runs on CPU)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA or ROCm GPU")]


@pytest.mark.parametrize("block_size", [1024, 2048])
@pytest.mark.parametrize("checkpointing", [False, True])
def test_planned_peak_matches_the_allocator(block_size, checkpointing):
    from transformers import AutoModelForCausalLM

    from anygpu.config.args import ModelArguments
    from anygpu.model.modeling import resolve_config
    from anygpu.planning import memory_plan
    from anygpu.tools.plan import load_shapes

    shapes, _, _ = load_shapes(None, "llama-1b")
    machine = memory_plan.Machine(1, torch.cuda.get_device_properties(0).total_memory)
    row = memory_plan.row_for(shapes, machine, "ddp", "bf16", checkpointing, False, 1, block_size)
    planned = row.total - row.per_gpu_bytes["reserved"]

    config = resolve_config(ModelArguments(config_name="llama-1b"))
    config.use_cache = False
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).cuda()
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    ids = torch.randint(0, config.vocab_size, (1, block_size), device="cuda")
    torch.cuda.reset_peak_memory_stats()
    for _ in range(2):  # the second step has the optimizer state from the first
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    measured = torch.cuda.max_memory_allocated()
    print(
        f"block {block_size}, checkpointing {checkpointing}: planned {planned / 2**30:.2f} GiB, "
        f"measured {measured / 2**30:.2f} GiB"
    )
    assert abs(planned - measured) <= 0.15 * measured

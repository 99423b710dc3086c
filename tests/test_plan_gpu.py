"""`anygpu plan` against a GPU's allocator: the planned peak of a training step of the ~1B preset
(one GPU, bf16 autocast, AdamW, the model's own loss) within 15% of `torch.cuda.max_memory_allocated`, at two block
sizes, with and without activation checkpointing. Skipped without a GPU (CI runs on CPU).

The plan adds gradients to the forward's activations: so they are from the second micro-batch of an accumulated
step on. A step of one micro-batch frees its gradients before the next forward (zero_grad(set_to_none=True)), so
its peak is lower and the plan is an upper bound there. Measured on CPU with MemTracker under FakeTensorMode
(2026-11-27): 24.3 / 22.1 / 28.0 / 23.5 GiB for two micro-batches (planned 23.5 / 22.1 / 26.3 / 23.5), 20.4 GiB
for one at block 1024. The lease of 2026-11-27 ran the old test (one micro-batch against the plan of the lean loss:
on CPU 20.4 GiB against 25.0 planned, 22% over) and it failed all four; its log was cut off before the figures."""

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
    row = memory_plan.row_for(shapes, machine, "ddp", "bf16", checkpointing, False, 1, block_size, lean_loss=False)
    planned = row.total - row.per_gpu_bytes["reserved"]

    config = resolve_config(ModelArguments(config_name="llama-1b"))
    config.use_cache = False
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).cuda()
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    ids = torch.randint(0, config.vocab_size, (1, block_size), device="cuda")

    def peak(micro_batches: int) -> int:
        """The allocator's peak over a step of `micro_batches` after one that made the optimizer state."""
        for step in range(2):
            if step:
                torch.cuda.reset_peak_memory_stats()
            for _ in range(micro_batches):
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    loss = model(input_ids=ids, labels=ids).loss
                loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return torch.cuda.max_memory_allocated()

    accumulated, single = peak(2), peak(1)
    print(
        f"block {block_size}, checkpointing {checkpointing}: planned {planned / 2**30:.2f} GiB, measured "
        f"{accumulated / 2**30:.2f} GiB (two micro-batches), {single / 2**30:.2f} GiB (one)"
    )
    assert abs(planned - accumulated) <= 0.15 * accumulated
    assert single <= planned

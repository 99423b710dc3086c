"""--attn_implementation flex_attention over packed rows (transformers' document BlockMask from the restarting
position ids) computes sdpa's loss (sdpa: a dense T × T mask).

torch 2.13 has no FlexAttention backward on a CPU (`torch.nn.attention.flex_attention._validate_device` raises), so
training with flex here is refused in one line, and the CPU proves the forward only: the training runs (packed SFT and
DPO rows, checkpointing, compile, --cp 2) against sdpa are for a GPU."""

from __future__ import annotations

import pytest


@pytest.mark.slow
def test_flex_computes_sdpas_loss_over_packed_rows():
    """Rows of 1 to 4 samples: the same loss to float rounding (measured: equal, rel 0.0, fp32), flex compiled by
    transformers (inductor's C++ kernel, ~7 s)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from anygpu.model import mask_hint

    torch.manual_seed(0)
    config = AutoConfig.for_model("llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, vocab_size=400)  # fmt: skip
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    mask_hint.install(model, packed=True)
    ids = torch.randint(0, 400, (4, 64))
    samples = [[20, 30, 14], [64], [10, 10, 10, 34], [40, 24]]
    positions = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in samples])
    labels = ids.masked_fill(positions == 0, -100)  # as the collator: no sample's first token is a target
    loss = {}
    for kernel in ("sdpa", "flex_attention"):
        model.set_attn_implementation(kernel)
        with torch.no_grad():
            loss[kernel] = model(input_ids=ids, position_ids=positions, labels=labels).loss.item()
    assert loss["flex_attention"] == pytest.approx(loss["sdpa"], rel=1e-6)


def test_flex_training_on_a_cpu_is_refused_in_one_line(tmp_path):
    """Before any work: the engine's own refusal (exit 2, one line), not a traceback at the first backward."""
    from conftest import TINY, python

    from anygpu.config import attention
    from anygpu.errors import UsageError

    attention.check_device("flex_attention", on_gpu=True)
    attention.check_device("sdpa", on_gpu=False)
    with pytest.raises(UsageError, match="^--attn_implementation flex_attention: torch has no FlexAttention backward"):
        attention.check_device("flex_attention", on_gpu=False)
    args = [*TINY, "--max_steps", "1", "--attn_implementation", "flex_attention", "--output_dir", str(tmp_path)]
    proc = python("run_fsdp_standalone.py", args, check=False)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "error: --attn_implementation flex_attention: torch has no FlexAttention backward on a cpu" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_cp_that_gathers_the_keys_refuses_flex_in_one_line():
    from transformers import AutoConfig

    from anygpu.errors import UsageError
    from anygpu.runtime import context_parallel

    gqa = AutoConfig.for_model("llama", num_attention_heads=4, num_key_value_heads=2)
    context_parallel.check(gqa, 64, 2, "flex_attention")  # Ulysses: each rank its heads, the full rows' block mask
    with pytest.raises(UsageError, match=r"^--cp 4 does not divide .* --attn_implementation flex_attention cannot"):
        context_parallel.check(gqa, 64, 4, "flex_attention")

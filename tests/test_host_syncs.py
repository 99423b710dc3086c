"""No host sync in a training step that does not log: the host queues a step's work and runs ahead, so the GPU
never waits for Python between kernels. Counted on CPU with the ops that would make a GPU's host wait
(`anygpu.runtime.host_syncs`); on a GPU, CUDA's own sync debug mode counts the same (`tests/test_fsdp_gpu.py`)."""

from __future__ import annotations

import json
import random
import re
import warnings

import pytest
import torch
from conftest import TINY, python

from anygpu.runtime import host_syncs

CPU = torch.device("cpu")


def test_the_counter_sees_what_would_wait_for_a_gpu_and_nothing_else():
    x = torch.arange(6.0)
    with host_syncs.count(CPU) as none:
        y = (x * 2 + 1)[torch.tensor([0, 2])]  # arithmetic and integer indexing queue work only
        y.sum()
    with host_syncs.count(CPU) as some:
        x.sum().item()  # a value read back
        bool(x.max() > 3)  # a branch on a tensor
        x.nonzero()  # an output sized by the data
        x[x > 2]  # boolean-mask indexing
    assert none.count == 0, none.where
    assert some.count == 4, some.where
    assert "test_host_syncs.py" in some.summary()


def test_cuda_sync_warnings_count_each_at_its_caller(monkeypatch):
    """CUDA's sync debug mode speaks through warnings: other warnings (torch's own notice about the mode too) are
    not syncs, and each sync is put at the nearest frame outside torch, not at the torch call it returned from."""
    modes = []
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", modes.append)  # no CUDA here: the mode switch alone
    with host_syncs.count(torch.device("cuda")) as seen:
        warnings.warn(host_syncs.CUDA_SYNC_TEXT)
        # torch's notice when the mode is switched on (once per process): the H100 lease counted it as a sync
        warnings.warn(
            "Synchronization debug mode is a prototype feature and does not yet detect all synchronizing operations"
        )
        warnings.warn(host_syncs.CUDA_SYNC_TEXT)
    assert modes == ["warn", "default"]
    assert seen.count == 2, seen.where
    assert (
        all(
            w.startswith("test_host_syncs.py:") and w.endswith(" test_cuda_sync_warnings_count_each_at_its_caller")
            for w in seen.where
        )
        and len(seen.where) == 2
    ), seen.where


WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()
MOE = {
    "model_type": "qwen2_moe",
    "hidden_size": 32,
    "intermediate_size": 64,
    "moe_intermediate_size": 16,
    "shared_expert_intermediate_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "output_router_logits": True,
    "router_aux_loss_coef": 0.1,
    "max_position_embeddings": 128,
    "vocab_size": 400,
}
GPT2 = {"model_type": "gpt2", "n_layer": 2, "n_embd": 32, "n_head": 4, "n_positions": 128, "vocab_size": 400}


@pytest.mark.slow
def test_a_step_that_does_not_log_has_no_host_sync(tmp_path):
    """Raw-text blocks (fp32, FP8), packed chat under bf16 FSDP2 with selective checkpointing, padded
    chat (one sample per row, padded to the micro-batch's longest), GPT-2
    with keyed dropout 0.1 (whose own forward checks the ids for padding), and Qwen2-MoE with its router loss:
    every step of 4 micro-batches, with its log and its step-boundary agreement, has none."""
    rng = random.Random(0)
    chat = tmp_path / "chat.jsonl"
    say = lambda a, b: " ".join(rng.choice(WORDS) for _ in range(rng.randint(a, b)))  # noqa: E731
    chat.write_text(
        "".join(
            json.dumps(
                {"messages": [{"role": "user", "content": say(1, 20)}, {"role": "assistant", "content": say(1, 30)}]}
            )
            + "\n"
            for _ in range(120)
        )
    )
    for name, config in (("moe", MOE), ("gpt2", {**GPT2, "resid_pdrop": 0.1, "embd_pdrop": 0.1, "attn_pdrop": 0.1})):
        (tmp_path / f"{name}.json").write_text(json.dumps(config))
    common = ["--max_steps", "3", "--per_device_train_batch_size", "2", "--save_strategy", "no"]
    chat_args = [*TINY, *common, "--train_file", str(chat), "--vocab_size", "400", "--block_size", "128"]
    runs = [
        [*TINY, *common, "--fp8", "tensorwise"],
        [*chat_args, "--bf16", "true", "--gradient_checkpointing_policy", "selective"],
        [*chat_args, "--packing", "false"],  # one sample per row, padded: micro-batches with and without padding
        [*chat_args, "--config_name", str(tmp_path / "gpt2.json")],
        [*chat_args, "--config_name", str(tmp_path / "moe.json")],
    ]
    argv = []
    for i, args in enumerate(runs):
        argv += [":::"] * (i > 0) + [*args, "--output_dir", str(tmp_path / f"run{i}")]
    out = python("tests/scripts/step_syncs.py", argv, timeout=600).stdout
    counts = {int(m[1]): json.loads(m[2]) for m in re.finditer(r"^SYNCS (\d+) (.*)$", out, flags=re.MULTILINE)}
    assert sorted(counts) == list(range(len(runs))), out[-3000:]
    for i, steps in counts.items():
        assert [s["step"] for s in steps] == [1, 2, 3]
        assert all(s["count"] == 0 for s in steps), (runs[i], steps)

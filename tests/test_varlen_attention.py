"""--attn_implementation varlen_attention: packed samples through torch's varlen kernel (flash attention inside
torch; on a CPU the same attention as sdpa over each sample's block). The CPU proves the plumbing — the collator's
offsets, the flattened rows, padded rows, the position-id path context parallelism takes — gives sdpa's losses and
gradients on unlike families; the kernel itself is compared with sdpa on a GPU (tests/test_fsdp_gpu.py) and timed by
the lease's "SFT rows, packed, varlen attention" row."""

from __future__ import annotations


import types

import pytest
import torch
from test_flash_attention import packed_rows

from anygpu.model import varlen_attention
from anygpu.runtime import hardware

FAMILIES = {  # unlike attention layouts: GQA, MHA with q/k/v biases and tied embeddings, a sliding window, sliding
    # and full layers with a head_dim of their own and q/k norms
    "llama": dict(num_attention_heads=4, num_key_value_heads=2),
    "qwen2": dict(num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=True),
    "mistral": dict(num_attention_heads=4, num_key_value_heads=1, sliding_window=5),
    "gemma3_text": dict(
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        sliding_window=6,
        layer_types=["sliding_attention", "full_attention"],
    ),
}


def tiny(model_type: str):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model(model_type, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  vocab_size=300, **FAMILIES[model_type])  # fmt: skip
    varlen_attention.register()
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float64)


def loss_and_grads(model, batch: dict, attention: str) -> tuple[float, torch.Tensor]:
    model.set_attn_implementation(attention)
    model.zero_grad(set_to_none=True)
    loss = model(**batch, use_cache=False).loss
    loss.backward()
    return loss.item(), torch.cat([p.grad.flatten() for p in model.parameters()])


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_packed_rows_give_sdpas_loss_and_gradients(model_type):
    """Three packed rows (6 samples, a padding sample) as both engines feed them: the collator's offsets and the
    rows flattened into one (`flatten_packed_rows`), against sdpa's dense mask over the same rows."""
    from anygpu.data.collate import Collator
    from anygpu.model import modeling

    model = tiny(model_type)
    modeling.flatten_packed_rows(model)
    batch = Collator(0, packed=True, varlen=True).collate(packed_rows())
    assert "cu_seq_lens_q" in batch and batch["input_ids"].shape[0] == 3
    plain = {k: v for k, v in batch.items() if k in ("input_ids", "labels", "position_ids")}
    want, want_grads = loss_and_grads(model, plain, "sdpa")
    got, grads = loss_and_grads(model, batch, varlen_attention.NAME)
    assert got == pytest.approx(want, rel=1e-10)
    assert torch.allclose(grads, want_grads, rtol=1e-6, atol=1e-9)
    # context parallelism's path: the rows' positions only, the offsets found from them (once, reused per layer)
    got_from_positions, _ = loss_and_grads(model, plain, varlen_attention.NAME)
    assert got_from_positions == pytest.approx(want, rel=1e-10)


def test_padded_and_unpacked_rows_take_sdpas_own_path(monkeypatch):
    """Rows with a padding mask (--packing false) and rows of one sample each: sdpa's kernels, as under sdpa."""
    model = tiny("llama")
    ids = torch.randint(0, 300, (2, 10))
    mask = torch.ones(2, 10, dtype=torch.long)
    mask[1, 7:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    for batch in ({"input_ids": ids, "attention_mask": mask, "labels": labels}, {"input_ids": ids, "labels": ids}):
        want, want_grads = loss_and_grads(model, batch, "sdpa")
        monkeypatch.setattr(varlen_attention, "_blockwise", lambda *a: pytest.fail("no samples to confine"))
        got, grads = loss_and_grads(model, batch, varlen_attention.NAME)
        monkeypatch.undo()
        assert got == pytest.approx(want, rel=1e-12) and torch.allclose(grads, want_grads, rtol=1e-10)


def test_the_samples_offsets_from_positions():
    pos = torch.tensor([[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 0, 1]])
    offsets, longest = varlen_attention.segments(pos)
    assert offsets.tolist() == [0, 3, 5, 6, 10, 12] and longest == 4
    assert varlen_attention.segments(torch.arange(6).expand(2, 6)) is None  # one sample a row: the causal path


def test_the_engines_feed_varlen_the_collators_offsets_and_pack():
    """Packing is on and the collator computes the offsets on the CPU (no host sync in any layer), as for flash."""
    from anygpu.config.args import ModelArguments
    from anygpu.data import prepare
    from anygpu.data.collate import packing_supported

    assert packing_supported("llama", varlen_attention.NAME)
    assert prepare.takes_offsets(ModelArguments(attn_implementation=varlen_attention.NAME))
    assert not prepare.takes_offsets(ModelArguments(attn_implementation="sdpa"))


def test_a_gpu_in_fp32_is_refused_before_any_work():
    from anygpu.config import attention
    from anygpu.errors import UsageError

    attention.check_device(varlen_attention.NAME, on_gpu=True, half=True)
    attention.check_device(varlen_attention.NAME, on_gpu=False, half=False)  # the CPU's blockwise sdpa
    with pytest.raises(UsageError, match="^--attn_implementation varlen_attention on a GPU needs --bf16"):
        attention.check_device(varlen_attention.NAME, on_gpu=True, half=False)


def test_an_unknown_kernel_names_varlen_among_the_choices():
    from anygpu.config.args import ModelArguments
    from anygpu.errors import UsageError

    with pytest.raises(UsageError, match="varlen_attention"):
        ModelArguments(attn_implementation="varlen")


@pytest.mark.slow
def test_varlen_under_context_parallelism():
    """--cp 2 (Ulysses): each rank's heads over the whole rows, the offsets from their positions: the loss and
    gradient norm of one process."""
    from conftest import torchrun

    proc = torchrun(2, "tests/scripts/cp_flash.py", [varlen_attention.NAME])
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("LOSSES"))
    whole, split, split_norm, whole_norm = map(float, line.split()[1:])
    assert split == pytest.approx(whole, rel=1e-6) and split_norm == pytest.approx(whole_norm, rel=1e-5), line


@pytest.mark.slow
def test_the_engines_train_packed_rows_with_sdpas_losses(tmp_path):
    """Packed prompt-completion rows on 2 ranks (gloo), the native engine: sdpa; varlen with full activation
    checkpointing; varlen with selective checkpointing; varlen compiled — the same losses (the offsets survive the
    recomputation and dynamo).
    And the HF engine (accelerate, DDP) under varlen: sdpa's losses too."""
    from conftest import TINY, assert_close, fsdp_runs, hf_runs, losses, prompt_completion_file

    data = prompt_completion_file(tmp_path / "pc.jsonl", count=200, longest=13)
    corpus = TINY.index("--max_corpus_mb")
    job = [*TINY[:corpus], *TINY[corpus + 2 :], "--train_file", str(data), "--packing", "true", "--max_steps", "4",
           "--export_final", "false", "--save_steps", "0", "--max_eval_samples", "8"]  # fmt: skip
    varlen = ["--attn_implementation", varlen_attention.NAME]
    runs = {
        "sdpa": job,
        "full": [*job, *varlen, "--gradient_checkpointing", "true"],
        "selective": [*job, *varlen, "--gradient_checkpointing_policy", "selective"],
        "compiled": [*job, *varlen, "--torch_compile", "true"],  # dynamo over the offsets: no graph break
    }
    outputs = fsdp_runs(2, [[*args, "--output_dir", str(tmp_path / name)] for name, args in runs.items()])
    assert "attention sdpa" in outputs[0] and "attention varlen_attention" in outputs[1]  # a CPU keeps sdpa
    hf_runs(2, [[*job, *varlen, "--output_dir", str(tmp_path / "hf")]])
    want = losses(tmp_path / "sdpa")
    assert len(want) == 4
    assert "0 graph breaks" in outputs[3], outputs[3][-2000:]
    for name in ("full", "selective", "compiled", "hf"):
        assert_close(want, losses(tmp_path / name), rel=1e-5)


def test_sdpa_named_for_packed_rows_on_an_nvidia_gpu_is_told_of_varlen(caplog, monkeypatch):
    import logging

    from transformers import AutoConfig

    from anygpu.data import prepare
    from anygpu.runtime.distributed import DistInfo

    config = AutoConfig.for_model("llama", num_attention_heads=4, num_key_value_heads=2)
    monkeypatch.setattr(hardware, "vendor", lambda: "nvidia")
    with caplog.at_level(logging.WARNING, logger="anygpu.data.prepare"):
        prepare.packed_rows_kernel(
            *_defaults(attn_implementation="sdpa"), config, DistInfo(0, 0, 1, torch.device("cpu"))
        )
        prepare.packed_rows_kernel(
            *_defaults(), config, DistInfo(0, 0, 1, torch.device("cuda", 0))
        )  # chosen: no advice
        assert not caplog.records
        prepare.packed_rows_kernel(
            *_defaults(attn_implementation="sdpa"), config, DistInfo(0, 0, 1, torch.device("cuda", 0))
        )
    assert "--attn_implementation varlen_attention takes the samples' boundaries" in caplog.text


def _defaults(**kw):
    from anygpu.config.args import ModelArguments

    train = types.SimpleNamespace(bf16=True, fp16=False, cp=1, torch_compile=False)
    for key in ("bf16", "fp16", "cp", "torch_compile"):
        if key in kw:
            setattr(train, key, kw.pop(key))
    return ModelArguments(**kw), train


def test_packed_rows_on_an_nvidia_gpu_take_varlen_unless_a_kernel_is_named(monkeypatch):
    """--attn_implementation left out: sdpa, and varlen for packed rows on an NVIDIA GPU in 16-bit where the
    family calls transformers' attention interface; a kernel named is kept (sdpa: with a word of advice)."""
    from transformers import AutoConfig

    from anygpu.data import prepare
    from anygpu.runtime.distributed import DistInfo

    config = AutoConfig.for_model("llama", num_attention_heads=4, num_key_value_heads=2)
    gpu = DistInfo(0, 0, 1, torch.device("cuda", 0))
    monkeypatch.setattr(hardware, "vendor", lambda: "nvidia")  # this CPU stands for an NVIDIA GPU's process
    args, train = _defaults()
    assert args.attn_implementation == "sdpa" and not args.attention_chosen
    prepare.packed_rows_kernel(args, train, config, gpu)
    assert args.attn_implementation == varlen_attention.NAME
    # named; fp32; CP gathering the keys; compiled (not yet run on a GPU)
    for kw in ({"attn_implementation": "sdpa"}, {"bf16": False}, {"cp": 3}, {"torch_compile": True}):
        args, train = _defaults(**kw)
        prepare.packed_rows_kernel(args, train, config, gpu)
        assert args.attn_implementation == "sdpa", kw
    args, train = _defaults()
    prepare.packed_rows_kernel(args, train, config, DistInfo(0, 0, 1, torch.device("cpu")))
    assert args.attn_implementation == "sdpa"  # a CPU: no varlen kernel
    softcapped = AutoConfig.for_model("gemma2")
    args, train = _defaults()
    prepare.packed_rows_kernel(args, train, softcapped, gpu)
    assert args.attn_implementation == "sdpa"  # the kernel has no score softcapping


def test_varlen_packs_only_families_that_call_the_attention_interface():
    from anygpu.data.collate import packing_supported, uses_attention_interface

    assert uses_attention_interface("llama") and uses_attention_interface("qwen3_moe")
    assert not uses_attention_interface("mamba")  # no attention layer: its own forward would ignore the offsets
    assert not packing_supported("mamba", varlen_attention.NAME)


@pytest.mark.slow
def test_packed_dpo_pairs_under_varlen_give_sdpas_curve(tmp_path):
    """Packed preference pairs (conversational rows, a pretrained Llama, its reference's log-probs computed) on 2
    ranks: sdpa; varlen; varlen with --cp 2 and a frozen reference copy split like the policy: the same losses,
    gradient norms and TRL's metrics within 1e-5."""
    from conftest import fsdp_runs, records
    from dpo_data import build_models, write_kinds
    from test_dpo import assert_same, job

    base, ref = build_models(tmp_path)
    files = write_kinds(tmp_path, train=24, validation=8)
    varlen = ("--attn_implementation", varlen_attention.NAME)
    runs = {
        "sdpa": ("--per_device_train_batch_size", "3"),
        "varlen": (*varlen, "--per_device_train_batch_size", "3"),
        "cp": (*varlen, "--cp", "2", "--precompute_ref_log_probs", "false"),
    }
    fsdp_runs(2, [job(base, ref, files, tmp_path / name, *extra) for name, extra in runs.items()])
    want = records(tmp_path / "sdpa")
    assert len([r for r in want if "loss" in r]) == 3
    for name in ("varlen", "cp"):
        assert_same(records(tmp_path / name), want, name)


@pytest.mark.parametrize("model_type", ["gemma2", "gpt_oss"])
def test_a_family_the_kernel_cannot_compute_is_refused_before_any_work(model_type, tmp_path):
    """Gemma 2 softcaps its scores, gpt-oss adds attention sinks: named, varlen is refused in one line."""
    import json

    from anygpu.config.args import ModelArguments
    from anygpu.errors import UsageError
    from anygpu.model import modeling

    (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type}))
    args = ModelArguments(config_name=str(tmp_path), attn_implementation=varlen_attention.NAME)
    with pytest.raises(UsageError, match=f"^--attn_implementation varlen_attention: {model_type} "):
        modeling.resolve_config(args)


def test_dataparallel_batches_carry_no_offsets():
    """DataParallel cuts each tensor of a batch by its first dimension, the offsets too: under it the collator adds
    none, and each replica's attention finds its own from its rows' positions (as the position-id path above)."""
    from anygpu.data.collate import Collator
    from anygpu.engines.hf.run import without_offsets_under_dataparallel

    from anygpu.data.prepare import Prepared

    made = Prepared(None, None, {}, 64, None, None, 1, True, False, Collator(0, packed=True, varlen=True))
    ddp, dp = types.SimpleNamespace(kind="ddp"), types.SimpleNamespace(kind="dataparallel")
    assert without_offsets_under_dataparallel(made, ddp).collator.varlen
    cut = without_offsets_under_dataparallel(made, dp)
    assert not cut.collator.varlen and cut.collator.packed
    assert "cu_seq_lens_q" not in cut.collator.collate(packed_rows())

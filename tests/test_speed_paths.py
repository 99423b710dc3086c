"""The speed work changes no result: the cached data order is the old per-step order, peak FLOP/s
are matched exactly per precision, tokens/s leaves out pauses, the GPU matrix dry-runs without a GPU."""

import pytest
import torch

from anygpu.data.order import GlobalOrder
from anygpu.runtime import hardware
from anygpu.train import metrics


def old_global_batch(num_samples: int, G: int, seed: int, step: int) -> list[int]:
    """The order as it was computed before: a fresh randperm of the whole corpus at every step."""
    epoch, k = divmod(step, num_samples // G)
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(num_samples, generator=g)[k * G : (k + 1) * G].tolist()


def test_cached_order_is_the_old_order_across_seeds_epochs_and_steps():
    for n, G, seed in [(50, 4, 0), (1000, 16, 42), (30_000, 8, 7), (997, 12, 3)]:
        order = GlobalOrder(n, G, seed)
        spe = order.steps_per_epoch
        steps = [0, 1, spe - 1, spe, spe + 1, 3 * spe + 2, 2, 5 * spe]  # across epochs, forwards and back
        for step in steps:
            assert order.global_batch(step) == old_global_batch(n, G, seed, step), (n, G, seed, step)


def test_order_draws_each_epoch_permutation_once(monkeypatch):
    """Per-step cost does not grow with the corpus: the whole-corpus randperm runs once per epoch, not per step."""
    calls = []
    real = torch.randperm
    monkeypatch.setattr(torch, "randperm", lambda *a, **k: calls.append(a[0]) or real(*a, **k))
    order = GlobalOrder(100_000, 8, 0)
    for step in range(2 * order.steps_per_epoch):
        order.global_batch(step)
    assert calls == [100_000, 100_000]  # epochs 0 and 1


@pytest.mark.parametrize(
    "name,precision,tflops",
    [
        ("NVIDIA H100 80GB HBM3", "bf16", 989),
        ("NVIDIA H100 80GB HBM3", "tf32", 494.7),
        ("NVIDIA H100 80GB HBM3", "fp32", 66.9),
        ("NVIDIA H100 PCIe", "bf16", 756),
        ("NVIDIA H100 NVL", "bf16", 835),
        ("NVIDIA A100-SXM4-80GB", "tf32", 156),
        ("NVIDIA B200", "bf16", 2250),
        ("NVIDIA GB200", "bf16", 2500),
        ("NVIDIA A10G", "bf16", 70),
        ("NVIDIA A10", "bf16", 125),
        ("NVIDIA L40S", "fp32", 91.6),
        ("NVIDIA GeForce RTX 4090", "bf16", 165.2),
        ("AMD Instinct MI300X", "tf32", 653.7),
        ("AMD Instinct MI250X", "tf32", 95.7),  # no XF32 on MI250X: its fp32 peak
        ("Tesla V100-SXM2-32GB", "fp16", 125),
    ],
)
def test_peak_is_matched_exactly_per_precision(name, precision, tflops):
    assert hardware.peak_flops(name, precision) == pytest.approx(tflops * 1e12)


def test_no_substring_matches():
    # a name that only contains a known one as part of a word is unknown, not mistaken for it
    for name in ("NVIDIA XB200", "NVIDIA H1000", "AMD Instinct MI300XT"):
        assert hardware.peak_flops(name, "bf16") is None


def test_matmul_precision_picks_the_peak_column():
    assert hardware.matmul_precision(True, False, True) == "bf16"
    assert hardware.matmul_precision(False, False, True) == "tf32"
    assert hardware.matmul_precision(False, False, False) == "fp32"


def test_tokens_per_second_leaves_pauses_out_of_the_window(monkeypatch):
    clock = [100.0]
    monkeypatch.setattr(metrics.time, "perf_counter", lambda: clock[0])
    w = metrics.ThroughputWindow()
    for _ in range(4):
        w.add(1000, 1000)
    clock[0] += 2.0  # 4 steps of training
    with metrics.paused(w):
        clock[0] += 30.0  # an evaluation or a checkpoint
    w.add(1000, 1000)
    clock[0] += 0.5
    assert w.tokens_per_second() == pytest.approx(5 * 1000 / 2.5)
    w.reset()
    assert w.steps == 0 and w.paused == 0 and w.tokens == 0


def test_step_tokens_count_real_tokens_and_the_padding_of_each_micro_batch():
    """tokens/s counts what the model was given less the padding: the counts equal the collated batches'."""
    from datasets import Dataset

    from anygpu.config.batch import plan_batch
    from anygpu.data.collate import Collator, real_tokens
    from anygpu.data.order import GlobalOrder

    lengths = [3 + (7 * i) % 13 for i in range(24)]
    rows = Dataset.from_dict({"input_ids": [[5] * n for n in lengths], "labels": [[5] * n for n in lengths]})
    order, collator = GlobalOrder(len(rows), 12, seed=1), Collator(pad_token_id=0)
    counter = metrics.StepTokens(rows, order, 16)
    for world, m in ((1, 4), (2, 3), (3, 1)):
        plan = plan_batch(12, world, m)
        for step in (0, 1):
            batches = [collator.read(rows, mb) for r in range(world) for mb in order.micro_batches(step, plan, r)]
            real = sum(int(real_tokens(b).sum()) for b in batches)  # a micro-batch without padding has no mask
            assert counter.count(step, plan) == (real, sum(b["input_ids"].numel() for b in batches))
            assert real == sum(lengths[i] for i in order.global_batch(step))  # the same whatever the split
    blocks = Dataset.from_dict({"input_ids": [[1] * 16] * 24})  # raw-text blocks: full, never padded
    assert metrics.StepTokens(blocks, order, 16).count(0, plan_batch(12, 2, 3)) == (12 * 16, 12 * 16)


@pytest.mark.slow  # starts worker processes
def test_packed_data_is_the_same_with_one_two_and_three_workers(tmp_path, caplog, monkeypatch):
    """Tokenising and packing run in parallel, chunk by chunk; the blocks are those of the documented rule
    (non-empty texts + EOS, joined per chunk of about BYTES_PER_BLOCK_IN_CHUNK x block_size bytes, text i in
    chunk floor(bytes before it / chunk bytes), cut into full blocks), whatever the number of processes,
    with empty and missing texts among them."""
    import logging

    from datasets import Dataset, DatasetDict

    from anygpu.data import packing
    from anygpu.data import tokenizer as tok_lib

    monkeypatch.setattr(packing, "BYTES_PER_BLOCK_IN_CHUNK", 128)  # 2 KB chunks: many, uneven over 2 and 3 workers
    docs = [f"def f{i}(x):\n    return x * {i} + {i % 7}\n" * (1 + i % 9) for i in range(1000)]
    docs = [None if i % 53 == 0 else "" if i % 11 == 0 else d for i, d in enumerate(docs)]
    docs[5] = docs[5] * 300  # one text larger than several chunks
    raw = DatasetDict(train=Dataset.from_dict({"text": docs[:900]}), validation=Dataset.from_dict({"text": docs[900:]}))
    tok = tok_lib.train_bpe(iter(d for d in docs if d), 400)
    with caplog.at_level(logging.INFO):
        # separate caches (and fingerprints) so each call packs again rather than reading the first
        runs = [packing.pack(raw, tok, 16, "text", f"fp-{n}", str(tmp_path / str(n)), num_proc=n) for n in (1, 2, 3)]
    eos = tok.eos_token_id
    for split, texts in (("train", docs[:900]), ("validation", docs[900:])):
        chunks, before = {}, 0
        for t in (t for t in texts if t):
            chunks.setdefault(before // (128 * 16), []).append(t)
            before += len(t.encode())
        assert len(chunks) > 5
        expected = []
        for chunk in chunks.values():
            flat = [t for x in tok(chunk, add_special_tokens=False)["input_ids"] for t in (*x, eos)]
            expected += [flat[i : i + 16] for i in range(0, len(flat) // 16 * 16, 16)]
        assert len(expected) > 30
        for run in runs:
            assert run[split].to_dict()["input_ids"] == expected
    assert "MB/s, 3 processes" in caplog.text  # the log reports the rate


def test_default_workers_follow_the_cores_and_the_corpus():
    from anygpu.data.prepare import preprocessing_workers

    assert preprocessing_workers(3, 10) == 3  # as asked
    assert preprocessing_workers(None, 1_000) == 1  # a small corpus: no process start-up to pay
    import os

    cores = len(os.sched_getaffinity(0))
    assert preprocessing_workers(None, 10**12) == min(cores, 64)


@pytest.mark.slow  # a fresh interpreter importing torch and transformers
def test_engines_do_not_import_deepspeed_until_used():
    import subprocess
    import sys

    code = (
        # the native engine without --use_peft: no peft either (transformers' schedules would import it: 1.8 s)
        "import sys, anygpu.engines.fsdp; assert 'peft' not in sys.modules, 'peft imported'; "
        "import anygpu.engines.hf.engine, anygpu.engines.hf.trainer; "
        "assert 'deepspeed' not in sys.modules, 'deepspeed imported'; "
        # unwrapping a model (Trainer's start-up, save_pretrained) neither, once the engines' guard is on; a
        # DeepSpeed engine is still unwrapped once DeepSpeed is in use
        "import torch; from transformers.modeling_utils import unwrap_model; "
        "from anygpu.runtime import lazy_deepspeed; lazy_deepspeed.unwrap_without_importing_deepspeed(); "
        "ddp_like = type('DistributedDataParallel', (torch.nn.parallel.DistributedDataParallel,), {'__init__': lambda self, m: torch.nn.Module.__init__(self) or setattr(self, 'module', m)}); "
        "inner = torch.nn.Linear(2, 2); assert unwrap_model(ddp_like(inner)) is inner; "
        "assert 'deepspeed' not in sys.modules, 'deepspeed imported by unwrap_model'; "
        "import deepspeed; from accelerate.utils import other; assert other.is_deepspeed_available()"
    )
    subprocess.run([sys.executable, "-c", code], check=True, env={**__import__("os").environ, "HF_HUB_OFFLINE": "1"})


def test_cpu_adamw_is_the_fused_kernel_with_the_loops_updates():
    """On CPU the optimizer is AdamW's fused kernel (torch's CPU default loops over the parameters in
    Python, 4-6x slower); its updates are the loop's to float rounding, decay groups included."""
    import copy
    from types import SimpleNamespace

    from anygpu.train import optim

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.LayerNorm(64), torch.nn.Linear(64, 8))
    loop = copy.deepcopy(model)
    args = SimpleNamespace(
        weight_decay=0.1, learning_rate=1e-2, adam_beta1=0.9, adam_beta2=0.95, adam_epsilon=1e-8, optim="adamw_torch"
    )
    fused = optim.build_optimizer(model, args, torch.device("cpu"))
    assert fused.defaults["fused"] and [g["weight_decay"] for g in fused.param_groups] == [0.1, 0.0]
    reference = torch.optim.AdamW(optim.param_groups(loop, 0.1), lr=1e-2, betas=(0.9, 0.95), eps=1e-8, foreach=False)
    for step in range(5):
        x = torch.randn(16, 32, generator=torch.Generator().manual_seed(step))
        for m, opt in ((model, fused), (loop, reference)):
            opt.zero_grad()
            m(x).pow(2).mean().backward()
            opt.step()
    for a, b in zip(model.parameters(), loop.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)

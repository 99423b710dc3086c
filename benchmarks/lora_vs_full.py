"""Tokens/s and memory of LoRA against full fine-tuning, same base model and batches, FSDP2 engine.

One process. A base folder is written first (the preset from scratch + its tokenizer, as save_pretrained
writes a pretrained model); then the full model and the LoRA model are built from it and stepped in
alternating rounds over the same micro-batches, so machine noise hits both alike. Memory: on a GPU the
peak allocated per mode (reset between them); on CPU, which has no allocator statistics, the bytes of
the training state the mode holds (parameters + gradients + AdamW state), measured from the tensors.

    .venv/bin/python benchmarks/lora_vs_full.py [--config_name default] [--steps 5] [--rounds 3] [--lora_r 16]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import anygpu  # noqa: E402

anygpu.set_offline_defaults()

import torch  # noqa: E402

from anygpu.config.args import parse_args  # noqa: E402
from anygpu.data.prepare import prepare  # noqa: E402
from anygpu.engines import fsdp as fsdp_engine  # noqa: E402
from anygpu.model import modeling  # noqa: E402
from anygpu.runtime import distributed, parallel
from anygpu.train import optim
from _scratch import scratch_folder


def write_base(a, folder: Path, info) -> None:
    """The preset with its seeded initial weights and a tokenizer trained on the corpus, saved as a pretrained folder."""
    m, d, t = parse_args(
        [
            "--config_name",
            a.config_name,
            "--block_size",
            a.block_size,
            "--max_corpus_mb",
            "2",
            "--output_dir",
            str(folder / "scratch"),
        ]
    )
    prep = prepare(m, d, t, info)
    model = modeling.build_full_model(prep.config, m, t.seed)
    model.save_pretrained(str(folder))
    prep.tokenizer.save_pretrained(str(folder))


def state_bytes(model, opt) -> int:
    grads = sum(p.grad.numel() * p.grad.element_size() for p in model.parameters() if p.grad is not None)
    return parallel.local_bytes(model, opt) + grads


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config_name", default="default")
    p.add_argument("--block_size", default="128")
    p.add_argument("--global_batch_size", default="8")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--lora_r", default="16")
    a = p.parse_args()
    info = distributed.init_distributed()
    base = Path(scratch_folder("anygpu-lora-bench-"))
    write_base(a, base, info)
    common = [
        "--model_name_or_path",
        str(base),
        "--block_size",
        a.block_size,
        "--global_batch_size",
        a.global_batch_size,
        "--max_corpus_mb",
        "2",
        "--output_dir",
        str(base / "out"),
    ]
    modes = {
        "full": common,
        "lora": [
            *common,
            "--use_peft",
            "true",
            "--lora_r",
            a.lora_r,
            "--lora_alpha",
            str(2 * int(a.lora_r)),
            "--lora_target_modules",
            "all-linear",
        ],
    }
    built = {}
    for name, argv in modes.items():
        m, d, t = parse_args(argv)
        prep = prepare(m, d, t, info)
        model = fsdp_engine.build_model(prep, m, t, info)
        built[name] = (prep, model, optim.build_optimizer(model, t, info.device), t.max_grad_norm)

    def step(name: str, s: int) -> None:
        prep, model, opt, max_norm = built[name]
        fsdp_engine.train_step(model, prep, s, info)
        fsdp_engine.clip_gradients(model, max_norm)
        opt.step()
        opt.zero_grad(set_to_none=False)  # keep the gradients: they count in the memory below

    memory = {}
    for name in built:  # warm-up; the memory each mode holds
        if info.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        step(name, 0)
        memory[name] = (
            torch.cuda.max_memory_allocated() if info.device.type == "cuda" else state_bytes(*built[name][1:3])
        )

    tokens_per_step = int(a.global_batch_size) * int(a.block_size)
    rates = {name: [] for name in built}
    for r in range(a.rounds):
        for name in built:
            start = time.perf_counter()
            for s in range(1, a.steps + 1):
                step(name, s)
            if info.device.type == "cuda":
                torch.cuda.synchronize()
            rates[name].append(tokens_per_step * a.steps / (time.perf_counter() - start))
        print(f"round {r + 1}: " + ", ".join(f"{n} {rates[n][-1]:.0f} tokens/s" for n in rates), flush=True)
    full, lora = (statistics.median(rates[n]) for n in ("full", "lora"))
    kind = "peak allocated" if info.device.type == "cuda" else "training state (params + grads + AdamW)"
    trainable = {n: sum(p.numel() for p in built[n][1].parameters() if p.requires_grad) for n in built}
    print(
        f"{a.config_name} preset, block {a.block_size}, global batch {a.global_batch_size}, {info.device}, LoRA r={a.lora_r} all-linear:"
    )
    print(f"  trainable parameters: full {trainable['full'] / 1e6:.2f}M, LoRA {trainable['lora'] / 1e6:.3f}M")
    print(
        f"  tokens/s (median of {a.rounds} rounds of {a.steps} steps): full {full:.0f}, LoRA {lora:.0f}, LoRA/full = {lora / full:.2f}"
    )
    print(
        f"  memory, {kind}: full {memory['full'] / 2**20:.1f} MiB, LoRA {memory['lora'] / 2**20:.1f} MiB, "
        f"LoRA/full = {memory['lora'] / memory['full']:.2f}"
    )
    distributed.destroy()


if __name__ == "__main__":
    main()

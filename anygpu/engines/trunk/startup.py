"""A run's start, both engines: refusals before any work, the output folder, the checks once the process
group exists, the checkpoint to resume, the throughput facts, the banner and the run's files."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

from anygpu import errors
from anygpu.checkpoint import resume_guard
from anygpu.config import attention
from anygpu.errors import UsageError
from anygpu.model import fp8, modeling
from anygpu.reliability import run_guard
from anygpu.runtime import hardware
from anygpu.train import metrics, optim

# How each engine trains in half precision, for the refusals (the FSDP2 engine has no loss scaling).
HALF_PRECISION = {"fsdp": "--bf16", "hf": "--bf16 or --fp16"}


def check_precision(train_args, engine: str, on_gpu: bool) -> None:
    """Refuse a precision this engine or this device cannot train in (before any GPU work)."""
    if train_args.fp16 and engine == "fsdp":
        raise UsageError("--fp16 is not supported by the FSDP2 engine: use --bf16 (same memory, no loss scaling).")
    if train_args.fp16 and not on_gpu:
        raise UsageError("--fp16 needs a GPU: on CPU train in fp32 (leave it out) or with --bf16.")
    if train_args.bf16 and on_gpu and not hardware.supports_bf16():
        other = (
            "drop --bf16 (fp32) or use the HF engine with --fp16"
            if engine == "fsdp"
            else ("use --fp16 (with loss scaling) or fp32")
        )
        raise UsageError(f"--bf16: this GPU has no bf16; {other}.")


def preflight_checks(parsed: tuple, engine: str) -> None:
    """The launchers' check (one process, before the ranks): what needs the model's config, the world size the
    launcher starts (ANYGPU_PREFLIGHT_WORLD_SIZE; none for an elastic job) and the trackers, as each rank would."""
    from anygpu.data.prepare import check_run
    from anygpu.train import trackers

    model_args, data_args, train_args = parsed[:3]
    trackers.resolve(train_args.report_to)
    check_levers(model_args, train_args, engine)
    world = int(os.environ.get("ANYGPU_PREFLIGHT_WORLD_SIZE") or 0)
    check_run(model_args, data_args, train_args, max(1, world // train_args.cp) if world else 1)


def check_levers(model_args, train_args, engine: str) -> None:
    """Refuse the speed and memory levers this engine or this device cannot run (before any GPU work)."""
    fp8.check_args(train_args.fp8, engine, model_args.use_peft)
    fp8.check_hardware(train_args.fp8)
    if train_args.cpu_offload and engine != "fsdp":
        raise UsageError(
            "--cpu_offload true is the FSDP2 engine's: the HF engine offloads through its accelerate config "
            "(run_nvidia_all.sh or run_amd_all.sh --accelerate-config fsdp_offload or deepspeed_zero3_offload), or use "
            "--engine fsdp."
        )
    if train_args.cpu_offload and train_args.fp8:
        raise UsageError(
            f"--cpu_offload true with --fp8 {train_args.fp8}: FP8 training is not offloaded here; drop one of them "
            "(--fp8 none, or --cpu_offload false)."
        )
    check_4bit(model_args, train_args, engine)
    check_ep(train_args, engine)
    if engine != "fsdp" and train_args.is_grpo:
        raise UsageError(
            "--objective grpo is the FSDP2 engine's (run_fsdp_standalone.py, or the launchers' --engine fsdp): "
            "Trainer's loop owns the batches, and GRPO makes each step's batch by generating between steps "
            "(TRL's GRPOTrainer is the Trainer-based tool; docs/grpo.md)."
        )
    if engine != "fsdp" and train_args.dataloader_num_workers:
        raise UsageError(
            f"--dataloader_num_workers {train_args.dataloader_num_workers}: the HF engine reads each micro-batch "
            "inline (its keyed dropout follows the sampler's order); use --dataloader_num_workers 0, or --engine fsdp."
        )
    if engine != "fsdp" and train_args.gradient_checkpointing_policy == "selective":
        raise UsageError(
            "--gradient_checkpointing_policy selective is the FSDP2 engine's: use --engine fsdp, or full "
            "checkpointing (--gradient_checkpointing true)."
        )


def check_ep(train_args, engine: str) -> None:
    """--ep where it runs: the FSDP2 engine (what the model refuses, `expert_parallel.check` says when it is built)."""
    ep = train_args.ep
    if ep != 1 and engine != "fsdp":
        raise UsageError(
            f"--ep {ep}: expert parallelism is the FSDP2 engine's (run_fsdp_standalone.py, or the launchers' --engine "
            "fsdp); accelerate's FSDP and DeepSpeed configs carry no expert mesh, and transformers' own "
            "(DistributedConfig) is not wired into Trainer: use --ep 1 with the HF engine."
        )


def check_4bit(model_args, train_args, engine: str) -> None:
    """--load_in_4bit (QLoRA) where it runs: the FSDP2 engine, without the levers that rewrite or move its weights."""
    if not model_args.load_in_4bit:
        return
    if engine != "fsdp":
        raise UsageError(
            "--load_in_4bit true (QLoRA) is the FSDP2 engine's (torchao NF4 under FSDP2, any GPU or CPU): use "
            "run_fsdp_standalone.py or the launchers' --engine fsdp; the HF engine would need bitsandbytes, not "
            "installed here."
        )
    if train_args.fp8:
        raise UsageError(
            f"--load_in_4bit true with --fp8 {train_args.fp8}: a 4-bit base computes in the compute dtype; drop "
            "one of them (--fp8 none)."
        )
    if train_args.cpu_offload:
        raise UsageError(
            "--load_in_4bit true with --cpu_offload true: a 4-bit base is ~0.52 bytes a parameter (70B: 36 GB over "
            "the shard group) and is not offloaded here; drop --cpu_offload."
        )


# What transformers needs for each flash attention (without it, or without a GPU, a rank's traceback).
FLASH_PACKAGES = {
    "flash_attention_2": "flash-attn (pip install flash-attn --no-build-isolation)",
    "flash_attention_3": "flash-attn 3 (flash_attn_interface, built from flash-attention's hopper/ folder)",
}


def flash_attention_available(attn_implementation: str) -> bool:
    """Whether transformers can run this flash attention here: its package for a visible GPU, or the `kernels`
    package it falls back to (a kernel from the Hub)."""
    from transformers.utils import is_flash_attn_2_available, is_flash_attn_3_available, is_kernels_available

    own = is_flash_attn_3_available if attn_implementation == "flash_attention_3" else is_flash_attn_2_available
    return own() or is_kernels_available()


def check_attention(attn_implementation: str, train_args, engine: str) -> None:
    """Refuse flash attention where it cannot run (before any process group): in fp32, or without its package;
    flex attention on a CPU (no backward there); torch's varlen kernel where torch lacks it, or in fp32."""
    half = bool(train_args.bf16 or getattr(train_args, "fp16", False))
    attention.check_device(attn_implementation, on_gpu=hardware.vendor() != "cpu", half=half)
    if not attn_implementation.startswith("flash_attention"):
        return
    if not (train_args.bf16 or train_args.fp16):
        raise UsageError(
            f"--attn_implementation {attn_implementation} needs {HALF_PRECISION[engine]} (flash attention has no "
            "fp32 kernels): add it, or use --attn_implementation sdpa."
        )
    if not flash_attention_available(attn_implementation):
        raise UsageError(
            f"--attn_implementation {attn_implementation}: {FLASH_PACKAGES[attn_implementation]} is not installed "
            "for a visible GPU: install it, or use --attn_implementation sdpa."
        )


def configure_matmuls(train_args) -> bool:
    """The run's matmul numerics, both engines: TF32 as --tf32 asks and the hardware allows (returned: the banner
    and the MFU peak follow it), and deterministic algorithms where `anygpu verify` asks for them."""
    hardware.configure_determinism()
    return hardware.configure_tf32(train_args.tf32)


def claim(train_args) -> run_guard.Claim | None:
    """Rank 0 takes --output_dir (lock, repairs, a used folder, rewinds) before any process group exists:
    a refusal here costs nothing."""
    return run_guard.claim_output_dir(train_args, errors.rank())


def joined(info, resolved: dict[str, Any], output_dir: str) -> None:
    """Once the process group exists: every rank reaches it, with the same arguments, and sees --output_dir."""
    run_guard.check_ranks(info, resolved, output_dir)
    level = logging.INFO if info.is_main else logging.WARNING
    logging.basicConfig(level=level, format="[%(levelname)s] %(message)s")


def resume_target(train_args, claimed: run_guard.Claim | None, engine: str) -> Path | None:
    """The checkpoint to resume, the same on every rank (rank 0's verdict), refused when the other engine wrote it."""
    resume = run_guard.agreed_resume(train_args.resume_from_checkpoint, train_args.output_dir, claimed)
    if resume is not None:
        resume_guard.check_engine(resume, engine)
    return resume


def auto_micro_batch(prep, model_args, train_args, device, strategy: str, rank: int, **probe_kwargs: Any):
    """--auto_micro_batch: the largest micro-batch that fits on every rank, put into `prep.plan` (G unchanged),
    and each rank's line saying it; the probe (for the banner), or None without the option."""
    if not train_args.auto_micro_batch:
        return None
    from anygpu.planning import auto_batch

    probe = auto_batch.apply(prep, model_args, train_args, device, strategy, **probe_kwargs)
    print(f"rank {rank}: micro-batch auto → {prep.plan.per_device_train_batch_size}", flush=True)
    return probe


def throughput_facts(prep, model, train_args, tf32: bool, device) -> tuple[metrics.Flops, float | None]:
    """(training FLOPs, the device's peak FLOP/s at the run's precision or None): for the MFU. FP8 runs are
    measured against the bf16 peak (torchtitan's convention: the FP8 peak would hide what FP8 gained)."""
    trainable, frozen = modeling.matmul_parameters(model)
    flops = metrics.training_flops(prep.config, trainable, num_frozen=frozen)
    precision = hardware.matmul_precision(train_args.bf16, train_args.fp16, tf32)
    peak = hardware.peak_flops(hardware.devices()[0].name, precision) if device.type == "cuda" else None
    return flops, peak


def banner(engine: str, prep, model, train_args, tf32: bool, layout: str, objective: list[str] = ()) -> str:
    """The start-up banner: the engine, hardware, model, data, batch cut, schedule and precision (the lines
    both engines share), the objective's lines (--objective dpo) and the engine's own layout line (its mesh or strategy)."""
    from anygpu.data.prepare import summary_lines

    state = optim.note(train_args.optim_state)
    lines = [*summary_lines(prep, model, train_args, tf32), *([state] if state else []), *objective, layout]
    return "\n".join([f"anygpu {engine} engine", *lines])


def resume_line(path: Path, step: int, was: int, now: int, unit: str, meshes: str = "") -> str:
    """`resumed from … at step N (was W ranks, now W'[; mesh …])`: what the resumed run continues from."""
    return f"resumed from {path} at step {step} (was {was} {unit}, now {now}{meshes})"


def announce(banner: str, probe: Any = None, resumed: str | None = None, changed: list[str] = ()) -> None:
    """Rank 0's start-up lines: the banner, the auto micro-batch, the resume and what changed since."""
    lines = [banner, probe.line() if probe is not None else None, resumed]
    lines.append(resume_guard.banner_line(list(changed)) if resumed else None)
    for line in lines:
        if line:
            print(line, flush=True)


def write_run_files(output_dir: str, resolved: dict[str, Any], tokenizer) -> None:
    """Rank 0: `args.json` (the resolved arguments) and `tokenizer/` in --output_dir."""
    out = Path(output_dir)
    (out / "args.json").write_text(json.dumps(resolved, indent=2, default=str))
    tokenizer.save_pretrained(str(out / "tokenizer"))

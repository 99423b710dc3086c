"""`anygpu plan`: will this model train here, and how? Per-GPU memory of every strategy, before any GPU work.

    anygpu plan --config_name llama-1b --block_size 2048 --global_batch_size 64 --num_gpus 8 --gpu_memory_gb 80
    anygpu plan --model_name_or_path ./my-model --json
    anygpu plan --config_name llama-8b --num_nodes 2 --num_gpus 16 --gpu_memory_gb 80   # + HSDP rows (2 × 8)
    anygpu plan --config_name llama-8b --gpu h100 --objective grpo --global_batch_size 256 --beta 0.04

The model is built on the meta device (nothing allocated). Model states are exact; activations are
estimates (see anygpu/planning/memory_plan.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from dataclasses import dataclass

from anygpu.config import attention
from anygpu.config.optimizers import FP32, LOW_BIT, OPTIMIZERS, flag, state_kind
from anygpu.launch.suggest import ArgumentParser, did_you_mean
from anygpu.planning import memory_plan
from anygpu.planning.gpus import GPUS
from anygpu.planning.memory_plan import GIB, Machine, PlanResult, Row, Shapes

DEFAULT_MFU = 0.4
DEFAULT_BLOCK = 1024
# --objective grpo's flags: the engines' (TRL's GRPOConfig) defaults
GRPO_DEFAULTS = {"num_generations": 8, "max_prompt_length": 512, "max_completion_length": 512, "beta": 0.0}
ASSUMED_GPUS = 8  # --gpu without --num_gpus on a machine without that GPU: one node of eight


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(
        prog="anygpu plan",
        description="Per-GPU bytes of parameters, gradients, optimizer state and activations for DDP, FSDP2, "
        "ZeRO-2, ZeRO-3 and their CPU-offload variants, with and without activation checkpointing, "
        "fp32 and bf16, full fine-tuning and LoRA; which fit; the recommended strategy, accelerate "
        "config, per-device batch and accumulation steps; the step time at a stated MFU. Model states "
        "are exact from the real parameter shapes; activations are estimates (Korthikanti et al.).",
        epilog="Example: anygpu plan --config_name llama-8b --block_size 4096 --global_batch_size 64 "
        "--num_gpus 8 --gpu_memory_gb 80",
    )
    _model_arguments(p)
    _objective_arguments(p)
    _cluster_arguments(p)
    _run_arguments(p)
    return p


def _model_arguments(p: argparse.ArgumentParser) -> None:
    """What is trained: the model and the shape of a step."""
    p.add_argument("--model_name_or_path", help="A local model folder or a cached hub id (only its config is read).")
    p.add_argument(
        "--config_name",
        help="A preset (tiny, default, llama-1b, llama-8b), a config.json or a folder. "
        "Default: 'default' when --model_name_or_path is not given.",
    )
    p.add_argument(
        "--block_size",
        type=int,
        help=f"Tokens per sequence (default {DEFAULT_BLOCK}; --objective grpo: --max_prompt_length + "
        "--max_completion_length instead).",
    )
    p.add_argument(
        "--global_batch_size",
        type=int,
        default=64,
        help="Sequences (pairs with --objective dpo, completions with --objective grpo) per step (default 64).",
    )
    p.add_argument(
        "--optim",
        choices=OPTIMIZERS,
        default="adamw_torch",
        help="The engines' --optim: adamw_torch (fp32 moments, 8 bytes a parameter), adamw_torch_8bit / "
        "adamw_torch_4bit (~2.03 / ~1.06 bytes), adamw_anyprecision with --optim_args for bf16 moments (4 bytes); "
        "all but adamw_torch: DDP and FSDP2 rows only. With adamw_torch, a plan that needs offload or fits nothing "
        "also says what 8-bit state would change.",
    )
    p.add_argument(
        "--optim_args",
        default=None,
        help="The engines' --optim_args for adamw_anyprecision: momentum_dtype=bfloat16,variance_dtype=bfloat16.",
    )
    p.add_argument(
        "--packing",
        choices=("true", "false"),
        default="false",
        help="true: each row packs several samples (the engines' default for SFT and DPO rows where the attention "
        "honours their boundaries); false (default): raw-text blocks or one sample per row. Packed rows under sdpa "
        "or eager attention cost a dense (block × block) mask per forward, which the plan counts.",
    )
    p.add_argument(
        "--attn_implementation",
        choices=attention.IMPLEMENTATIONS,
        default=None,
        help="The engines' --attn_implementation (default as theirs: sdpa, and varlen_attention for packed rows on "
        "NVIDIA GPUs). Only sdpa and eager take packed rows as a dense mask: flash and varlen attention take their "
        "sample boundaries, flex attention a block mask.",
    )


def _objective_arguments(p: argparse.ArgumentParser) -> None:
    """What a step computes beyond the language model: DPO's pairs and reference, GRPO's generation."""
    p.add_argument(
        "--objective",
        choices=("lm", "dpo", "grpo"),
        default="lm",
        help="dpo: a micro-batch item is a preference pair (two sequences in one forward), and the reference counts "
        "(docs/dpo.md). grpo: micro-batches of completions, plus a round's generation: the whole model gathered "
        "in the compute dtype on every rank, the KV cache of each rank's G/W completions, the sampler; the FSDP2 "
        "engine's strategies only (docs/grpo.md).",
    )
    p.add_argument(
        "--num_generations",
        type=int,
        help=f"--objective grpo: completions per prompt (default {GRPO_DEFAULTS['num_generations']}); must divide "
        "--global_batch_size.",
    )
    p.add_argument(
        "--max_prompt_length",
        type=int,
        help=f"--objective grpo: prompt tokens (default {GRPO_DEFAULTS['max_prompt_length']}).",
    )
    p.add_argument(
        "--max_completion_length",
        type=int,
        help=f"--objective grpo: completion tokens (default {GRPO_DEFAULTS['max_completion_length']}).",
    )
    p.add_argument(
        "--beta",
        type=float,
        help="--objective grpo: the KL term's weight (default 0: no reference); above 0 a frozen reference in the "
        "compute dtype, sharded like the policy (LoRA: none, its base is the reference). --objective dpo: no "
        "effect on memory (see --precompute_ref_log_probs).",
    )
    p.add_argument(
        "--use_vllm",
        choices=("true", "false"),
        default="false",
        help="--objective grpo: a colocated vLLM engine per GPU generates, holding --vllm_gpu_memory_utilization of "
        "the GPU throughout (its weights and KV cache) instead of the round's gathered model.",
    )
    p.add_argument(
        "--vllm_gpu_memory_utilization",
        type=float,
        default=0.3,
        help="--use_vllm true: the share of each GPU's memory its vLLM engine takes (default 0.3, TRL's).",
    )
    p.add_argument(
        "--precompute_ref_log_probs",
        choices=("true", "false"),
        default="true",
        help="--objective dpo: true (the engines' default): the reference's log-probs are computed before training "
        "and nothing of it stays in memory; false: a frozen copy in the compute dtype, sharded like the parameters "
        "(LoRA: none, the base with its adapter disabled is the reference).",
    )


def _cluster_arguments(p: argparse.ArgumentParser) -> None:
    """Where it runs: the GPUs, the nodes and the HSDP mesh."""
    p.add_argument(
        "--gpu",
        metavar="NAME",
        help=f"Plan for this GPU, not the one here: {', '.join(GPUS)} (memory and peak FLOP/s from anygpu's table).",
    )
    p.add_argument(
        "--num_gpus",
        type=int,
        help="GPUs in the job, all nodes together (default: the GPUs detected "
        "here × --num_nodes; with --gpu and none here, "
        f"{ASSUMED_GPUS}).",
    )
    p.add_argument(
        "--num_nodes",
        type=int,
        default=1,
        help="Nodes in the job (default 1). With more than one, the FSDP2 engine's default HSDP mesh "
        "(shard within a node, replicate across nodes) gets rows of its own: strategy hsdp.",
    )
    p.add_argument(
        "--dp_shard",
        type=int,
        help="HSDP's shard group: the GPUs each replica group shards the model over, as the FSDP2 "
        "engine's --dp_shard (default: the GPUs per node, --num_gpus / --num_nodes). Smaller than "
        "--num_gpus: hsdp rows, whose states are divided by it, not by --num_gpus.",
    )
    p.add_argument(
        "--cp",
        type=int,
        default=1,
        help="The FSDP2 engine's context parallelism: each sequence split over C GPUs, so a GPU holds the "
        "activations of --block_size / C tokens; the rows are then FSDP2's alone (default 1). With 1, a plan "
        "where nothing fits without offload recommends the smallest C that does (docs/long-context.md).",
    )
    p.add_argument(
        "--ep",
        type=int,
        default=1,
        help="The FSDP2 engine's expert parallelism (a mixture-of-experts model): the experts split over E GPUs, "
        "each gathering its E-th of them with a layer; the rows are then FSDP2's alone (default 1). A MoE plan "
        "says what E divides the experts and a node's GPUs, and the all-to-all volume (docs/moe.md).",
    )
    p.add_argument("--gpu_memory_gb", type=float, help="Memory per GPU in GiB (default: detected).")
    p.add_argument(
        "--host_memory_gb",
        type=float,
        help="Host memory per node in GiB, for the offload rows: one whose offloaded state a node cannot hold "
        "does not fit (default: this machine's, where its GPUs are the plan's; else not checked).",
    )
    p.add_argument("--gpu_name", help="GPU model for the peak FLOP/s of the step time, e.g. H100 (default: detected).")


def _run_arguments(p: argparse.ArgumentParser) -> None:
    """The table's rows, the recommendation and the output."""
    p.add_argument(
        "--per_device_train_batch_size",
        type=int,
        default=1,
        help="Micro-batch of the table's rows (default 1); the recommendation picks its own.",
    )
    p.add_argument(
        "--finetune",
        choices=("full", "lora", "qlora"),
        default="full",
        help="What the recommendation is for (the tables show full and LoRA; qlora: LoRA over a 4-bit base, "
        "--load_in_4bit, the FSDP2 engine's).",
    )
    p.add_argument("--lora_r", type=int, default=16, help="LoRA rank of the LoRA rows (default 16).")
    p.add_argument(
        "--lora_target_modules",
        default="",
        help="Modules that get adapters, comma-separated, or all-linear (default: the engines' choice "
        "when their --lora_target_modules is left out).",
    )
    p.add_argument(
        "--mfu",
        type=float,
        default=DEFAULT_MFU,
        help=f"Model FLOP utilisation of the step-time estimate (default {DEFAULT_MFU}).",
    )
    p.add_argument(
        "--table",
        action="store_true",
        help="Also the full tables: every strategy, precision and checkpointing setting, full and LoRA.",
    )
    p.add_argument("--json", action="store_true", help="One JSON object (rows, recommendation) instead of text.")


def check_args(args: argparse.Namespace) -> str | None:
    """One-line refusal for bad input, or None."""
    problem = check_objective(args)
    if problem:
        return problem
    args = settled(args)
    examples = {"block_size": 4096, "global_batch_size": 64, "per_device_train_batch_size": 4, "lora_r": 16}
    for name, example in examples.items():
        if getattr(args, name) <= 0:
            return f"--{name} {getattr(args, name)} must be a positive whole number, e.g. {example}"
    if args.num_gpus is not None and args.num_gpus < 1:
        return f"--num_gpus {args.num_gpus} must be at least 1, e.g. 8"
    try:
        state_kind(args.optim, args.optim_args)
    except ValueError as e:
        return str(e)
    if args.num_nodes < 1:
        return f"--num_nodes {args.num_nodes} must be at least 1, e.g. 2"
    if args.num_gpus is not None and args.num_gpus % args.num_nodes:
        return (
            f"--num_gpus {args.num_gpus} is not the same number of GPUs on each of --num_nodes {args.num_nodes}: "
            f"give a multiple of {args.num_nodes}, e.g. {args.num_nodes * max(1, args.num_gpus // args.num_nodes)}"
        )
    if args.dp_shard is not None and args.dp_shard < 1:
        return f"--dp_shard {args.dp_shard} must be at least 1, e.g. 8 (the GPUs of one node)"
    if args.dp_shard is not None and args.num_gpus is not None and args.num_gpus % args.dp_shard:
        divisors = ", ".join(str(d) for d in range(1, args.num_gpus + 1) if args.num_gpus % d == 0)
        return f"--dp_shard {args.dp_shard} does not divide --num_gpus {args.num_gpus}: use one of {divisors} (e.g. the GPUs of one node)"
    if args.cp < 1 or (args.num_gpus is not None and args.num_gpus % args.cp) or args.block_size % args.cp:
        return f"--cp {args.cp} must divide --num_gpus and --block_size {args.block_size}, e.g. 2"
    if args.ep < 1 or (args.num_gpus is not None and args.num_gpus % args.ep):
        return f"--ep {args.ep} must divide --num_gpus, e.g. 8 (the GPUs of one node)"
    if args.host_memory_gb is not None and args.host_memory_gb <= 0:
        return f"--host_memory_gb {args.host_memory_gb} must be positive, e.g. 2048"
    if args.gpu_memory_gb is not None and args.gpu_memory_gb <= 0:
        return f"--gpu_memory_gb {args.gpu_memory_gb} must be positive, e.g. 80"
    if not 0 < args.mfu <= 1:
        return f"--mfu {args.mfu} must be in (0, 1], e.g. {DEFAULT_MFU}"
    if args.gpu is not None and args.gpu.lower() not in GPUS:
        return (
            f"--gpu {args.gpu} is not in anygpu's table{did_you_mean(args.gpu.lower(), GPUS)}: use one of "
            f"{', '.join(GPUS)}, or give --gpu_memory_gb (and --gpu_name for the peak FLOP/s)"
        )
    return None


def check_objective(args: argparse.Namespace) -> str | None:
    """--objective grpo's flags and refusals (the engines' own: `anygpu.config.objective.check_grpo_run`)."""
    flags = ("num_generations", "max_prompt_length", "max_completion_length")
    grpo_only = [f"--{k}" for k in flags if getattr(args, k) is not None]
    if args.use_vllm == "true" and not 0 < args.vllm_gpu_memory_utilization < 1:
        return f"--vllm_gpu_memory_utilization {args.vllm_gpu_memory_utilization} must be in (0, 1), e.g. 0.3"
    grpo_only += ["--use_vllm true"] * (args.use_vllm == "true")
    if args.objective != "grpo":
        if grpo_only:
            return f"{grpo_only[0]} is --objective grpo's: add --objective grpo, or leave it out"
        if args.beta is not None and args.objective == "lm":
            return "--beta is a preference or RL objective's: add --objective grpo (or dpo), or leave it out"
        return None
    if args.block_size is not None:
        return (
            f"--block_size {args.block_size} with --objective grpo: a row is a prompt and its completion; give "
            "--max_prompt_length and --max_completion_length instead"
        )
    values = {k: getattr(args, k) if getattr(args, k) is not None else v for k, v in GRPO_DEFAULTS.items()}
    for name, least in (("num_generations", 2), ("max_prompt_length", 1), ("max_completion_length", 1)):
        if values[name] < least:
            example = GRPO_DEFAULTS[name]
            return f"--{name} {values[name]} must be at least {least}, e.g. {example}"
    if values["beta"] < 0:
        return f"--beta {values['beta']} cannot be negative: 0 (no KL term, no reference) or more, e.g. 0.04"
    g, k, n = args.global_batch_size, values["num_generations"], args.num_gpus or 1
    unit = math.lcm(k, n)
    if g > 0 and g % unit:
        split = f" split over {n} GPUs" if n > 1 else ""
        return (
            f"--global_batch_size {g} completions is not whole groups of --num_generations {k}{split}: pass a "
            f"multiple of {unit}, e.g. {unit * max(1, g // unit)}"
        )
    refused = [
        (args.cp != 1, f"--cp {args.cp}", "completions are generated whole on each rank; use --cp 1"),
        (args.ep != 1, f"--ep {args.ep}", "generation would need every rank's experts at every token; use --ep 1"),
        (args.packing == "true", "--packing true", "each completion is its own row; leave --packing out"),
    ]
    for bad, what, why in refused:
        if bad:
            return f"{what} with --objective grpo: {why}"
    return None


def settled(args: argparse.Namespace) -> argparse.Namespace:
    """The arguments with the objective's defaults filled in: --objective grpo's flags (TRL's defaults) and its
    rows' length, --max_prompt_length + --max_completion_length, as --block_size (a copy; `args` is untouched)."""
    args = argparse.Namespace(**vars(args))
    if args.objective == "grpo":
        for name, default in GRPO_DEFAULTS.items():
            setattr(args, name, getattr(args, name) if getattr(args, name) is not None else default)
        args.block_size = args.block_size or args.max_prompt_length + args.max_completion_length
    elif args.block_size is None:
        args.block_size = DEFAULT_BLOCK
    return args


def load_shapes(
    model_name_or_path: str | None,
    config_name: str | None,
    lora_r: int = 0,
    lora_targets: tuple[str, ...] = (),
    load_in_4bit: bool = False,
) -> tuple[Shapes, object, int]:
    """(shapes, config, the parameters a token is multiplied by) of the model, built on the meta device."""
    from anygpu.config.args import ModelArguments
    from anygpu.model import modeling

    margs = ModelArguments(model_name_or_path=model_name_or_path, config_name=config_name)
    config = modeling.resolve_config(margs)
    config.use_cache = False
    model = modeling.build_meta_model(config, margs)
    shapes = memory_plan.shapes_from_model(model, config, lora_r, lora_targets, load_in_4bit)
    return shapes, config, sum(modeling.matmul_parameters(model))  # every matmul weight, a tied output projection too


def detect_machine(
    num_gpus: int | None,
    gpu_memory_gb: float | None,
    gpu_name: str | None,
    gpu: str | None = None,
    num_nodes: int = 1,
    host_memory_gb: float | None = None,
) -> Machine:
    """The GPUs of this machine (torch, else the smi tools) × `num_nodes`, overridden by what was given; the host
    memory per node given, else this machine's where the plan is for its own GPUs."""
    from anygpu.runtime import hardware

    count, memory, name, source = 0, 0, "", "none detected"
    found = hardware.devices()
    if gpu is not None:  # a named GPU: its memory and name from the table; the count from here or assumed
        known = GPUS[gpu.lower()]
        same = [d for d in found if hardware.peak_bf16_flops(d.name) == hardware.peak_bf16_flops(known.device_name)]
        count = len(same) if same else ASSUMED_GPUS
        memory, name = int(known.memory_gib * GIB), known.device_name
        source = f"--gpu {gpu}" + (
            "" if same or num_gpus is not None else f"; {ASSUMED_GPUS} assumed, change with --num_gpus"
        )
    elif found:
        count, memory, name, source = len(found), int(found[0].total_memory_gb * GIB), found[0].name, "torch"
    else:
        import os

        from anygpu.launch import detect as gpu_detect

        for vendor in gpu_detect.VENDORS:
            probe = gpu_detect.probe(vendor, env=os.environ)
            gpus = gpu_detect.visible_gpus(vendor, probe.gpus, os.environ, probe.migs).gpus if probe.gpus else []
            if gpus:
                count, name, source = len(gpus), gpus[0].name, probe.tool
                memory = int((gpus[0].memory_mib or 0) * 2**20)
                break
    if num_gpus is not None or gpu_memory_gb is not None:
        source = "given" if (num_gpus is not None and gpu_memory_gb is not None) else f"given + {source}"
    count = num_gpus if num_gpus is not None else count * num_nodes
    memory = int(gpu_memory_gb * GIB) if gpu_memory_gb is not None else memory
    name = gpu_name or name
    peak = hardware.peak_bf16_flops(name) if name else None
    here = bool(found) and gpu is None and gpu_memory_gb is None
    host = (
        int(host_memory_gb * GIB)
        if host_memory_gb is not None
        else ((hardware.host_memory_bytes("MemTotal") or 0) if here else 0)
    )
    return Machine(count, memory, name, peak, source, num_nodes=num_nodes, host_memory_bytes=host)


def plan(args: argparse.Namespace) -> tuple[PlanResult, PlanResult]:
    """(full fine-tuning plan, LoRA plan) from parsed arguments."""
    from anygpu.train import metrics

    given_block = args.block_size
    args = settled(args)
    targets = tuple(t for t in args.lora_target_modules.split(",") if t)
    full, lora, config, matmul_weights = both_shapes(args, targets)
    args.block_size = engines_block_size(args, given_block, config)
    machine = detect_machine(
        args.num_gpus, args.gpu_memory_gb, args.gpu_name, args.gpu, args.num_nodes, args.host_memory_gb
    )
    args.attn_implementation = packed_rows_kernel(args, machine, config)
    full, lora = for_the_run(args, full), for_the_run(args, lora, is_lora=True)
    fpt = metrics.flops_per_token(config, matmul_weights, args.block_size)
    dp_shard = dp_shard_of(args, machine)
    out = []
    for shapes, is_lora in ((full, False), (lora, True)):
        result = memory_plan.make_plan(
            shapes,
            machine,
            args.block_size,
            args.global_batch_size,
            lora=is_lora,
            mfu=args.mfu,
            flops_per_token=fpt,
            dp_shard=dp_shard,
            cp=args.cp,
        )
        if result.step_seconds is not None:  # dpo: two sequences per pair; dpo, grpo: the reference's forward (a third)
            compute = result.step_seconds - result.offload_seconds
            # grpo with β > 0: a forward of the reference once a round, LoRA's (its base) too
            forward = shapes.reference or (shapes.generation is not None and shapes.generation.beta > 0)
            result.step_seconds = compute * shapes.sequences_per_item * (4 / 3 if forward else 1)
            result.step_seconds += result.offload_seconds
        if args.per_device_train_batch_size != 1:
            result.rows = [
                memory_plan.row_for(
                    shapes,
                    machine,
                    r.strategy,
                    r.precision,
                    r.activation_checkpointing,
                    is_lora,
                    args.per_device_train_batch_size,
                    args.block_size,
                    dp_shard,
                    cp=args.cp,
                )
                for r in result.rows
            ]
        out.append(result)
    if args.finetune == "lora":
        out[1].notes += qlora_advice(args, out[1], targets, dp_shard, fpt)
    for result, shapes in zip(out, (full, lora)):
        result.notes += experts_lines(args, shapes, machine)
    for result in out:
        result.notes += grpo_advice(result, out[1])
    return out[0], out[1]


def engines_block_size(args: argparse.Namespace, given: int | None, config) -> int:
    """The block size as the engines take it: refused past the model's positions; not given, at most 1024 and the
    model's own limit (grpo: its prompt and completion lengths, which `settled` put in)."""
    from anygpu.model import modeling

    return modeling.resolve_block_size(
        args.block_size if given is not None or args.objective == "grpo" else None, config
    )


def both_shapes(args: argparse.Namespace, targets: tuple[str, ...]) -> tuple[Shapes, Shapes, object, int]:
    """(full fine-tuning's shapes, LoRA's, the config, the matmul weights a token is multiplied by); --ep checked."""
    full, config, matmul_weights = load_shapes(args.model_name_or_path, args.config_name)
    lora, _, _ = load_shapes(
        args.model_name_or_path, args.config_name, args.lora_r, targets, load_in_4bit=args.finetune == "qlora"
    )
    check_ep(args.ep, full, config.model_type)
    return full, lora, config, matmul_weights


def packed_rows_kernel(args: argparse.Namespace, machine: Machine, config) -> str:
    """The kernel the engines would run: the one named, else sdpa, and for packed rows on NVIDIA GPUs varlen (where
    --cp splits the heads), as `varlen_attention.chosen_by_default` decides in a run (bf16, the plan's GPU rows)."""
    from anygpu.runtime import context_parallel

    if args.attn_implementation:
        return args.attn_implementation
    name = machine.gpu_name.upper()
    nvidia = machine.gpu_memory_bytes > 0 and not any(w in name for w in ("AMD", "INSTINCT", "MI2", "MI3"))
    splits = args.cp == 1 or context_parallel.splits_heads(config, args.cp)
    return attention.VARLEN if args.packing == "true" and nvidia and splits else "sdpa"


def for_the_run(args: argparse.Namespace, shapes: Shapes, is_lora: bool = False) -> Shapes:
    """The model's shapes with what the run adds: DPO's pairs (and a frozen reference unless precomputed; LoRA's is
    its base), GRPO's rounds (and a frozen reference for β > 0; LoRA's is its base), packed rows' dense masks, the
    optimizer state, --ep. `args`: `settled`."""
    if args.objective == "dpo":
        reference = args.precompute_ref_log_probs == "false" and not is_lora
        shapes = dataclasses.replace(shapes, sequences_per_item=2, reference=reference)
    if args.objective == "grpo":
        share = args.vllm_gpu_memory_utilization if args.use_vllm == "true" else 0.0
        generation = memory_plan.Generation(
            args.global_batch_size, args.max_prompt_length, args.max_completion_length, args.num_generations,
            args.beta, share,
        )  # fmt: skip
        shapes = dataclasses.replace(shapes, generation=generation, reference=args.beta > 0 and not is_lora)
    dense_mask = args.packing == "true" and args.attn_implementation in attention.DENSE_MASK
    return dataclasses.replace(shapes, dense_mask=dense_mask, optim=state_kind(args.optim, args.optim_args), ep=args.ep)


def check_ep(ep: int, shapes: memory_plan.Shapes, model_type: str) -> None:
    """--ep on a model without experts, or not dividing them: refused (ValueError: one line, exit 2)."""
    if ep > 1 and not shapes.layer_expert_numel:
        raise ValueError(f"--ep {ep}: {model_type} has no experts to split; leave --ep out.")
    if shapes.num_experts and shapes.num_experts % ep:
        raise ValueError(f"--ep {ep} does not divide the {shapes.num_experts} experts of {model_type}.")


def experts_lines(args: argparse.Namespace, shapes: memory_plan.Shapes, machine: Machine) -> list[str]:
    """A MoE model's line: its experts, what --ep E gathers per layer, the all-to-all per step, the E to use."""
    if not shapes.layer_expert_numel:
        return []
    per_node = machine.num_gpus // max(1, machine.num_nodes)
    best = max(d for d in range(1, per_node + 1) if shapes.num_experts % d == 0 and per_node % d == 0)
    e = 2  # bf16, the precision a plan recommends on GPUs
    gathered = lambda s: gib(memory_plan.gathered_layer_numel(s) * e) + " GiB"  # noqa: E731
    tokens = args.global_batch_size * args.block_size // max(1, machine.num_gpus)
    line = (
        f"experts: {shapes.num_experts} in each of {shapes.moe_layers} MoE layers (top {shapes.experts_per_token}), "
        f"{gib(shapes.layer_expert_numel * e)} of a layer's {gib(shapes.layer_param_numel * e)} GiB in bf16"
    )
    if shapes.ep == 1:
        split = dataclasses.replace(shapes, ep=best)
        return [
            line + f"; every GPU gathers them all with each layer ({gathered(shapes)}).",
            f"  --ep {best} (E divides the experts and a node's {per_node} GPUs): {shapes.num_experts // best} per GPU, "
            f"gathered layer {gathered(split)}; all-to-all {gib(memory_plan.all_to_all_bytes(split, tokens, 'bf16'))} "
            "GiB sent per GPU per step (docs/moe.md).",
        ]
    volume = memory_plan.all_to_all_bytes(shapes, tokens, "bf16")
    return [
        line + f"; --ep {shapes.ep}: {shapes.num_experts // shapes.ep} per GPU, gathered layer {gathered(shapes)}, "
        f"all-to-all {gib(volume)} GiB sent per GPU per step ({tokens} tokens each; E ≤ a node's {per_node} GPUs keeps it "
        "on NVLink/xGMI)."
    ]


def qlora_advice(args: argparse.Namespace, lora: PlanResult, targets, dp_shard, fpt: float) -> list[str]:
    """Where LoRA over the bf16 base needs offload or fits nothing: whether a 4-bit base (QLoRA) fits on the GPUs."""
    rec = lora.recommended
    if not lora.machine.gpu_memory_bytes or (rec is not None and not rec.cpu_bytes):
        return []
    four, _, _ = load_shapes(args.model_name_or_path, args.config_name, args.lora_r, targets, load_in_4bit=True)
    four = for_the_run(settled(args), four, is_lora=True)  # DPO's pairs, GRPO's rounds, the mask, the optimizer
    alt = memory_plan.make_plan(
        four, lora.machine, args.block_size, args.global_batch_size, lora=True, mfu=args.mfu, flops_per_token=fpt,
        dp_shard=dp_shard, cp=args.cp,
    )  # fmt: skip
    row = alt.recommended
    if row is None or row.cpu_bytes:
        return []
    return [
        f"  or without offload, the base in 4 bits (QLoRA): --use_peft true --load_in_4bit true with {row.strategy}, "
        f"the FSDP2 engine (peak ≈ {gib(row.total)} GiB per GPU; anygpu plan --finetune qlora; "
        "docs/memory.md#qlora-a-4-bit-base)"
    ]


def dp_shard_of(args: argparse.Namespace, machine: Machine) -> int | None:
    """HSDP's shard group: --dp_shard, else the GPUs per node (as the FSDP2 engine's default mesh)."""
    if args.dp_shard is not None:
        return args.dp_shard
    return machine.gpus_per_node if machine.num_gpus and machine.num_nodes > 1 else None


def ckpt_word(checkpointing: bool | str, on: str, off: str) -> str:
    """A row's activation checkpointing in a word: `on`/`off`, or `sel` (selective)."""
    return "sel" if checkpointing == memory_plan.SELECTIVE else on if checkpointing else off


def gib(n: int) -> str:
    return f"{n / GIB:.2f}"


def other(per_gpu: dict[str, int]) -> int:
    """The table's `other` column: gathered units, bf16 copies, the lean loss's head gradient, packed rows' dense
    attention mask, and what the framework reserves."""
    return per_gpu["transient"] + per_gpu.get("attention_mask", 0) + per_gpu["reserved"]


def table(result: PlanResult, title: str) -> list[str]:
    grpo = result.shapes.generation is not None  # a column more: a round's generation peak (total: the larger)
    gen_head = f"{'gen*':>8} " if grpo else ""
    lines = [
        title,
        f"{'strategy':<14} {'prec':<5} {'ckpt':<4} {'params':>8} {'grads':>8} {'optim':>8} {'activ*':>8} "
        f"{'other':>7} {gen_head}{'total':>8} {'cpu':>7}  fits",
    ]
    for r in result.rows:
        b = r.per_gpu_bytes
        gen = f"{gib(r.generation_peak or b.get('vllm', 0)):>8} " if grpo else ""  # vLLM: its engine's share
        lines.append(
            f"{r.strategy:<14} {r.precision:<5} {ckpt_word(r.activation_checkpointing, 'yes', 'no'):<4} "
            f"{gib(b['parameters'] + b.get('reference', 0)):>8} {gib(b['gradients']):>8} {gib(b['optimizer']):>8} "
            f"{gib(b['activations']):>8} {gib(other(b)):>7} {gen}{gib(r.total):>8} "
            f"{gib(r.cpu_bytes):>7}  {'yes' if r.fits else 'no'}"
        )
    return lines


def nothing_fits(result: PlanResult) -> list[str]:
    """The recommendation where no row fits: what would."""
    n = max(1, result.machine.num_gpus) // result.cp  # the data-parallel ranks
    if not result.machine.gpu_memory_bytes:
        return ["recommendation: no GPU memory known (no GPU detected): pass --num_gpus and --gpu_memory_gb"]
    if result.cp_advice is not None:
        cp, row = result.cp_advice
        return [
            f"recommendation: one {result.block_size}-token sequence does not fit one GPU: split it with context "
            f"parallelism, {row.accelerate_config} "
            f"(fsdp2, peak ≈ {gib(row.total)} GiB of {gib(result.machine.gpu_memory_bytes)} GiB per GPU; "
            f"the global batch is then split over {n // cp} data-parallel ranks; docs/long-context.md)"
        ]
    if result.low_bit_advice is not None:
        low, row = result.low_bit_advice
        return [
            f"recommendation: nothing fits with AdamW's fp32 moments; with them in {LOW_BIT[low]} bits: --optim {low}, "
            f"{row.strategy}, {row.precision}, activation checkpointing "
            f"{ckpt_word(row.activation_checkpointing, 'on', 'off')}: {engine_of(row)} (peak ≈ {gib(row.total)} GiB of "
            f"{gib(result.machine.gpu_memory_bytes)} GiB per GPU; docs/memory.md#low-bit-optimizer-state)"
        ]
    host_bound = [r for r in result.rows if r.cpu_bytes and not memory_plan.fits_host(r.host_bytes, result.machine)]
    if host_bound:
        need = min(r.host_bytes["offloaded"] for r in host_bound)
        return [
            f"recommendation: nothing fits: offload needs {gib(need)} GiB of host memory per node and the node "
            f"has {gib(result.machine.host_memory_bytes)} GiB; more nodes (each holds its own GPUs' shards), "
            "or LoRA"
        ]
    if result.shapes.generation is not None:  # what to lower: `grpo_advice`, in the notes
        return [
            "recommendation: nothing fits a GRPO step on these GPUs: its training and a round's generation must "
            "both fit, with activation checkpointing at best (offload is refused under grpo)"
        ]
    return [
        "recommendation: nothing fits, even with offload and checkpointing: more GPUs, a shorter --block_size, or LoRA"
    ]


def engine_of(row: Row) -> str:
    """How to run a row: its accelerate config (either engine), or the FSDP2 engine's command where it is its alone."""
    if row.accelerate_config.startswith("run_fsdp_standalone.py"):
        return row.accelerate_config
    return f"accelerate config accelerate_configs/{row.accelerate_config}.yaml or the FSDP2 engine"


def _where(result: PlanResult, rec) -> str:
    """The engine and config (or the FSDP2 engine's flags) that run the recommended row."""
    where = (
        "the FSDP2 engine, run_fsdp_standalone.py (the HF engine trains pairs under DDP and ZeRO-2 only)"
        if result.shapes.sequences_per_item > 1 and rec.strategy == "fsdp2"
        else f"accelerate config accelerate_configs/{rec.accelerate_config}.yaml"
    )
    if result.shapes.four_bit:  # QLoRA: the FSDP2 engine's alone
        where = "the FSDP2 engine, run_fsdp_standalone.py --use_peft true --load_in_4bit true"
    grpo = result.shapes.generation is not None  # the FSDP2 engine's alone: its command
    if grpo:
        where = rec.accelerate_config + " --use_peft true --load_in_4bit true" * result.shapes.four_bit
    if rec.strategy == "fsdp2_offload":  # over every GPU: the engine's default mesh shards within a node
        wide = f" --dp_shard {result.machine.num_gpus}" if result.machine.num_nodes > 1 else ""
        where = f"the FSDP2 engine with --cpu_offload true{wide} (run_fsdp_standalone.py), or {where}"
    return where


def _step_time_line(result: PlanResult) -> str:
    """The estimated step time and MFU (offload's share; grpo: training only)."""
    offloaded = (
        f", {result.offload_seconds:.2f} s of it offload's (the CPU optimizer step at "
        f"{memory_plan.HOST_BANDWIDTH / 1e9:.0f} GB/s of host memory bandwidth per node, and the copies the "
        f"compute does not hide at {memory_plan.PCIE_BANDWIDTH / 1e9:.0f} GB/s per GPU)"
        if result.offload_seconds
        else ""
    )
    generating = (
        "; training only: a round's generation adds its own time, memory-bound (docs/grpo.md)"
        if result.shapes.generation is not None
        else ""
    )
    return (
        f"  estimated step time {result.step_seconds:.2f} s at MFU {result.mfu:.0%} "
        f"({result.flops_per_token / 1e9:.2f} GFLOP/token){offloaded}{generating}"
    )


def recommendation(result: PlanResult) -> list[str]:
    rec = result.recommended
    n = max(1, result.machine.num_gpus) // result.cp  # the data-parallel ranks
    if rec is None:
        return nothing_fits(result)
    where = _where(result, rec)
    grpo = result.shapes.generation is not None
    lines = [
        f"recommendation: {rec.strategy}, {rec.precision}, activation checkpointing "
        f"{ckpt_word(rec.activation_checkpointing, 'on', 'off')}: {where}"
        if " " not in rec.accelerate_config or result.shapes.four_bit or grpo
        else f"recommendation: {rec.strategy}, {rec.precision}: {rec.accelerate_config}",
        f"  global batch {result.global_batch_size}{' completions' * (result.shapes.generation is not None)} = "
        f"{rec.micro_batch} per device × {n} devices × "
        f"{result.gradient_accumulation_steps} accumulation step{'' if result.gradient_accumulation_steps == 1 else 's'} "
        f"(peak ≈ {gib(rec.total)} GiB of {gib(result.machine.gpu_memory_bytes)} GiB per GPU)",
        f"  host RAM on node 0: {gib(rec.host_bytes['loading'])} GiB to load the model, "
        + (
            f"{gib(rec.host_bytes['exporting'])} GiB to export the adapter, {gib(rec.host_bytes['merging'])} GiB "
            "with --merge_lora (fp32; see docs/memory.md)"
            if "merging" in rec.host_bytes
            else f"{gib(rec.host_bytes['exporting'])} GiB to export it (fp32; see docs/memory.md)"
        ),
    ]
    if rec.cpu_bytes:
        lines.append(offload_line(result, rec))
    if result.cp_advice is not None:
        cp, row = result.cp_advice
        lines.append(
            f"  or without offload, each sequence split over {cp} GPUs (context parallelism): {row.accelerate_config} "
            f"(peak ≈ {gib(row.total)} GiB per GPU; docs/long-context.md)"
        )
    if result.shapes.generation is not None:
        lines.append(grpo_peak_line(result, rec) if rec.generation_bytes else vllm_peak_line(rec))
    lines += optim_lines(result)
    if result.step_seconds is not None:
        lines.append(_step_time_line(result))
    return lines


def optim_lines(result: PlanResult) -> list[str]:
    """The low-bit optimizer the plan counts, or the one that would spare the recommended offload."""
    rec, optim = result.recommended, result.shapes.optim
    if rec is not None and optim != FP32:
        return [
            f"  with {flag(optim)} (either engine; AdamW's moments: {gib(rec.per_gpu_bytes['optimizer'])} GiB per GPU, "
            "docs/memory.md#low-bit-optimizer-state)"
        ]
    if result.low_bit_advice is None:
        return []
    low, row = result.low_bit_advice
    return [
        f"  or without offload, AdamW's moments in {LOW_BIT[low]} bits: --optim {low} with {row.strategy}, "
        f"{row.precision}, activation checkpointing {ckpt_word(row.activation_checkpointing, 'on', 'off')} "
        f"(peak ≈ {gib(row.total)} GiB per GPU; docs/memory.md#low-bit-optimizer-state)"
    ]


def offload_line(result: PlanResult, rec: memory_plan.Row) -> str:
    """The host memory an offloaded recommendation takes on each node, against the node's where known."""
    machine = result.machine
    have = (
        f"the node has {gib(machine.host_memory_bytes)} GiB"
        if machine.host_memory_bytes
        else "not checked against the node's: give --host_memory_gb"
    )
    return (
        f"  host RAM per node for the offloaded state: {gib(rec.host_bytes['offloaded'])} GiB ({machine.gpus_per_node} "
        f"GPUs × {gib(rec.cpu_bytes)} GiB of fp32 parameters, gradients and AdamW moments; {have})"
    )


def objective_lines(result: PlanResult) -> list[str]:
    """--objective dpo or grpo: what the plan counts for it."""
    if result.shapes.generation is not None:
        return grpo_lines(result)
    if result.shapes.sequences_per_item == 1:
        return []
    ref = (
        "a frozen reference copy in the compute dtype, in params (LoRA: none, its base is the reference)"
        if result.shapes.reference
        else "no reference in memory (its log-probs precomputed)"
    )
    return [
        f"objective dpo: micro-batches and the global batch count pairs (two sequences each); {ref}; strategies: "
        "ddp (either engine), zero2 (the HF engine), fsdp2 and hsdp with the FSDP2 engine (run_fsdp_standalone.py)"
    ]


def grpo_lines(result: PlanResult) -> list[str]:
    """--objective grpo: what a step and a round hold."""
    shapes, machine = result.shapes, result.machine
    gen = shapes.generation
    rows = gen.rows_per_rank(machine)
    lora = shapes.num_trainable < shapes.num_params
    if gen.beta == 0:
        ref = "no reference (--beta 0)"
    elif lora:
        ref = "no reference copy (LoRA: its base, the adapter disabled, is the reference)"
    else:
        ref = f"--beta {gen.beta:g}: a frozen reference in the compute dtype, sharded like the policy (in params)"
    per = memory_plan.kv_cache_bytes(shapes, 1, gen.row_length, "bf16")
    weights = memory_plan.gathered_model_bytes(shapes, "fsdp2", "bf16", 2)
    gathered = gib(weights) + (" GiB: the 4-bit base in NF4, the rest in bf16" if shapes.four_bit else " GiB in bf16")
    how = (
        f"with the whole model gathered in the compute dtype ({gathered}, on every GPU at once) and a KV cache of "
        f"{per / 2**20:.0f} MiB a completion"
    )
    if gen.vllm_share:
        share = memory_plan.vllm_bytes(shapes, machine)
        cache = max(0, share - weights)
        how = (
            f"by its vLLM engine, which holds {gen.vllm_share:g} of the GPU ({gib(share)} GiB) throughout: the model "
            f"in bf16 ({gib(weights)} GiB) and {gib(cache)} GiB of KV cache, {cache // per} completions of "
            f"{per / 2**20:.0f} MiB at once"
        )
    return [
        f"objective grpo: the global batch counts completions ({gen.global_batch_size // gen.num_generations} prompts "
        f"× {gen.num_generations}); each GPU generates its {rows} {how} "
        f"({gen.prompt_length} + {gen.completion_length} tokens, bf16); micro-batches of completions train on rows of "
        f"{gen.row_length} tokens; {ref}; strategies: fsdp2 and hsdp, the FSDP2 engine's alone "
        "(run_fsdp_standalone.py; no offload, --cp or --ep under grpo)"
    ]


def grpo_peak_line(result: PlanResult, row: Row) -> str:
    """A grpo row's two peaks: a round's generation, with what it holds, and a training step."""
    gen, b = result.shapes.generation, row.generation_bytes
    state = sum(row.per_gpu_bytes.get(k, 0) for k in ("parameters", "optimizer", "reference"))
    return (
        f"  generation peak ≈ {gib(row.generation_peak)} GiB per GPU: the sharded state {gib(state)} + the model "
        f"gathered in {row.precision} {gib(b['gathered'])} + the KV cache of {gen.rows_per_rank(result.machine)} "
        f"completions × {gen.row_length} tokens {gib(b['kv_cache'])} + prefill and sampler {gib(b['working'])} (+ "
        f"{gib(row.per_gpu_bytes['reserved'])} reserved); training peak ≈ {gib(row.training_peak)} GiB"
    )


def vllm_peak_line(row: Row) -> str:
    """--use_vllm: one peak, the training step's with the engine's share beside it."""
    share = row.per_gpu_bytes["vllm"]
    return (
        f"  peak ≈ {gib(row.total)} GiB per GPU: the training step {gib(row.total - share)} + the vLLM engine's share "
        f"{gib(share)} (held throughout; no gathered copy)"
    )


def grpo_advice(result: PlanResult, lora: PlanResult) -> list[str]:
    """--objective grpo and nothing fits: which of its two peaks does not, and what to lower (the completions a
    GPU generates at once, their length, the sharded state, the trained parameters)."""
    shapes, machine = result.shapes, result.machine
    gen = shapes.generation
    if gen is None or result.recommended is not None or not machine.gpu_memory_bytes:
        return []
    if gen.vllm_share:
        return vllm_advice(result)
    is_lora = shapes.num_trainable < shapes.num_params
    # the least a step can hold: FSDP2 over every GPU, bf16, full checkpointing, one completion a micro-batch
    row = memory_plan.row_for(shapes, machine, "fsdp2", "bf16", True, is_lora, 1, result.block_size)
    budget = int(machine.gpu_memory_bytes * memory_plan.SAFETY)
    fixed = row.generation_peak - row.generation_bytes["kv_cache"] - row.generation_bytes["working"]
    lines = [
        f"grpo: with bf16 and activation checkpointing, a training step peaks at {gib(row.training_peak)} GiB and a "
        f"round's generation at {gib(row.generation_peak)} GiB per GPU, against {gib(budget)} GiB usable "
        f"({memory_plan.SAFETY:.0%} of the GPU)"
    ]
    if fixed > budget:
        lines.append(_grpo_state_line(row, fixed, budget, max(1, machine.num_gpus)))
    else:
        lines += _grpo_completion_lines(result, row, fixed, budget)
    if not is_lora:
        lines.append(_grpo_lora_line(lora, fixed > budget))
    return lines


def vllm_advice(result: PlanResult) -> list[str]:
    """--use_vllm and nothing fits: the engine's share too small for the model, or too large beside training."""
    shapes, machine = result.shapes, result.machine
    gen, gpu = shapes.generation, machine.gpu_memory_bytes
    weights = memory_plan.gathered_model_bytes(shapes, "fsdp2", "bf16", 2)
    need = weights + memory_plan.kv_cache_bytes(shapes, 1, gen.row_length, "bf16")
    if need > gpu * memory_plan.SAFETY:
        return [
            f"grpo --use_vllm: the model's bf16 weights ({gib(weights)} GiB) exceed what one GPU's engine can hold; "
            "leave --use_vllm out (the policy's own generation over a 4-bit base gathers it in NF4)"
        ]
    if need > memory_plan.vllm_bytes(shapes, machine):
        return [
            f"grpo --use_vllm: the engine's share ({gib(memory_plan.vllm_bytes(shapes, machine))} GiB) cannot hold the "
            f"model's bf16 weights and a completion's cache ({gib(need)} GiB): --vllm_gpu_memory_utilization "
            f"{math.ceil(need / gpu * 100) / 100:.2f} or more"
        ]
    return [
        f"grpo --use_vllm: the training step does not fit beside the engine's share "
        f"({gib(memory_plan.vllm_bytes(shapes, machine))} GiB): a smaller --vllm_gpu_memory_utilization (at least "
        f"{math.ceil(need / gpu * 100) / 100:.2f}), LoRA, or more GPUs"
    ]


def _grpo_state_line(row, fixed: int, budget: int, n: int) -> str:
    """The sharded state and the gathered model exceed a GPU before any completion: whether more GPUs help."""
    gathered, reserved = row.generation_bytes["gathered"], row.per_gpu_bytes["reserved"]
    state = fixed - gathered - reserved
    if gathered + reserved >= budget:
        more = "more GPUs cannot help (each gathers the whole model)"
    else:
        least = -(-state * n // (budget - gathered - reserved))
        more = f"about {least} GPUs or more would shrink the sharded state enough (not the gathered copy)"
    return (
        f"  before any completion, the sharded state ({gib(state)} GiB) and the model gathered for generation "
        f"({gib(gathered)} GiB, the whole model on every GPU) exceed it: fewer or shorter completions cannot help; "
        f"{more}"
    )


def _grpo_completion_lines(result: PlanResult, row, fixed: int, budget: int) -> list[str]:
    """Too many completions a GPU generates at once, or a training row too long: what to lower, with numbers."""
    shapes, machine = result.shapes, result.machine
    gen, n = shapes.generation, max(1, machine.num_gpus)
    rows = gen.rows_per_rank(machine)
    per_row = memory_plan.kv_cache_bytes(shapes, 1, gen.row_length, "bf16") + (
        memory_plan.generation_working_bytes(shapes, 1, gen.prompt_length, "bf16")
    )
    lines = []
    fit = (budget - fixed) // per_row
    if fit < rows:
        step = math.lcm(gen.num_generations, n)  # whole groups, split evenly over the GPUs
        groups = fit * n // step * step
        kv_token = memory_plan.kv_cache_bytes(shapes, rows, 1, "bf16")
        working = memory_plan.generation_working_bytes(shapes, rows, gen.prompt_length, "bf16")
        shorter = (budget - fixed - working) // kv_token - gen.prompt_length if kv_token else 0
        ways = []
        if fit:
            batch = (
                f"--global_batch_size {groups} or less (whole groups of --num_generations {gen.num_generations} "
                f"over {n} GPUs) or " if groups else ""
            )  # fmt: skip
            ways.append(f"fewer completions per GPU: {batch}about {-(-gen.global_batch_size // fit)} GPUs")
        if shorter >= 1:
            ways.append(f"a shorter --max_completion_length, {shorter} or less")
        lines.append(
            f"  generation: {rows} completions per GPU at once need {gib(rows * per_row)} GiB of KV cache and "
            f"working memory ({per_row / 2**20:.0f} MiB each) beside {gib(fixed)} GiB of weights and state; "
            + (f"{fit} fit. Lower: " + "; ".join(ways) if ways else "not one fits")
        )
    if row.training_peak > budget:
        lines.append(
            f"  training: one completion a micro-batch ({gen.row_length} tokens) peaks at "
            f"{gib(row.training_peak)} GiB: a shorter --max_completion_length or --max_prompt_length, or more GPUs"
        )
    return lines


def _grpo_lora_line(lora: PlanResult, state_exceeds: bool) -> str:
    """Whether LoRA would fit a GRPO run full fine-tuning does not."""
    if lora.recommended is not None:
        return (
            f"  LoRA fits: --finetune lora (peak ≈ {gib(lora.recommended.total)} GiB per GPU; its frozen base is 2 "
            "bytes a parameter, without gradients or AdamW state, and is the reference)"
        )
    if state_exceeds:
        return (
            "  LoRA does not fit either: its base is gathered whole for generation too; a 4-bit base (NF4) gathers "
            "about a quarter of it: anygpu plan --finetune qlora"
        )
    return "  LoRA does not fit either: its generation holds the same KV cache (anygpu plan --finetune lora)"


def hsdp_mesh(result: PlanResult) -> dict | None:
    """R × S of the hsdp rows, or None when there are none."""
    if not any(r.strategy == memory_plan.HSDP for r in result.rows):
        return None
    return {"dp_replicate": result.machine.num_gpus // result.dp_shard, "dp_shard": result.dp_shard}


def to_json(full: PlanResult, lora: PlanResult) -> dict:
    def rec(r: PlanResult) -> dict | None:
        if r.recommended is None:
            return None
        return {
            **r.recommended.to_json(),
            "gradient_accumulation_steps": r.gradient_accumulation_steps,
            "step_seconds": r.step_seconds,
            "offload_seconds": r.offload_seconds,
            "mfu": r.mfu,
        }

    m = full.machine
    return {
        "model": {
            "parameters": full.shapes.num_params,
            "lora_trainable_parameters": lora.shapes.num_trainable,
            "layers": full.shapes.num_layers,
            "hidden_size": full.shapes.hidden_size,
            "vocab_size": full.shapes.vocab_size,
        },
        "machine": {
            "num_gpus": m.num_gpus,
            "gpu_memory_bytes": m.gpu_memory_bytes,
            "gpu_name": m.gpu_name,
            "source": m.source,
            "num_nodes": m.num_nodes,
            "host_memory_bytes": m.host_memory_bytes,
        },
        "block_size": full.block_size,
        "global_batch_size": full.global_batch_size,
        "grpo": grpo_json(full),
        "hsdp": hsdp_mesh(full),
        "activations_are_estimates": True,
        "rows": [r.to_json() for r in full.rows + lora.rows],
        "recommended": {"full": rec(full), "lora": rec(lora)},
        "notes": {"full": full.notes, "lora": lora.notes},
    }


def grpo_json(result: PlanResult) -> dict | None:
    """--objective grpo's shapes in the JSON (each row has its generation_bytes and both peaks)."""
    gen = result.shapes.generation
    if gen is None:
        return None
    return {
        **dataclasses.asdict(gen),
        "completions_per_gpu": gen.rows_per_rank(result.machine),
        "kv_cache_bytes_per_completion_bf16": memory_plan.kv_cache_bytes(result.shapes, 1, gen.row_length, "bf16"),
        "gathered_model_bytes_bf16": memory_plan.gathered_model_bytes(result.shapes, "fsdp2", "bf16", 2),
    }


def hsdp_lines(result: PlanResult) -> list[str]:
    mesh = hsdp_mesh(result)
    if mesh is None:
        return []
    return [
        f"hsdp = the FSDP2 engine's mesh {mesh['dp_replicate']} × {mesh['dp_shard']} (dp_replicate × dp_shard): "
        f"states sharded over {mesh['dp_shard']} GPUs, not {result.machine.num_gpus}, replicated "
        f"{mesh['dp_replicate']} times"
    ]


def batch_words(result: PlanResult) -> str:
    """The step's shape: its block and global batch (grpo: its rows' prompt and completion tokens, completions)."""
    gen = result.shapes.generation
    if gen is None:
        return f"block {result.block_size}, global batch {result.global_batch_size}"
    return (
        f"rows of {gen.prompt_length} + {gen.completion_length} tokens, global batch {result.global_batch_size} "
        "completions"
    )


def render(args: argparse.Namespace, full: PlanResult, lora: PlanResult) -> str:
    m = full.machine
    head = [
        f"model: {full.shapes.num_params / 1e6:.1f}M parameters ({full.shapes.num_layers} layers, hidden "
        f"{full.shapes.hidden_size}, vocab {full.shapes.vocab_size}); LoRA r={args.lora_r}: "
        f"{lora.shapes.num_trainable / 1e6:.2f}M trainable",
        f"machine: {m.num_gpus} GPU(s) × {gib(m.gpu_memory_bytes)} GiB {m.gpu_name} ({m.source}); "
        f"{batch_words(full)}, micro-batch {args.per_device_train_batch_size} in the tables",
        "GiB per GPU; activ* = estimate (Korthikanti et al., real shapes); other = gathered units / bf16 "
        f"copies / the lean loss's head gradient / packed rows' attention mask + {gib(memory_plan.RESERVED_BYTES)} GiB reserved; fits = total ≤ {memory_plan.SAFETY:.0%} "
        "of the GPU"
        + (
            "; gen* = a round's generation peak (estimate: the sharded state, the gathered model, the KV cache, "
            "prefill and sampler), total = the larger of it and the training step's"
            if full.shapes.generation is not None
            else ""
        ),
        *hsdp_lines(full),
        *objective_lines(full),
        "",
    ]
    adapted = f"QLoRA (r={args.lora_r}, 4-bit NF4 base)" if lora.shapes.four_bit else f"LoRA (r={args.lora_r})"
    body = table(full, "full fine-tuning") + [""] + table(lora, adapted) + [""]
    chosen = full if args.finetune == "full" else lora
    return "\n".join(head + body + recommendation(chosen) + chosen.notes) + "\n"


@dataclass
class Recommendation:
    """What the interactive launcher offers as defaults."""

    strategy: str | None
    accelerate_config: str
    num_gpus: int
    per_device_train_batch_size: int | None
    gradient_accumulation_steps: int | None


def recommend(
    model_name_or_path: str | None,
    config_name: str | None,
    block_size: int,
    global_batch_size: int,
    num_gpus: int | None = None,
    gpu_memory_gb: float | None = None,
) -> Recommendation:
    args = build_parser().parse_args([])
    args.model_name_or_path, args.config_name = model_name_or_path, config_name
    args.block_size, args.global_batch_size = block_size, global_batch_size
    args.num_gpus, args.gpu_memory_gb = num_gpus, gpu_memory_gb
    full, _ = plan(args)
    rec = full.recommended
    n = full.machine.num_gpus
    if rec is None:  # no GPU (or nothing fits): DDP on whatever there is
        return Recommendation(None, "ddp", n, None, None)
    config = rec.accelerate_config if " " not in rec.accelerate_config else rec.accelerate_config.split()[0]
    return Recommendation(rec.strategy, config, n, rec.micro_batch, full.gradient_accumulation_steps)


def runners_up(result: PlanResult, lora: bool, limit: int = 3) -> list[tuple[Row, int]]:
    """The best fitting setting of each other strategy the plan weighed (--objective dpo and --cp leave some out;
    bf16 and no checkpointing first, largest micro-batch), with its accumulation steps, in the planner's order of
    preference."""
    rec, cp = result.recommended, result.cp
    share = result.global_batch_size // max(1, result.machine.num_gpus // cp)
    weighed = {r.strategy for r in result.rows}
    out = []
    for strategy in memory_plan.PREFERENCE:
        if (rec is not None and strategy == rec.strategy) or strategy not in weighed:
            continue
        for precision, ckpt in (("bf16", False), ("bf16", True), ("fp32", False), ("fp32", True)):
            row = next(
                (
                    r
                    for m in reversed(memory_plan.divisors(share))
                    if (
                        r := memory_plan.row_for(
                            result.shapes, result.machine, strategy, precision, ckpt, lora, m, result.block_size, cp=cp
                        )
                    ).fits
                ),
                None,
            )
            if row is not None:
                out.append((row, share // row.micro_batch))
                break
        if len(out) == limit:
            break
    return out


def compact(args: argparse.Namespace, full: PlanResult, lora: PlanResult) -> str:
    """The answer in a few lines: the recommendation, memory per GPU, and the runners-up."""
    chosen = full if args.finetune == "full" else lora
    m = chosen.machine
    what = {"full": "full fine-tuning", "lora": f"LoRA r={args.lora_r}", "qlora": f"QLoRA r={args.lora_r} (4-bit base)"}
    lines = [
        f"model: {full.shapes.num_params / 1e6:.1f}M parameters ({full.shapes.num_layers} layers, hidden "
        f"{full.shapes.hidden_size}); {what[args.finetune]}; {batch_words(chosen)}",
        f"machine: {m.num_gpus} GPU(s) × {gib(m.gpu_memory_bytes)} GiB {m.gpu_name} ({m.source})",
        *objective_lines(chosen),
    ]
    if chosen.recommended is None:
        if not m.gpu_memory_bytes:
            lines.append(
                "no GPU here and none given: plan for one with --gpu NAME (e.g. h100, mi300x) or "
                "--gpu_memory_gb N, and --num_gpus N"
            )
        else:
            lines += recommendation(chosen) + chosen.notes
        return "\n".join(lines) + "\n"
    lines += recommendation(chosen) + chosen.notes
    others = runners_up(chosen, args.finetune != "full")
    if others:
        lines.append("runners-up (micro-batch × accumulation, memory per GPU):")
        lines += [
            f"  {r.strategy:<14} {r.precision:<5} ckpt {ckpt_word(r.activation_checkpointing, 'on ', 'off'):<3}  "
            f"{r.micro_batch} × {acc}  {gib(r.total)} GiB"
            for r, acc in others
        ]
    lines.append("every strategy and precision: add --table; as JSON: --json")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    problem = check_args(args)
    if problem:
        print(f"anygpu plan: error: {problem}", file=sys.stderr)
        return 2
    try:
        full, lora = plan(args)
    except ValueError as e:
        print(f"anygpu plan: error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(to_json(full, lora), indent=2))
    elif args.table:
        sys.stdout.write(render(args, full, lora))
    else:
        sys.stdout.write(compact(args, full, lora))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The HF Trainer engine (run_hf_standalone.py): the library's data, model and batch math under
Hugging Face's `Trainer`, with whatever strategy `accelerate launch` was configured for.

    accelerate launch --config_file accelerate_configs/ddp.yaml --num_processes N run_hf_standalone.py [config.yaml] [--arg value ...]

Also runs under torchrun (DDP) and as plain `python` (one process; every visible GPU through
nn.DataParallel when there are several). Per optimizer step, G = m · W · A: the global batch G is
fixed, W is the number of data-parallel devices the launcher started, m and A follow.
"""

from __future__ import annotations

import logging
from typing import Any

from anygpu import errors
from anygpu.config.args import DataArguments, HFEngineArguments, ModelArguments, TrainArguments, parse_args
from anygpu.config.optimizers import FP32
from anygpu.engines.hf import strategy as hf_strategy
from anygpu.engines.hf.gpu_count import check_processes_per_node
from anygpu.engines.trunk import startup
from anygpu.errors import UsageError
from anygpu.reliability import run_guard
from anygpu.runtime import distributed, hardware, lazy_deepspeed
from anygpu.train import trackers

logger = logging.getLogger("anygpu")


def check_objective(train_args: TrainArguments, plan: hf_strategy.Plan) -> None:
    """--objective dpo trains under one process, DDP, FSDP and every ZeRO stage (its reference: whole beside an
    unsharded policy, else a frozen copy FSDP2 shards over the processes); not under DataParallel."""
    if train_args.is_dpo and plan.kind not in ("single", "ddp", "fsdp", "deepspeed"):
        raise UsageError(
            f"--objective dpo with the HF engine under {plan.describe()}: one process driving several GPUs has no "
            "process group to shard the reference over; use one process per GPU (accelerate_configs/ddp.yaml, "
            "fsdp.yaml or a DeepSpeed config) or the FSDP2 engine (run_fsdp_standalone.py)."
        )


def refuse_early(
    model_args: ModelArguments, train_args: TrainArguments, engine_args: HFEngineArguments
) -> hf_strategy.Plan:
    """The checks that need no process group (refusing here costs nothing); returns the strategy plan."""
    train_args.report_to = trackers.resolve(train_args.report_to)  # the FSDP2 engine's check and messages
    check_processes_per_node()  # e.g. a config's num_processes: 8 on a 2-GPU node: stop before any work
    for name in ("dp_replicate", "dp_shard"):
        if getattr(train_args, name) is not None:
            raise UsageError(
                f"--{name} {getattr(train_args, name)}: HSDP is the FSDP2 engine's (run_fsdp_standalone.py, "
                "or the launchers' --engine fsdp); with the HF engine leave it out (its FSDP2 and ZeRO "
                "configs shard over every process)."
            )
    if train_args.cp > 1:
        raise UsageError(
            f"--cp {train_args.cp}: context parallelism is the FSDP2 engine's (run_fsdp_standalone.py, or the "
            "launchers' --engine fsdp); accelerate's own (ParallelismConfig cp_size: its FSDP2 plugin, GPUs only, "
            "sdpa) is not wired into the HF engine: use --cp 1 with the HF engine."
        )
    on_cpu = hardware.vendor() == "cpu"
    startup.check_precision(train_args, "hf", on_gpu=not on_cpu)
    startup.check_attention(model_args.attn_implementation, train_args, "hf")
    startup.check_levers(model_args, train_args, "hf")
    plan = hf_strategy.plan(hf_strategy.requested(), on_cpu, engine_args.allow_strategy_fallback)
    check_objective(train_args, plan)
    if train_args.bf16 and on_cpu and plan.kind == "deepspeed":  # --fp16 on a CPU: check_precision refused it
        # use_cpu stays off for DeepSpeed's own CPU accelerator, and Trainer refuses bf16 on a CPU without it
        raise UsageError(
            f"--bf16 true with {plan.describe().removeprefix('strategy: ')} on this machine (no GPU): DeepSpeed's CPU "
            "accelerator trains in fp32 here; leave it out, or use the ddp accelerate config or the FSDP2 engine "
            "(--engine fsdp), which run bf16 on a CPU."
        )
    if train_args.optim_state != FP32 and plan.kind == "deepspeed":
        raise UsageError(
            f"--optim {train_args.optim} under {plan.describe()}: DeepSpeed ZeRO hands the optimizer its own flat "
            "partitions, which this state (low-bit row blocks, bf16 moments) is not built for; use the fsdp or ddp accelerate config, "
            "the FSDP2 engine (--engine fsdp), or --optim adamw_torch."
        )
    hf_strategy.apply_env(plan)
    return plan


def run(
    model_args: ModelArguments, data_args: DataArguments, train_args: TrainArguments, engine_args: HFEngineArguments
) -> dict[str, Any]:
    """Train; return the last logged record (rank 0)."""
    plan = refuse_early(model_args, train_args, engine_args)
    claimed = startup.claim(train_args)  # rank 0 takes --output_dir before the process group exists
    lazy_deepspeed.unwrap_without_importing_deepspeed()  # Trainer unwraps the model at start-up and export
    # Trainer and the data stack take seconds to import: only once the run is known to go ahead.
    from anygpu.engines.hf.run import HFRun

    hf_run = HFRun(model_args, data_args, train_args, engine_args, plan, claimed)
    try:
        return hf_run.train()
    except BaseException:
        hf_run.log.close(failed=True)  # an MLflow or W&B run ends as failed, not left running (no-op once closed)
        raise


def main(argv: list[str] | None = None) -> None:
    def body() -> None:
        try:
            run(*parse_args(argv, extra=(HFEngineArguments,)))
        finally:
            run_guard.release_locks()

    # bad input or a strategy this machine cannot run: one clear message (UsageError); the rest keeps its traceback
    errors.run_main(body, cleanup=lambda: distributed.destroy(sync=False))

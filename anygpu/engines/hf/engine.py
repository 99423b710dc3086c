"""The HF Trainer engine (run_hf_standalone.py): the library's data, model and batch math under
Hugging Face's `Trainer`, with whatever strategy `accelerate launch` was configured for.

    accelerate launch --config_file accelerate_configs/ddp.yaml --num_processes N run_hf_standalone.py [config.yaml] [--arg value ...]

Also runs under torchrun (DDP) and as plain `python` (one process; every visible GPU through
nn.DataParallel when there are several). Per optimizer step, G = m · W · A: the global batch G is
fixed, W is the number of data-parallel devices the launcher started, m and A follow.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from anygpu import errors
from anygpu.checkpoint import export, resume_guard
from anygpu.config.args import (
    DataArguments,
    HFEngineArguments,
    ModelArguments,
    TrainArguments,
    parse_args,
    resolved_dict,
)
from anygpu.config.batch import BatchPlan
from anygpu.engines.hf import strategy as hf_strategy
from anygpu.engines.hf.gpu_count import check_processes_per_node
from anygpu.errors import UsageError
from anygpu.reliability import run_guard
from anygpu.runtime import blocks, distributed, hardware, lazy_deepspeed
from anygpu.train import trackers

if TYPE_CHECKING:
    from anygpu.data.prepare import Prepared

logger = logging.getLogger("anygpu")


def training_arguments(train_args: TrainArguments, plan: hf_strategy.Plan):
    """Trainer's arguments from ours. Batch numbers and max_steps are placeholders until the world
    size (known once the process group exists) and the data (total steps) are."""
    from transformers import TrainingArguments

    return TrainingArguments(
        output_dir=train_args.output_dir,
        max_steps=1,
        per_device_train_batch_size=1,
        gradient_accumulation_steps=1,
        per_device_eval_batch_size=train_args.per_device_eval_batch_size,
        learning_rate=train_args.learning_rate,
        weight_decay=train_args.weight_decay,
        adam_beta1=train_args.adam_beta1,
        adam_beta2=train_args.adam_beta2,
        adam_epsilon=train_args.adam_epsilon,
        warmup_steps=train_args.warmup_steps,
        lr_scheduler_type=train_args.lr_scheduler_type,
        max_grad_norm=train_args.max_grad_norm,
        seed=train_args.seed,
        bf16=train_args.bf16,
        fp16=train_args.fp16,
        tf32=None,  # set by hardware.configure_tf32, which knows ROCm and CPUs
        activation_checkpointing=train_args.gradient_checkpointing,
        activation_checkpointing_kwargs={"use_reentrant": False} if train_args.gradient_checkpointing else None,
        # The loss Trainer logs is the logging step's own (AnygpuTrainer.log), as in the FSDP2 engine.
        logging_strategy="steps",
        logging_steps=train_args.logging_steps,
        logging_nan_inf_filter=False,  # a NaN loss is reported as NaN, not replaced by a running mean
        eval_strategy="no",  # FlowCallback decides when to evaluate and save
        save_strategy="no",
        save_total_limit=None,  # checkpoints are rotated after their atomic rename
        # MetricsWriter sends metrics.jsonl's records to the --report_to trackers, as in the FSDP2 engine.
        # Trainer's own integrations would log its keys, not ours, and its TensorBoardCallback opens
        # SummaryWriter without purge_step, so a resumed run would show the redone steps twice.
        report_to="none",
        disable_tqdm=True,  # MetricsCallback owns the bar
        ddp_timeout=train_args.ddp_timeout,
        ddp_backend=plan.ddp_backend,
        use_cpu=plan.use_cpu,
        ddp_find_unused_parameters=False,
        ignore_data_skip=True,  # our sampler starts at the resume step; Trainer must not skip again
        average_tokens_across_devices=True,  # the loss is the global-batch token mean (see hf_trainer)
        dataloader_num_workers=0,
        remove_unused_columns=False,
        include_num_input_tokens_seen="no",
        eval_on_start=False,  # set once the resume step is known
        skip_memory_metrics=True,
    )


def banner(prep: Prepared, model, train_args: TrainArguments, plan: hf_strategy.Plan, tf32: bool) -> str:
    from anygpu.data.prepare import summary_lines

    return "\n".join(["anygpu HF Trainer engine", *summary_lines(prep, model, train_args, tf32), plan.describe()])


def _resume_step(resume: Path | None, prep: Prepared) -> int:
    if resume is None:
        return 0
    from anygpu.engines.hf.trainer import read_anygpu_state, read_resume_step

    state = read_anygpu_state(resume)
    if state is None:
        raise UsageError(
            f"--resume_from_checkpoint {resume}: not a checkpoint of the HF engine (no anygpu_state.json); a "
            "checkpoint of run_fsdp_standalone.py resumes with that engine."
        )
    if state["global_batch_size"] != prep.plan.global_batch_size:
        raise UsageError(
            f"--resume_from_checkpoint {resume}: trained with --global_batch_size {state['global_batch_size']}; "
            f"resuming with {prep.plan.global_batch_size} would change the data order: pass --global_batch_size {state['global_batch_size']}."
        )
    return read_resume_step(resume)


def _check_resume_world(resume: Path | None, plan: hf_strategy.Plan) -> None:
    """Refuse, before starting anything, a checkpoint of another strategy family, or a ZeRO checkpoint
    (partitioned per process) on another number of processes. DDP-family checkpoints (one process,
    DDP, DataParallel) hold whole tensors and load on any world size."""
    from anygpu.engines.hf.trainer import read_anygpu_state

    state = read_anygpu_state(resume) if resume is not None else None
    if state is None:
        return
    family = {"deepspeed": "DeepSpeed", "fsdp": "FSDP"}
    was, now = family.get(state.get("strategy"), "DDP"), family.get(plan.kind, "DDP")
    if was != now:
        raise UsageError(
            f"--resume_from_checkpoint {resume}: a {was} checkpoint cannot be resumed with {now} (their model and "
            f"optimizer files differ): launch with the config the run started with."
        )
    if plan.kind == "deepspeed" and state["world_size"] != plan.request.num_processes:
        raise UsageError(
            f"--resume_from_checkpoint {resume}: DeepSpeed ZeRO partitions its checkpoints over {state['world_size']} "
            f"processes; resume with --num_processes {state['world_size']} (or convert the checkpoint with DeepSpeed's "
            "ds_to_universal.py), or use the DDP config, whose checkpoints load on any number of processes."
        )


def lean_loss_off_reason(plan: hf_strategy.Plan) -> str | None:
    """Strategies the lean loss stays off under: it calls lm_head per chunk, outside the module hooks they rely on."""
    if plan.kind == "dataparallel":
        return "DataParallel's replicas would call the first GPU's lm_head"
    if plan.kind == "deepspeed" and (plan.request.zero_stage or 2) >= 3:
        return "ZeRO-3 gathers lm_head's weight only for the module's own forward"
    return None


def plan_strategy(plan: hf_strategy.Plan, ds_plugin) -> str:
    """The memory plan's name for the strategy that runs (anygpu/planning/memory_plan.py)."""
    if plan.kind == "fsdp":
        return "fsdp2"
    if plan.kind == "deepspeed":
        stage = 3 if (plan.request.zero_stage or 2) >= 3 else 2
        offload = ds_plugin is not None and ds_plugin.offload_optimizer_device in ("cpu", "nvme")
        return f"zero{stage}" + ("_offload" if offload else "")
    return "ddp"


def run(
    model_args: ModelArguments, data_args: DataArguments, train_args: TrainArguments, engine_args: HFEngineArguments
) -> dict[str, Any]:
    """Train; return the last logged record (rank 0)."""
    train_args.report_to = trackers.resolve(train_args.report_to)  # the FSDP2 engine's check and messages
    check_processes_per_node()  # e.g. a config's num_processes: 8 on a 2-GPU node: stop before any work
    for name in ("dp_replicate", "dp_shard"):
        if getattr(train_args, name) is not None:
            raise UsageError(
                f"--{name} {getattr(train_args, name)}: HSDP is the FSDP2 engine's (run_fsdp_standalone.py, "
                "or the launchers' --engine fsdp); with the HF engine leave it out (its FSDP2 and ZeRO "
                "configs shard over every process)."
            )
    on_cpu = hardware.vendor() == "cpu"
    if train_args.fp16 and on_cpu:
        raise UsageError("--fp16 needs a GPU: on CPU train in fp32 (leave it out) or with --bf16.")
    if train_args.bf16 and not on_cpu and not hardware.supports_bf16():
        raise UsageError("--bf16: this GPU has no bf16; use --fp16 (with loss scaling) or fp32.")
    # Decide the strategy before any process group exists: refusing here costs nothing.
    plan = hf_strategy.plan(hf_strategy.requested(), on_cpu, engine_args.allow_strategy_fallback)
    hf_strategy.apply_env(plan)
    run_guard.claim_output_dir(train_args, errors.rank())  # lock, repairs, used output_dir, rewinds
    # Trainer and the data stack take seconds to import: only once the run is known to go ahead.
    lazy_deepspeed.unwrap_without_importing_deepspeed()  # Trainer unwraps the model at start-up and export
    from transformers.trainer_callback import PrinterCallback, ProgressCallback
    from transformers.utils import logging as hf_logging

    from anygpu.data.prepare import prepare
    from anygpu.engines.hf.trainer import (
        AnygpuTrainer,
        FlowCallback,
        MetricsCallback,
        plain_model_construction,
        read_anygpu_state,
        zero3_state_dict,
    )
    from anygpu.model import dropout, lean_loss, lora, modeling
    from anygpu.runtime.progress import protected
    from anygpu.train import metrics

    hf_logging.disable_progress_bar()  # no "Writing model shards" bars between our lines
    tf32 = hardware.configure_tf32(train_args.tf32)
    targs = training_arguments(train_args, plan)  # joins the process group
    # Rank 0's verdict from its start-up checks (before the process group), broadcast: verified once.
    resume = run_guard.agreed_resume(train_args.resume_from_checkpoint, train_args.output_dir)
    if resume is not None:
        resume_guard.check_engine(resume, "hf")
    _check_resume_world(resume, plan)
    is_main = targs.process_index == 0
    ds_plugin = targs.deepspeed_plugin
    if ds_plugin is not None and ds_plugin.offload_optimizer_device in ("cpu", "nvme"):
        # ZeRO-Offload steps the optimizer on the CPU partitions. DeepSpeed refuses a client
        # optimizer there unless told otherwise; ours is torch's AdamW, the same update as the
        # other strategies and the FSDP2 engine (DeepSpeedCPUAdam would be faster, not the same code).
        ds_plugin.deepspeed_config.setdefault("zero_force_ds_cpu_optimizer", False)
    logging.basicConfig(level=logging.INFO if is_main else logging.WARNING, format="[%(levelname)s] %(message)s")
    if targs.world_size != plan.request.num_processes:
        hf_strategy.check_in_effect(plan, targs.distributed_state.distributed_type.name, targs.world_size)
    # Data-parallel devices: processes, or the GPUs one process drives through DataParallel.
    dp_devices = targs.n_gpu if plan.kind == "dataparallel" else targs.world_size
    info = distributed.DistInfo(targs.process_index, targs.local_process_index, dp_devices, targs.device)
    run_guard.check_ranks(info, resolved_dict(model_args, data_args, train_args, engine_args), train_args.output_dir)
    prep = prepare(model_args, data_args, train_args, info)
    run_guard.check_data_agrees(info, prep.data_fingerprint)
    fingerprint = resume_guard.fingerprint(resolved_dict(model_args, data_args, train_args), prep)
    changed = []
    if resume is not None:
        changed = resume_guard.check(resume, fingerprint, train_args.allow_changed_args)
    probe = None
    if train_args.auto_micro_batch:  # from the plan's estimate (Trainer builds the sharded model later); G unchanged
        from anygpu.planning import auto_batch

        probe = auto_batch.apply(
            prep,
            model_args,
            train_args,
            targs.device,
            plan_strategy(plan, ds_plugin),
            lean=train_args.lean_loss and lean_loss_off_reason(plan) is None,
        )
        print(f"rank {targs.process_index}: micro-batch auto → {prep.plan.per_device_train_batch_size}", flush=True)
    p = prep.plan
    # One process feeds all its GPUs under DataParallel: its micro-batch is m × GPUs, cut by DataParallel.
    sampler_plan = (
        BatchPlan(p.global_batch_size, p.per_device_train_batch_size * dp_devices, 1, p.gradient_accumulation_steps)
        if plan.kind == "dataparallel"
        else p
    )
    targs.per_device_train_batch_size = p.per_device_train_batch_size
    targs.gradient_accumulation_steps = p.gradient_accumulation_steps
    targs.max_steps = prep.total_steps
    start_step = _resume_step(resume, prep)
    end_step = min(prep.total_steps, train_args.stop_at_step or prep.total_steps)
    targs.eval_on_start = train_args.eval_on_start and start_step == 0

    with plain_model_construction(targs.deepspeed_plugin):
        model = modeling.build_full_model(prep.config, model_args, train_args.seed)
    model = lora.wrap(model, model_args)
    if lora.is_peft(model):
        lora.init_adapter(model, train_args.seed)  # the FSDP2 engine's adapter, not peft's draw from the global stream
        if train_args.bf16:
            import torch

            lora.hold_frozen_in(model, torch.bfloat16)  # as the FSDP2 engine and the memory plan
    dropout.install(model, train_args.seed)  # masks keyed by sample, as in the FSDP2 engine
    lean_loss.install(model, train_args.lean_loss, lean_loss_off_reason(plan))
    if train_args.torch_compile:
        for layer in (m for m in model.modules() if isinstance(m, blocks.decoder_layer_classes(model))):
            layer.compile()
    # Counted before DeepSpeed/FSDP partition the parameters.
    fpt = metrics.flops_per_token(
        prep.config, modeling.count_parameters(model, exclude_embeddings=True), prep.block_size
    )
    precision = hardware.matmul_precision(train_args.bf16, train_args.fp16, tf32)
    peak = hardware.peak_flops(hardware.devices()[0].name, precision) if targs.device.type == "cuda" else None
    banner_text = banner(prep, model, train_args, plan, tf32)

    writer = metrics.MetricsWriter(
        train_args.output_dir, is_main, train_args.report_to, start_step if resume is not None else None
    )
    metrics_cb = MetricsCallback(
        writer, prep, train_args, dp_devices, targs.device, fpt, peak, start_step, end_step, is_main
    )
    flow_cb = FlowCallback(train_args, prep.total_steps, end_step, targs.device)
    flow_cb.preemption.watch(model)
    trainer = AnygpuTrainer(
        model=model,
        args=targs,
        train_dataset=prep.datasets["train"],
        callbacks=[metrics_cb, flow_cb],
        prep=prep,
        sampler_plan=sampler_plan,
        start_step=start_step,
        train_config=train_args,
        num_devices=dp_devices,
        strategy=plan.kind,
        fingerprint=fingerprint,
    )
    trainer.remove_callback(PrinterCallback)  # MetricsCallback prints the FSDP2 engine's lines instead
    trainer.remove_callback(ProgressCallback)
    acc = trainer.accelerator
    fsdp_plugin = getattr(acc.state, "fsdp_plugin", None)
    hf_strategy.check_in_effect(
        plan, acc.distributed_type.name, acc.num_processes, getattr(fsdp_plugin, "fsdp_version", None)
    )
    if not trainer.model_accepts_loss_kwargs:
        raise UsageError(
            f"{type(model).__name__}.forward takes no num_items_in_batch: Trainer could not normalise its loss over the "
            "global batch. Use a transformers causal LM whose forward accepts **kwargs, or the FSDP2 engine."
        )

    if is_main:
        print(banner_text, flush=True)
        if probe is not None:
            print(probe.line(), flush=True)
        if resume is not None:
            was = read_anygpu_state(resume)["world_size"]
            print(f"resumed from {resume} at step {start_step} (was {was} devices, now {dp_devices})", flush=True)
            if line := resume_guard.banner_line(changed):
                print(line, flush=True)
        Path(train_args.output_dir, "args.json").write_text(
            json.dumps(
                {**resolved_dict(model_args, data_args, train_args, engine_args), "strategy": plan.describe()},
                indent=2,
                default=str,
            )
        )
        prep.tokenizer.save_pretrained(str(Path(train_args.output_dir) / "tokenizer"))

    if end_step > start_step:
        try:
            trainer.train(resume_from_checkpoint=str(resume) if resume is not None else None)
        except BaseException:
            writer.close(failed=True)  # an MLflow or W&B run ends as failed, not left running
            raise
    elif is_main:
        print(f"nothing to train: the run is at step {start_step} and ends at {end_step}", flush=True)
    if flow_cb.terminated:
        if is_main:
            print(
                f"{flow_cb.preemption.requested}: saved checkpoint-{trainer.state.global_step}, exiting "
                f"(exit {errors.EXIT_PREEMPTED})",
                flush=True,
            )
        writer.close()
        distributed.destroy()
        sys.exit(errors.EXIT_PREEMPTED)
    if end_step == prep.total_steps and end_step > start_step and train_args.export_final:
        final = Path(train_args.output_dir) / "final"
        with protected():  # the preemption watchdog waits for the export, however long
            gathered = zero3_state_dict(trainer.model, is_main)  # None unless ZeRO-3: export gathers the rest
            if lora.is_peft(model):
                out = export.export_adapter(
                    trainer.model,
                    prep.tokenizer,
                    model_args.model_name_or_path,
                    final,
                    targs.process_index,
                    model_args.merge_lora,
                    gathered,
                )
            else:
                out = export.export_safetensors(
                    trainer.model, prep.config, prep.tokenizer, final, targs.process_index, state_dict=gathered
                )
        if is_main and lora.is_peft(model):
            print(f"final adapter: {out} (PeftModel.from_pretrained loads it over the base)", flush=True)
        elif is_main:
            print(f"final model: {out} (AutoModelForCausalLM.from_pretrained loads it)", flush=True)
    writer.close()
    if is_main:
        png = metrics.plot_losses(train_args.output_dir)
        print(f"metrics: {Path(train_args.output_dir) / 'metrics.jsonl'}, curves: {png}", flush=True)
    distributed.destroy()
    return metrics_cb.last


def main(argv: list[str] | None = None) -> None:
    def body() -> None:
        try:
            run(*parse_args(argv, extra=(HFEngineArguments,)))
        finally:
            run_guard.release_locks()

    # bad input or a strategy this machine cannot run: one clear message (UsageError); the rest keeps its traceback
    errors.run_main(body, cleanup=lambda: distributed.destroy(sync=False))

"""One run of the HF engine: the library's data, model and batch math under Hugging Face's `Trainer`, the
run around the step the trunk's (`anygpu.engines.trunk`). Imported once the run is known to go ahead
(`engine.run`): Trainer and the data stack take seconds to import."""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

import torch
import torch.distributed as dist
from transformers import TrainingArguments
from transformers.trainer_callback import PrinterCallback, ProgressCallback
from transformers.utils import logging as hf_logging

from anygpu import errors
from anygpu.checkpoint import resume_guard
from anygpu.config.args import TrainArguments, resolved_dict
from anygpu.config.batch import BatchPlan
from anygpu.data.prepare import Prepared, prepare
from anygpu.engines.hf import construct
from anygpu.engines.hf import strategy as hf_strategy
from anygpu.engines.hf.trainer import (
    AnygpuTrainer,
    TrunkCallback,
    zero3_state_dict,
)
from anygpu.engines.trunk import finish, objectives, reference_model, startup
from anygpu.engines.trunk.log import RunLog
from anygpu.engines.trunk.schedule import SaveClock, Schedule
from anygpu.engines.trunk.state import HF_STATE_FILE, RunState
from anygpu.errors import UsageError
from anygpu.model import dropout, lean_loss, lora, mask_hint, modeling
from anygpu.reliability import run_guard
from anygpu.reliability.preempt import Preemption
from anygpu.runtime import blocks, checkpointing, distributed


def training_arguments(train_args: TrainArguments, plan: hf_strategy.Plan):
    """Trainer's arguments from ours. Batch numbers and max_steps are placeholders until the world
    size (known once the process group exists) and the data (total steps) are."""
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
        tf32=None,  # set by startup.configure_matmuls (hardware.configure_tf32, which knows ROCm and CPUs)
        activation_checkpointing=train_args.gradient_checkpointing,
        activation_checkpointing_kwargs={"use_reentrant": False} if train_args.gradient_checkpointing else None,
        # The loss Trainer logs is the logging step's own (AnygpuTrainer.log), as in the FSDP2 engine.
        logging_strategy="steps",
        logging_steps=train_args.logging_steps,
        logging_nan_inf_filter=False,  # a NaN loss is reported as NaN, not replaced by a running mean
        eval_strategy="no",  # TrunkCallback decides when to evaluate and save (the trunk's Schedule)
        save_strategy="no",
        save_total_limit=None,  # checkpoints are rotated after their atomic rename
        # MetricsWriter sends metrics.jsonl's records to the --report_to trackers, as in the FSDP2 engine.
        # Trainer's own integrations would log its keys, not ours, and its TensorBoardCallback opens
        # SummaryWriter without purge_step, so a resumed run would show the redone steps twice.
        report_to="none",
        disable_tqdm=True,  # the trunk's RunLog owns the bar
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
        # FSDP2 left to accumulate (accelerate's no_sync) holds every micro-batch's unsharded gradients until the
        # last: +4 bytes per parameter on every rank (32 GB at 8B). Reduce-scattered at each micro-batch instead,
        # as the FSDP2 engine does; DDP's gradients are whole anyway, so it keeps syncing once a step.
        accelerator_config={"gradient_accumulation_kwargs": {"sync_each_batch": plan.kind == "fsdp"}},
    )


class HFRun:
    """The constructor builds (process group, checks, data, model, Trainer); `train()` runs it and ends the run."""

    def __init__(self, model_args, data_args, train_args, engine_args, plan: hf_strategy.Plan, claimed) -> None:
        self.args, self.model_args, self.plan = train_args, model_args, plan
        self.resolved = resolved_dict(model_args, data_args, train_args, engine_args)
        hf_logging.disable_progress_bar()  # no "Writing model shards" bars between our lines
        self.tf32 = startup.configure_matmuls(train_args)
        self.targs, self.info = self._join()
        startup.joined(self.info, self.resolved, train_args.output_dir)
        self.resume = startup.resume_target(train_args, claimed, "hf")
        hf_strategy.check_resume_world(self.resume, plan)
        self.prep = prep = without_offsets_under_dataparallel(
            prepare(model_args, data_args, train_args, self.info), plan
        )
        run_guard.check_data_agrees(self.info, prep.data_fingerprint)
        self.fingerprint = resume_guard.fingerprint(resolved_dict(model_args, data_args, train_args), prep)
        self.resumed, self.changed = self._resumed()
        self.probe = self._auto_micro_batch()
        self.schedule = self._schedule()
        self.model = self._build_model()
        if train_args.gradient_checkpointing:  # Trainer enables it (full, non-reentrant): the banner says so
            checkpointing.mark(self.model, "full")
        # counted before DeepSpeed or FSDP partition the parameters
        self.banner = startup.banner("HF Trainer", prep, self.model, train_args, self.tf32, plan.describe())
        fpt, peak = startup.throughput_facts(prep, self.model, train_args, self.tf32, self.targs.device)
        self.log = RunLog(
            prep,
            train_args,
            self.schedule,
            self.info.world_size,
            self.targs.device,
            self.info.is_main,
            fpt,
            peak,
            resumed=self.resume is not None,
        )
        self.preemption = Preemption.of(train_args)
        self.preemption.watch(self.model)
        self.callback = TrunkCallback(
            self.schedule,
            self.log,
            self.preemption,
            self.targs.device,
            SaveClock(train_args.save_every_minutes),
            self.info.is_main,
        )
        self.trainer = self._trainer()
        self.trainer.objective = self._objective(data_args)
        self.banner += "".join(f"\n{line}" for line in objectives.describe(self.trainer.objective))

    def _objective(self, data_args):
        """--objective dpo's, on the model Trainer has put on the device, before it wraps the model or loads a
        checkpoint; a precomputed reference's columns join the training pairs Trainer reads."""
        model = self.trainer.model
        found = objectives.build(
            self.prep, model, self._autocast(model), self.model_args, data_args, self.args, self.info, self._reference,
            policy_runs=not hf_strategy.shards_parameters(self.plan),
        )  # fmt: skip
        self.trainer.train_dataset = self.prep.datasets["train"]
        return found

    def _reference(self):
        """--objective dpo's frozen reference (--ref_model_name_or_path, else the starting model) on the device: whole,
        or under FSDP and ZeRO-3 sharded over every rank by FSDP2 as the FSDP2 engine shards its own."""
        if hf_strategy.shards_parameters(self.plan):
            shape = reference_model.over_every_rank(self.info)
            with construct.plain_model_construction(self.targs.deepspeed_plugin):  # FSDP2's, not zero.Init's
                model = reference_model.build(self.prep, self.model_args, self.args, self.info, shape)
            return reference_model.with_call(model, self._autocast(model))
        args = dataclasses.replace(
            self.model_args,
            model_name_or_path=self.args.ref_model_name_or_path or self.model_args.model_name_or_path,
            config_name=None,
            use_peft=False,
            merge_lora=False,
        )
        config = modeling.fit_config_to_tokenizer(modeling.resolve_config(args), self.prep.tokenizer, False)
        model = construct.build(construct.FULL, config, args, self.args.seed, None).requires_grad_(False)
        dropout.disable(model)
        lean_loss.install(model, self.args.lean_loss, hf_strategy.lean_loss_off_reason(self.plan))
        modeling.flatten_packed_rows(model)
        mask_hint.install(model, self.prep.collator.packed)
        model = model.to(self.targs.device).eval()
        return model, self._autocast(model)

    def _autocast(self, model):
        """`model`'s forward as Trainer's step runs it: under its autocast (bf16/fp16)."""

        def call(**inputs):
            with self.trainer.compute_loss_context_manager():
                return model(**inputs)

        return call

    def _join(self):
        """Trainer's arguments, which join the process group; this process's facts (`DistInfo`)."""
        owns = not dist.is_initialized()
        distributed.check_local_rank()  # before TrainingArguments picks cuda:LOCAL_RANK
        targs = training_arguments(self.args, self.plan)
        ds_plugin = targs.deepspeed_plugin
        if ds_plugin is not None and ds_plugin.offload_optimizer_device in ("cpu", "nvme"):
            # ZeRO-Offload steps the optimizer on the CPU partitions. DeepSpeed refuses a client
            # optimizer there unless told otherwise; ours is torch's AdamW, the same update as the
            # other strategies and the FSDP2 engine (DeepSpeedCPUAdam would be faster, not the same code).
            ds_plugin.deepspeed_config.setdefault("zero_force_ds_cpu_optimizer", False)
        if targs.world_size != self.plan.request.num_processes:
            hf_strategy.check_in_effect(self.plan, targs.distributed_state.distributed_type.name, targs.world_size)
        # Data-parallel devices: processes, or the GPUs one process drives through DataParallel.
        devices = targs.n_gpu if self.plan.kind == "dataparallel" else targs.world_size
        return targs, distributed.DistInfo(targs.process_index, targs.local_process_index, devices, targs.device, owns)

    def _resumed(self) -> tuple[RunState | None, list[str]]:
        """The resumed checkpoint's run state, refused when it cannot continue this run."""
        if self.resume is None:
            return None, []
        state = RunState.read(self.resume, HF_STATE_FILE)
        if state is None:
            raise UsageError(
                f"--resume_from_checkpoint {self.resume}: not a checkpoint of the HF engine (no {HF_STATE_FILE}); "
                "a checkpoint of run_fsdp_standalone.py resumes with that engine."
            )
        state.check_resumable(self.resume, self.prep.plan.global_batch_size)
        return state, resume_guard.check(self.resume, self.fingerprint, self.args.allow_changed_args)

    def _auto_micro_batch(self):
        """--auto_micro_batch, from the plan's estimate (Trainer builds the sharded model later)."""
        lean = self.args.lean_loss and hf_strategy.lean_loss_off_reason(self.plan) is None
        strategy = hf_strategy.plan_strategy(self.plan, self.targs.deepspeed_plugin)
        return startup.auto_micro_batch(
            self.prep, self.model_args, self.args, self.targs.device, strategy, self.info.rank, lean=lean
        )

    def _schedule(self) -> Schedule:
        """The schedule, with Trainer's batch numbers and length set from the plan and the data."""
        p, targs = self.prep.plan, self.targs
        targs.per_device_train_batch_size = p.per_device_train_batch_size
        targs.gradient_accumulation_steps = p.gradient_accumulation_steps
        targs.max_steps = self.prep.total_steps
        start = self.resumed.global_step if self.resumed is not None else 0
        schedule = Schedule.of(self.args, start, self.prep.total_steps)
        targs.eval_on_start = schedule.evaluates_first
        return schedule

    def _build_model(self) -> torch.nn.Module:
        """The model as the FSDP2 engine builds it (seeded initialisation, adapter, keyed dropout, lean loss)."""
        args = self.args
        plugin = self.targs.deepspeed_plugin
        how = construct.kind(self.plan, plugin, self.info.rank)  # no whole fp32 copy per rank where it shards
        model = construct.build(how, self.prep.config, self.model_args, args.seed, plugin)
        construct.size_zero3_buffers(plugin, model, self.info.world_size)
        model = lora.wrap(model, self.model_args, dropout_off=args.dropout_off)
        if lora.is_peft(model):
            lora.init_adapter(model, args.seed)  # the FSDP2 engine's adapter, not peft's draw from the global stream
            if args.bf16:
                lora.hold_frozen_in(model, torch.bfloat16)  # as the FSDP2 engine and the memory plan
        dropout.install(model, args.seed, off=args.dropout_off)  # masks keyed by sample (dpo: off), as the FSDP2 engine
        lean_loss.install(model, args.lean_loss, hf_strategy.lean_loss_off_reason(self.plan))
        modeling.flatten_packed_rows(model)  # flash attention: packed rows as one flattened row, as the FSDP2 engine
        mask_hint.install(model, self.prep.collator.packed)  # no host sync in the masking, as the FSDP2 engine
        if args.torch_compile:
            for layer in blocks.decoder_layers(model):
                layer.compile()
        return model

    def _trainer(self) -> AnygpuTrainer:
        p, info = self.prep.plan, self.info
        # One process feeds all its GPUs under DataParallel: its micro-batch is m × GPUs, cut by DataParallel.
        dataparallel = self.plan.kind == "dataparallel"
        sampler_plan = (
            BatchPlan(
                p.global_batch_size, p.per_device_train_batch_size * info.world_size, 1, p.gradient_accumulation_steps
            )
            if dataparallel
            else p
        )
        trainer = AnygpuTrainer(
            model=self.model,
            args=self.targs,
            train_dataset=self.prep.datasets["train"],
            callbacks=[self.callback],
            prep=self.prep,
            sampler_plan=sampler_plan,
            start_step=self.schedule.start_step,
            train_config=self.args,
            num_devices=info.world_size,
            strategy=self.plan.kind,
            fingerprint=self.fingerprint,
            watched=self.preemption.progress,
        )
        trainer.remove_callback(PrinterCallback)  # the trunk's RunLog prints the FSDP2 engine's lines instead
        trainer.remove_callback(ProgressCallback)
        acc = trainer.accelerator
        fsdp_version = getattr(getattr(acc.state, "fsdp_plugin", None), "fsdp_version", None)
        hf_strategy.check_in_effect(self.plan, acc.distributed_type.name, acc.num_processes, fsdp_version)
        if not trainer.model_accepts_loss_kwargs:
            raise UsageError(
                f"{type(self.model).__name__}.forward takes no num_items_in_batch: Trainer could not normalise its "
                "loss over the global batch. Use a transformers causal LM whose forward accepts **kwargs, or the "
                "FSDP2 engine."
            )
        return trainer

    # ------------------------------------------------------------------ the run
    def train(self) -> dict[str, Any]:
        """Train; end the run (preempted: exit 143); return the last logged record (rank 0)."""
        schedule, info = self.schedule, self.info
        if info.is_main:
            startup.announce(self.banner, self.probe, self._resume_line(), self.changed)
            startup.write_run_files(
                self.args.output_dir, {**self.resolved, "strategy": self.plan.describe()}, self.prep.tokenizer
            )
        if schedule.trains:
            self.trainer.train(resume_from_checkpoint=str(self.resume) if self.resume is not None else None)
        elif info.is_main:
            print(
                f"nothing to train: the run is at step {schedule.start_step} and ends at {schedule.end_step}",
                flush=True,
            )
        if self.callback.terminated:
            self._exit_preempted()
        if schedule.exports and schedule.trains:  # the trained weights: Trainer loads a checkpoint only to train
            dtype = finish.export_dtype(self.args.export_dtype, self.model_args.model_name_or_path, self.args.bf16)
            if getattr(self.trainer, "deepspeed", None) is not None:  # the last evaluation's prefetches, in flight
                self.trainer.deepspeed.empty_partition_cache()
            gathered = zero3_state_dict(self.trainer.model, info.is_main, dtype)  # None unless ZeRO-3
            finish.export_final(
                self.trainer.model,
                self.prep,
                self.model_args,
                self.args,
                info.rank,
                self.preemption.progress,
                gathered,
            )
        self.close()
        finish.curves(self.args.output_dir, info.is_main)
        return self.log.last

    def _resume_line(self) -> str | None:
        if self.resumed is None:
            return None
        return startup.resume_line(
            self.resume, self.schedule.start_step, self.resumed.world_size, self.info.world_size, "devices"
        )

    def _exit_preempted(self) -> None:
        if self.info.is_main:
            print(
                f"{self.preemption.requested}: saved checkpoint-{self.trainer.state.global_step}, exiting "
                f"(exit {errors.EXIT_PREEMPTED})",
                flush=True,
            )
        self.close()
        sys.exit(errors.EXIT_PREEMPTED)

    def close(self) -> None:
        self.log.close()
        self.preemption.close()
        distributed.leave(self.info)


def without_offsets_under_dataparallel(prep: Prepared, plan) -> Prepared:
    """DataParallel cuts every tensor of a batch along its first dimension, the packed samples' offsets too, which
    would then belong to no replica's rows: there the attention finds each replica's offsets from its own rows'
    positions (transformers' flash path, `varlen_attention`) instead of the collator's."""
    if plan.kind != "dataparallel" or prep.collator is None or not getattr(prep.collator, "varlen", False):
        return prep
    return dataclasses.replace(prep, collator=dataclasses.replace(prep.collator, varlen=False))

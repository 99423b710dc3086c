"""The native FSDP2 training loop (run_fsdp_standalone.py).

Per optimizer step, on every rank: its G/D sequences of global batch k, in A micro-batches
of m (G = m·D·A, D = W / C data-parallel ranks; with context parallelism the C ranks of a CP group
read the same sequences and each computes its part of every one). Each micro-batch's loss is its
token-loss sum over the number of target tokens in the *whole global batch* (all-reduced up front,
each token counted once), times W because FSDP averages gradients over all ranks: the gradient is
the global-batch token mean whatever W, C, m and A.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import Any, Iterator

import torch
from tqdm.auto import tqdm

from anygpu import errors
from anygpu.checkpoint import async_store, resume_guard, store
from anygpu.config.args import DataArguments, ModelArguments, TrainArguments, parse_args, resolved_dict
from anygpu.data.loader import StepBatches, read_step, step_loader, stop_workers
from anygpu.data.prepare import Prepared, check_run, prepare
from anygpu.engines.trunk import finish, objectives, reference_model, startup
from anygpu.engines.trunk.evaluator import evaluate_run
from anygpu.engines.trunk.log import RunLog
from anygpu.engines.trunk.schedule import SaveClock, Schedule
from anygpu.engines.trunk.state import RunState
from anygpu.model import dropout, fp8, lean_loss, lora, mask_hint, modeling, moe, qlora
from anygpu.planning import auto_batch
from anygpu.reliability import elastic, run_guard
from anygpu.reliability.preempt import Preemption
from anygpu.runtime import (
    compile_stats,
    context_parallel,
    distributed,
    expert_parallel,
    faults,
    hardware,
    mesh,
    offload,
    parallel,
)
from anygpu.runtime.gc_schedule import GarbageCollection
from anygpu.train import dpo, optim, trackers

logger = logging.getLogger("anygpu")


def mesh_shape(train_args: TrainArguments, world_size: int) -> mesh.MeshShape:
    """R × S × C from --dp_replicate/--dp_shard/--cp, else one replica group per node (refused when they do not fit)."""
    return mesh.resolve(
        train_args.dp_replicate, train_args.dp_shard, world_size, mesh.local_world_size_from_env(), train_args.cp
    )


def fitted_mesh(
    shape: mesh.MeshShape, prep: Prepared, model_args: ModelArguments, train_args: TrainArguments, device
) -> tuple[mesh.MeshShape, str | None]:
    """The default mesh widened where one node's shard of the model state would not fit a rank (`mesh.widen`): a
    GPU's half (the rest is for activations and gathered layers), or under --cpu_offload the node's free host memory
    over its ranks. Unchanged for a mesh the user set, on one node, and for CPU ranks (the host's memory is theirs)."""
    if train_args.dp_replicate is not None or train_args.dp_shard is not None or not shape.is_hsdp:
        return shape, None
    if train_args.cpu_offload:
        budget = int(0.9 * (hardware.host_memory_bytes() or 0) / mesh.local_world_size_from_env())
    elif device.type == "cuda":
        budget = torch.cuda.get_device_properties(device).total_memory // 2
    else:
        return shape, None
    model = adapted(modeling.build_meta_model(prep.config, model_args), model_args, train_args)
    return mesh.widen(shape, lambda group: parallel.state_bytes_per_rank(model, group, train_args.optim_state), budget)


def adapted(model: torch.nn.Module, model_args: ModelArguments, train_args: TrainArguments) -> torch.nn.Module:
    """The meta model with its LoRA adapter (--use_peft), the frozen base in bf16 under --bf16 (as the memory plan
    counts it: 2 bytes per frozen parameter) and its linear weights in 4 bits under --load_in_4bit, before sharding."""
    lora.check_untied_saves(model, model_args.lora_modules_to_save if model_args.use_peft else None)
    model = lora.wrap(model, model_args, dropout_off=train_args.dropout_off)
    if lora.is_peft(model) and train_args.bf16:
        lora.hold_frozen_in(model, torch.bfloat16)
    return qlora.apply(model, model_args.load_in_4bit)


def build_model(
    prep: Prepared,
    model_args: ModelArguments,
    train_args: TrainArguments,
    info: distributed.DistInfo,
    shape: mesh.MeshShape | None = None,
):
    """Meta model → AC / compile / FSDP2 or HSDP → materialised on the device → initial or pretrained weights.
    `shape`: the mesh (default: `mesh_shape`'s)."""
    model = modeling.build_meta_model(prep.config, model_args)
    shape = shape or mesh_shape(train_args, info.world_size)
    fp8.convert(model, train_args.fp8, info.device, parallel.needs_sharding(shape.world_size, train_args.bf16))
    model = adapted(model, model_args, train_args)  # adapter before sharding
    modeling.check_loss_kwargs(model)
    dropout.install(model, train_args.seed, off=train_args.dropout_off)
    # patches lm_head's forward before FSDP2 swaps the classes (grpo: its log-probs keep only the completions' logits)
    lean_loss.install(model, train_args.lean_loss and not train_args.is_grpo)
    modeling.flatten_packed_rows(model)  # flash attention: packed rows as one flattened row
    # the masking need not read the positions back from the GPU (grpo: padded rows, no collator)
    mask_hint.install(model, prep.collator is not None and prep.collator.packed)
    buffers = {n: b.clone() for n, b in model.named_buffers()}
    checkpointing = train_args.gradient_checkpointing_policy if train_args.gradient_checkpointing else None
    if train_args.cpu_offload:  # before any memory is taken: the node's ranks' state must fit its host memory
        per_rank = parallel.state_bytes_per_rank(model, shape.shard_group, train_args.optim_state)
        offload.check_host_memory(per_rank, mesh.local_world_size_from_env(), hardware.host_memory_bytes())
    expert_parallel.check(model, train_args.ep, shape)
    parallel.shard_model(
        model, info.device, shape, train_args.bf16, checkpointing, train_args.torch_compile,
        cpu_offload=train_args.cpu_offload, ep=train_args.ep,
    )  # fmt: skip
    offload.materialize(model, info.device, train_args.cpu_offload)
    if not parallel.is_sharded(model):
        model.tie_weights()  # to_empty gives a plain module's tied parameters separate storage
    modeling.restore_buffers(model, buffers)
    if prep.from_scratch:
        modeling.init_parameters(model, prep.config, train_args.seed)
    else:
        modeling.load_pretrained_weights(model, model_args.model_name_or_path)
    if lora.is_peft(model):
        lora.init_adapter(model, train_args.seed)
    return model


def steps(
    prep: Prepared,
    info: distributed.DistInfo,
    start_step: int,
    end_step: int,
    num_workers: int | None = None,
    cp: context_parallel.CPGroup = context_parallel.NONE,
) -> torch.utils.data.DataLoader:
    """This rank's optimizer steps [start_step, end_step) (0-based), read ahead by a DataLoader (the sequences
    of its data rank: the C ranks of a CP group read the same ones)."""
    return step_loader(
        prep.datasets["train"],
        prep.collator,
        prep.order,
        prep.plan,
        info.rank // cp.size,
        start_step,
        end_step,
        info.device,
        num_workers,
    )


def train_step(
    model,
    prep: Prepared,
    step: int,
    info: distributed.DistInfo,
    cpu: StepBatches | None = None,
    cp: context_parallel.CPGroup = context_parallel.NONE,
    objective: dpo.DPOObjective | None = None,
) -> torch.Tensor:
    """Forward/backward of one optimizer step's micro-batches (`cpu`: the loader's item for `step`, else read
    now); returns this rank's part of the global-batch mean loss, on the device (no host sync here:
    `global_loss` sums it over the ranks at logging steps). `cp`: this rank's CP group (its part of each row).
    `objective`: --objective dpo's (its count is [pairs, chosen tokens]), else the language model's token mean."""
    if cpu is None:
        cpu = read_step(prep.datasets["train"], prep.collator, prep.order, prep.plan, info.rank // cp.size, step)
    assert cpu.step == step, f"the loader gave step {cpu.step} for step {step}"
    got = cpu.to(info.device)
    # The target tokens of the whole global batch (ranks and micro-batches hold different counts with
    # padded or masked data; the C ranks of a CP group hold the same rows: each token counted once); the
    # labels are shifted before any split, so position 0 is never a target.
    num_targets = distributed.all_reduce_sum(got.num_targets) // cp.size
    if objective is not None:
        objective.new_step(num_targets)
    loss_sum = torch.zeros((), device=info.device)
    for j, (batch, idx) in enumerate(zip(got.micro_batches, got.indices)):
        if parallel.is_sharded(model):
            parallel.set_gradient_reduction(model, last_micro_batch=j == len(got.micro_batches) - 1)
        # masks keyed by sample, also in checkpointing's recomputation; the lean loss (if installed) on the
        # labels; this rank's part of each row under context parallelism (the whole rows without)
        with (
            dropout.keys(model, step, idx, cp.part),
            lean_loss.active(model),
            context_parallel.split(model, batch, cp) as inputs,
        ):
            if objective is not None:
                loss = objective.loss(model, model, batch, num_targets, inputs, cp)
            else:  # no KV cache: transformers confines attention to packed samples only without one
                out = model(**inputs, use_cache=False, num_items_in_batch=num_targets)
                loss = moe.global_batch_loss(model, out, batch, prep.plan.global_batch_size, cp)
            (loss * info.world_size).backward()
        loss_sum += loss.detach()
    return loss_sum


def global_loss(loss_part: torch.Tensor) -> float:
    """The step's global-batch mean loss from every rank's part (a collective and a host sync)."""
    return distributed.all_reduce_sum(loss_part).item()


def clip_gradients(model, max_norm: float) -> torch.Tensor:
    """Clip to `max_norm` (0: no clipping); returns the total norm on the device (`.item()` it when logging)."""
    return optim.clip_grad_norm(model.parameters(), max_norm)


class FSDPTrainer:
    """One run of the native engine: the constructor builds (checks, process group, data, sharded model,
    optimizer, schedule, log); `train()` starts (signal handlers, checkpoint writer, the resumed state) and
    runs the loop; the run around the step is the trunk's (`anygpu.engines.trunk`)."""

    def __init__(self, model_args: ModelArguments, data_args: DataArguments, train_args: TrainArguments) -> None:
        self.args, self.model_args = train_args, model_args
        train_args.report_to = trackers.resolve(train_args.report_to)  # refuse bad input first
        self.resolved = resolved_dict(model_args, data_args, train_args)
        world_size = distributed.world_size_from_env()
        self.mesh_shape = mesh_shape(train_args, world_size)  # a bad R × S × C: refused here
        # refuse bad input first; the batch math's devices are the data-parallel ranks D = W / C
        checked = check_run(model_args, data_args, train_args, self.mesh_shape.data_parallel)
        selective = train_args.gradient_checkpointing and train_args.gradient_checkpointing_policy == "selective"
        context_parallel.check(checked[0], checked[1], train_args.cp, model_args.attn_implementation, selective)
        startup.check_precision(train_args, "fsdp", on_gpu=hardware.vendor() != "cpu")
        startup.check_attention(model_args.attn_implementation, train_args, "fsdp")
        startup.check_levers(model_args, train_args, "fsdp")
        self.reward_set = objectives.reward_set(train_args)  # the user's reward code loads (or fails) before any work
        claimed = startup.claim(train_args)  # rank 0 takes --output_dir before the process group exists
        self.info = info = distributed.init_distributed(train_args.ddp_timeout)
        startup.joined(info, self.resolved, train_args.output_dir)
        self.nodes = elastic.nodes()  # torchrun jobs that may restart: who is in this round
        self.cp = context_parallel.new_group(train_args.cp, torch.bfloat16 if train_args.bf16 else torch.float32)
        self.tf32 = startup.configure_matmuls(train_args)
        torch.manual_seed(train_args.seed + info.rank)
        self.prep = prep = prepare(model_args, data_args, train_args, info, checked)
        objectives.check_reward_columns(self.reward_set, prep)
        run_guard.check_data_agrees(info, prep.data_fingerprint)
        self.fingerprint = resume_guard.fingerprint(self.resolved, prep)  # saved in each checkpoint
        self.resume, self.resumed, self.changed = self._resume_target(claimed)
        self.mesh_shape, self.mesh_note = fitted_mesh(self.mesh_shape, prep, model_args, train_args, info.device)
        self.model = build_model(prep, model_args, train_args, info, self.mesh_shape)
        shape = self.mesh_shape
        self.objective = objectives.build(
            prep, self.model, self.model, model_args, data_args, train_args, info,
            lambda: reference_model.with_call(reference_model.build(prep, model_args, train_args, info, shape)),
            reward_funcs=self.reward_set,
        )  # fmt: skip
        self.auto_probe = self._auto_micro_batch()
        self.optimizer = optim.build_optimizer(self.model, train_args, info.device)
        fp8.attach(self.model, self.optimizer)
        self.scheduler = optim.build_scheduler(self.optimizer, train_args, prep.total_steps)
        start = self.resumed.global_step if self.resumed is not None else 0
        self.schedule = Schedule.of(train_args, start, prep.total_steps)
        fpt, peak = startup.throughput_facts(prep, self.model, train_args, self.tf32, info.device)
        self.log = RunLog(
            prep,
            train_args,
            self.schedule,
            info.world_size,
            info.device,
            info.is_main,
            fpt,
            peak,
            resumed=self.resume is not None,
            tokens=self.objective if objectives.makes_batches(self.objective) else None,
        )
        self.preemption: Preemption | None = None  # train()'s SIGTERM handler
        self.save_clock = SaveClock(train_args.save_every_minutes)  # restarted in _start(): training time counts
        self.async_saver: async_store.AsyncCheckpointer | None = None  # train()'s background writer
        self.batches: Iterator[StepBatches] | None = None  # train()'s iterator over the step loader
        self.timeout = distributed.CollectiveTimeout(train_args.ddp_timeout, train_args.train_timeout)
        self.compiled = compile_stats.CompileWatch(train_args.torch_compile)
        self.gc: GarbageCollection | None = None  # train()'s collector schedule

    def _resume_target(self, claimed) -> tuple[Path | None, RunState | None, list[str]]:
        """The checkpoint to resume and its run state (read, not loaded: `train()` loads it), refused before
        the model is built when it cannot continue this run (another global batch, changed arguments)."""
        resume = startup.resume_target(self.args, claimed, "fsdp")
        if resume is None:
            return None, None, []
        changed = resume_guard.check(resume, self.fingerprint, self.args.allow_changed_args)
        resumed = RunState.read(resume, store.STATE_FILE)
        resumed.check_resumable(resume, self.prep.plan.global_batch_size)
        return resume, resumed, changed

    def _auto_micro_batch(self) -> auto_batch.Probe | None:
        """--auto_micro_batch, probed on the sharded model itself."""
        return startup.auto_micro_batch(
            self.prep,
            self.model_args,
            self.args,
            self.info.device,
            "fsdp2",
            self.info.rank,
            model=self.model,
            shard_size=self.mesh_shape.shard_group,  # the states are divided by S·C
            lean=lean_loss.is_installed(self.model),
        )

    # ------------------------------------------------------------------ the run
    def train(self) -> dict[str, Any]:
        """Train this run's steps (1-based); return the last logged record (rank 0)."""
        self._start()
        schedule, log = self.schedule, self.log
        if schedule.evaluates_first:
            self.evaluate(0)
        log.open_bar()
        if not objectives.makes_batches(self.objective):  # grpo makes each step's rows itself
            loader = steps(
                self.prep, self.info, schedule.start_step, schedule.end_step, self.args.dataloader_num_workers, self.cp
            )
            self.batches = iter(loader)  # 0-based steps
        for step in schedule.steps():
            loss, lr, grad_norm = self.optimizer_step(step, next(self.batches) if self.batches is not None else None)
            log.step_done(step)
            faults.at("step", step)
            first = step == schedule.start_step + 1
            if first:
                self.timeout.first_step_done()  # start-up (compilation included) is over: hangs end in minutes now
            if first or schedule.should_log(step):
                self._say_compiled(step)
            if schedule.should_log(step):
                log.train(step, global_loss(loss), lr, grad_norm.item(), objectives.logged(self.objective))
            if schedule.should_eval(step):
                self.evaluate(step)
            preempted, save_due = self._at_boundary()
            if preempted:
                self._stop_preempted(step)
            self._commit_finished_save()
            if save_due or schedule.should_save(step):
                with log.paused():
                    self.save(step, background=not schedule.is_last(step))
            self.gc.after_step(step)
        return self.finish()

    def _say_compiled(self, step: int) -> None:
        """What torch.compile did (after the first step, then only when a later step compiled again)."""
        said = self.compiled.after_step(step)
        if said is not None and self.info.is_main:
            line, warn = said
            tqdm.write(("warning: " if warn else "") + line)  # beside the progress lines, as the banner

    def _start(self) -> None:
        """Where training starts: signal handlers, the checkpoint writer, the resumed state loaded, the banner."""
        args, info = self.args, self.info
        self.preemption = Preemption.of(args)
        self.preemption.watch(self.model)
        self.async_saver = self._async_saver()
        self.save_clock.saved()
        if self.resume is not None:
            store.load(self.resume, self.model, self.optimizer, self.scheduler, info.rank)
            objectives.resumed(self.objective, self.resume)
            fp8.sync_scales(self.model)  # the loaded weights' FP8 all-gather scales
        self.gc = GarbageCollection(args.gc_steps)
        if info.is_main:
            startup.announce(self.banner(), self.auto_probe, self._resume_line(), self.changed)
            resumed = self.resumed.global_step if self.resumed is not None else None
            startup.announce(elastic.event_line(args.output_dir, self.nodes, info.world_size, resumed))
            startup.write_run_files(args.output_dir, self.resolved, self.prep.tokenizer)
        self.model.train()

    def banner(self) -> str:
        built = parallel.mesh_of(self.model)  # what the parameters really live on, not what was asked for
        if built is not None and self.mesh_shape.cp > 1:
            built = mesh.MeshShape(built.dp_replicate, built.dp_shard // self.mesh_shape.cp, self.mesh_shape.cp)
        shape = (built or self.mesh_shape).banner(sharded=built is not None)
        if self.args.cpu_offload:
            shape += "; their shards in host memory, the optimizer step on the CPU (--cpu_offload: the same curve)"
        if self.mesh_note:
            shape += f" ({self.mesh_note})"
        if self.args.ep > 1:
            shape += "\n" + expert_parallel.describe(self.model, self.args.ep, self.mesh_shape)
        return startup.banner(
            "FSDP2", self.prep, self.model, self.args, self.tf32, shape, objectives.describe(self.objective)
        )

    def _resume_line(self) -> str | None:
        if self.resumed is None:
            return None
        meshes = f"; mesh was {self.resumed.mesh.describe()}, now {self.mesh_shape.describe()}"
        return startup.resume_line(
            self.resume, self.schedule.start_step, self.resumed.world_size, self.info.world_size, "ranks", meshes
        )

    def optimizer_step(self, step: int, cpu: StepBatches | None) -> tuple[torch.Tensor, float, torch.Tensor]:
        """Step `step` (1-based) on its loader item (None: the objective makes the step's rows): forward/backward,
        clip, AdamW, schedule. Returns this rank's loss part, lr, grad norm (tensors: read them on logging steps
        only, so the host runs ahead of the device)."""
        if objectives.makes_batches(self.objective):
            loss = self.objective.train_step(self.model, step - 1)
        else:
            loss = train_step(self.model, self.prep, step - 1, self.info, cpu, self.cp, self.objective)
        grad_norm = clip_gradients(self.model, self.args.max_grad_norm)
        lr = self.scheduler.get_last_lr()[0]
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss, lr, grad_norm

    def evaluate(self, step: int) -> None:
        """The evaluation after step `step` (0: before training), logged; its time is not training time."""
        faults.at("eval", step)
        info = self.info
        with self.log.paused():
            if self.objective is not None:
                found = self.objective.evaluate(
                    self.model, self.model, self.prep.datasets["validation"], self.prep.collator,
                    self.args.per_device_eval_batch_size, info.rank, info.world_size, info.device,
                )  # fmt: skip
                self.log.eval(step, found, perplexity=False)
                return
            losses = evaluate_run(
                self.model,
                self.prep,
                self.args.per_device_eval_batch_size,
                info.rank,
                info.world_size,
                info.device,
                cp=self.cp,
            )
        self.log.eval(step, losses)

    def _at_boundary(self) -> tuple[bool, bool]:
        """At a step boundary, agreed by every rank in one collective: a SIGTERM/SIGUSR1 seen by any rank, and
        a time-based checkpoint due (--save_every_minutes, rank 0's clock)."""
        self.preemption.beat()
        due = self.save_clock.due(self.info.is_main)
        preempted, due = distributed.any_ranks([self.preemption.requested is not None, due], self.info.device)
        return preempted, due

    def _stop_preempted(self, step: int) -> None:
        """Save checkpoint-`step` on every rank and exit 143."""
        if self.info.is_main:
            tqdm.write(
                f"{self.preemption.requested or 'SIGTERM'}: saving checkpoint-{step} before exiting "
                f"(exit {errors.EXIT_PREEMPTED})"
            )
        self.save(step)
        with self.timeout.long():
            self.close()
        sys.exit(errors.EXIT_PREEMPTED)

    # ------------------------------------------------------------------ checkpoints
    def _async_saver(self) -> async_store.AsyncCheckpointer | None:
        if self.args.save_strategy == "no":  # no periodic checkpoint to write, in the background or not
            return None
        on, why = async_store.use_async(self.args.async_save, self.model, int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
        if self.info.is_main:
            logger.info("periodic checkpoints: %s (%s)", "asynchronous" if on else "synchronous", why)
        if not on:
            return None
        return async_store.AsyncCheckpointer(
            self.args.output_dir, self.args.save_total_limit, self.info.rank, self.info.device, self.preemption.progress
        )

    def _commit_finished_save(self) -> None:
        """A background write that has finished becomes its checkpoint now (never waits)."""
        if self.async_saver is not None:
            self.async_saver.poll()

    def run_state(self, step: int) -> RunState:
        prep, shape = self.prep, self.mesh_shape
        return RunState(
            step,
            prep.plan.global_batch_size,
            self.info.world_size,
            self.args.seed,
            prep.order.num_samples,
            prep.total_steps,
            shape.dp_replicate,
            shape.dp_shard,
            cp=shape.cp,
        )

    def save(self, step: int, background: bool = False) -> None:
        """Checkpoint `step`; `background`: return once staged (periodic saves), else when complete."""
        state, extra = self.run_state(step).to_json(), {resume_guard.FINGERPRINT_FILE: self.fingerprint}
        extra.update(objectives.checkpoint_files(self.objective, step))  # a collective under grpo
        self.save_clock.saved()
        if self.async_saver is not None and background:
            self.async_saver.save(step, self.model, self.optimizer, self.scheduler, state, extra)
            return
        with self.timeout.long():  # a rank waits here for the slowest writer
            if self.async_saver is not None:
                self.async_saver.wait()  # the previous one completes first: checkpoints commit in step order
            store.save(
                self.args.output_dir,
                step,
                self.model,
                self.optimizer,
                self.scheduler,
                state,
                self.args.save_total_limit,
                self.info.rank,
                extra,
                self.preemption.progress,
            )

    # ------------------------------------------------------------------ the end
    def finish(self) -> dict[str, Any]:
        """The end of the run: the final model at the end of the schedule, the curves; the last logged record."""
        self.log.close_bar()
        with self.timeout.long():  # rank 0 writes the export while the others wait
            if self.schedule.exports:
                finish.export_final(
                    self.model, self.prep, self.model_args, self.args, self.info.rank, self.preemption.progress
                )
            finish.curves(self.args.output_dir, self.info.is_main)
            self.close()
        return self.log.last

    def stop_loader(self) -> None:
        """End the step loader's workers (also on the way out of an error: they would outlive the rank)."""
        stop_workers(self.batches)
        self.batches = None

    def close(self) -> None:
        self.log.close()
        if self.gc is not None:
            self.gc.close()
        self.stop_loader()
        if self.async_saver is not None:
            self.async_saver.close()  # a write still in flight completes and commits before exit
        if self.preemption is not None:
            self.preemption.close()
        objectives.close(self.objective)
        distributed.leave(self.info)


def run(model_args: ModelArguments, data_args: DataArguments, train_args: TrainArguments) -> dict[str, Any]:
    trainer = FSDPTrainer(model_args, data_args, train_args)
    try:
        return trainer.train()
    except BaseException:
        trainer.stop_loader()
        trainer.log.close(failed=True)  # an MLflow or W&B run ends as failed, not left running (no-op once closed)
        raise


def main(argv: list[str] | None = None) -> None:
    def body() -> None:
        try:
            run(*parse_args(argv))
        finally:
            run_guard.release_locks()

    errors.run_main(body, cleanup=lambda: distributed.destroy(sync=False))

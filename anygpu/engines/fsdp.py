"""The native FSDP2 training loop (run_fsdp_standalone.py).

Per optimizer step, on every rank: its G/W sequences of global batch k, in A micro-batches
of m (G = m·W·A). Each micro-batch's loss is its token-loss sum over the number of target
tokens in the *whole global batch* (all-reduced up front), times W because FSDP averages
gradients over ranks: the gradient is the global-batch token mean whatever W, m and A.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path
from typing import Any, Iterator

import torch
from tqdm.auto import tqdm

from anygpu import errors
from anygpu.checkpoint import async_store, export, resume_guard, store
from anygpu.config.args import DataArguments, ModelArguments, TrainArguments, parse_args, resolved_dict
from anygpu.data.collate import Collator, count_targets
from anygpu.data.loader import StepBatches, read_step, step_loader
from anygpu.data.order import eval_shards
from anygpu.data.prepare import Prepared, check_run, prepare, summary_lines
from anygpu.errors import UsageError
from anygpu.model import dropout, lean_loss, lora, modeling, moe
from anygpu.planning import auto_batch
from anygpu.reliability import run_guard
from anygpu.reliability.preempt import Preemption
from anygpu.runtime import distributed, hardware, lazy_deepspeed, mesh, parallel
from anygpu.runtime.faults import test_fault
from anygpu.runtime.progress import protected
from anygpu.train import metrics, optim, trackers

logger = logging.getLogger("anygpu")


def mesh_shape(train_args: TrainArguments, world_size: int) -> mesh.MeshShape:
    """R × S from --dp_replicate/--dp_shard, else one replica group per node (refused when they do not fit)."""
    return mesh.resolve(train_args.dp_replicate, train_args.dp_shard, world_size, mesh.local_world_size_from_env())


def build_model(prep: Prepared, model_args: ModelArguments, train_args: TrainArguments, info: distributed.DistInfo):
    """Meta model → AC / compile / FSDP2 or HSDP → materialised on the device → initial or pretrained weights."""
    model = lora.wrap(modeling.build_meta_model(prep.config, model_args), model_args)  # adapter before sharding
    if lora.is_peft(model) and train_args.bf16:
        lora.hold_frozen_in(model, torch.bfloat16)  # as the memory plan counts it: 2 bytes per frozen parameter
    modeling.check_loss_kwargs(model)
    dropout.install(model, train_args.seed)
    lean_loss.install(model, train_args.lean_loss)  # patches lm_head's forward before FSDP2 swaps the classes
    buffers = {n: b.clone() for n, b in model.named_buffers()}
    parallel.shard_model(
        model,
        info.device,
        mesh_shape(train_args, info.world_size),
        train_args.bf16,
        train_args.gradient_checkpointing,
        train_args.torch_compile,
    )
    model.to_empty(device=info.device)
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


@torch.no_grad()
def evaluate(model, dataset, collator: Collator, batch_size: int, info: distributed.DistInfo) -> float:
    """Mean token loss over the whole validation set (every rank runs the same number of batches)."""
    model.eval()
    totals = torch.zeros(2, dtype=torch.float64, device=info.device)
    for idx in eval_shards(len(dataset), info.world_size, info.rank, batch_size):
        batch = {k: v.to(info.device) for k, v in collator.read(dataset, idx or [0]).items()}
        # num_items_in_batch=1 turns the model's loss into a token-loss sum (HF's own loss path)
        with lean_loss.active(model):
            loss_sum = model(
                **batch,
                use_cache=False,
                num_items_in_batch=torch.tensor(1, device=info.device),
                **moe.eval_kwargs(model),
            ).loss
        if idx:
            totals += torch.stack(
                [loss_sum.double(), torch.tensor(float(count_targets(batch)), device=info.device, dtype=torch.float64)]
            )
    distributed.all_reduce_sum(totals)
    model.train()
    return (totals[0] / totals[1]).item()


def steps(
    prep: Prepared, info: distributed.DistInfo, start_step: int, end_step: int, num_workers: int | None = None
) -> torch.utils.data.DataLoader:
    """This rank's optimizer steps [start_step, end_step) (0-based), read ahead by a DataLoader."""
    return step_loader(
        prep.datasets["train"],
        prep.collator,
        prep.order,
        prep.plan,
        info.rank,
        start_step,
        end_step,
        info.device,
        num_workers,
    )


def train_step(
    model, prep: Prepared, step: int, info: distributed.DistInfo, cpu: StepBatches | None = None
) -> torch.Tensor:
    """Forward/backward of one optimizer step's micro-batches (`cpu`: the loader's item for `step`, else read
    now); returns this rank's part of the global-batch mean loss, on the device (no host sync here:
    `global_loss` sums it over the ranks at logging steps)."""
    if cpu is None:
        cpu = read_step(prep.datasets["train"], prep.collator, prep.order, prep.plan, info.rank, step)
    assert cpu.step == step, f"the loader gave step {cpu.step} for step {step}"
    got = cpu.to(info.device)
    # The target tokens of the whole global batch (ranks and micro-batches hold different counts with
    # padded or masked data); labels are shifted inside the model, so position 0 is never a target.
    num_targets = distributed.all_reduce_sum(got.num_targets)
    loss_sum = torch.zeros((), device=info.device)
    for j, (batch, idx) in enumerate(zip(got.micro_batches, got.indices)):
        if parallel.is_sharded(model):
            model.set_requires_gradient_sync(j == len(got.micro_batches) - 1)  # reduce-scatter once per step
        # masks keyed by sample, also in checkpointing's recomputation; the lean loss (if installed) on the labels
        with dropout.keys(model, step, idx), lean_loss.active(model):
            # no KV cache: transformers confines attention to packed samples only without one
            out = model(**batch, use_cache=False, num_items_in_batch=num_targets)
            loss = moe.global_batch_loss(model, out, batch, prep.plan.global_batch_size)
            (loss * info.world_size).backward()
        loss_sum += loss.detach()
    return loss_sum


def global_loss(loss_part: torch.Tensor) -> float:
    """The step's global-batch mean loss from every rank's part (a collective and a host sync)."""
    return distributed.all_reduce_sum(loss_part).item()


def clip_gradients(model, max_norm: float) -> torch.Tensor:
    """Clip to `max_norm` (0: no clipping); returns the total norm on the device (`.item()` it when logging)."""
    return optim.clip_grad_norm(model.parameters(), max_norm)


def banner(prep: Prepared, model, train_args: TrainArguments, tf32: bool, shape: mesh.MeshShape) -> str:
    built = parallel.mesh_of(model)  # what the parameters really live on, not what was asked for
    return "\n".join(
        [
            "anygpu FSDP2 engine",
            *summary_lines(prep, model, train_args, tf32),
            (built or shape).banner(sharded=built is not None),
        ]
    )


class FSDPTrainer:
    """One training run: set-up (checks, data, sharded model, optimizer, resume), then `train()`."""

    def __init__(self, model_args: ModelArguments, data_args: DataArguments, train_args: TrainArguments) -> None:
        train_args.report_to = trackers.resolve(train_args.report_to)  # refuse bad input first
        checked = check_run(model_args, data_args, train_args, distributed.world_size_from_env())
        self.mesh_shape = mesh_shape(train_args, distributed.world_size_from_env())  # a bad R × S: refused here
        run_guard.claim_output_dir(train_args, errors.rank())  # lock, repairs, used output_dir, rewinds
        self.args, self.model_args = train_args, model_args
        self.info = info = distributed.init_distributed(train_args.ddp_timeout)
        run_guard.check_ranks(info, resolved_dict(model_args, data_args, train_args), train_args.output_dir)
        logging.basicConfig(
            level=logging.INFO if info.is_main else logging.WARNING, format="[%(levelname)s] %(message)s"
        )
        if train_args.fp16:
            raise UsageError("--fp16 is not supported by the FSDP2 engine: use --bf16 (same memory, no loss scaling).")
        if train_args.bf16 and info.device.type == "cuda" and not hardware.supports_bf16():
            raise UsageError("--bf16: this GPU has no bf16; drop --bf16 (fp32) or use the HF engine with --fp16.")
        tf32 = hardware.configure_tf32(train_args.tf32)
        torch.manual_seed(train_args.seed + info.rank)
        self.prep = prep = prepare(model_args, data_args, train_args, info, checked)
        run_guard.check_data_agrees(info, prep.data_fingerprint)
        resume = run_guard.agreed_resume(train_args.resume_from_checkpoint, train_args.output_dir)  # verified once
        self.fingerprint = resume_guard.fingerprint(resolved_dict(model_args, data_args, train_args), prep)
        changed = []
        if resume is not None:  # before loading: a changed model or the other engine's files get a message
            resume_guard.check_engine(resume, "fsdp")
            changed = resume_guard.check(resume, self.fingerprint, train_args.allow_changed_args)
        self.model = build_model(prep, model_args, train_args, info)
        self.auto_probe = None
        if train_args.auto_micro_batch:  # the largest micro-batch that fits on every rank; G unchanged
            self.auto_probe = auto_batch.apply(
                prep,
                model_args,
                train_args,
                info.device,
                "fsdp2",
                self.model,
                shard_size=self.mesh_shape.dp_shard,
                lean=lean_loss.is_installed(self.model),
            )
            print(f"rank {info.rank}: micro-batch auto → {prep.plan.per_device_train_batch_size}", flush=True)
        self.optimizer = optim.build_optimizer(self.model, train_args, info.device)
        self.scheduler = optim.build_scheduler(self.optimizer, train_args, prep.total_steps)
        self.start_step = self._resume(resume) if resume is not None else 0
        self.writer = metrics.MetricsWriter(
            train_args.output_dir, info.is_main, train_args.report_to, self.start_step if resume is not None else None
        )
        self.async_saver = self._async_saver()
        self.end_step = min(prep.total_steps, train_args.stop_at_step or prep.total_steps)
        precision = hardware.matmul_precision(train_args.bf16, train_args.fp16, tf32)
        self.peak_flops = (
            hardware.peak_flops(hardware.devices()[0].name, precision) if info.device.type == "cuda" else None
        )
        self.tokens = metrics.StepTokens(prep.datasets["train"], prep.order, prep.block_size)
        self.flops_per_token = metrics.flops_per_token(
            prep.config, modeling.count_parameters(self.model, exclude_embeddings=True), prep.block_size
        )
        self.last: dict[str, Any] = {}
        self.batches: Iterator[StepBatches] | None = None  # train()'s iterator over the step loader
        self.preemption: Preemption | None = None  # train()'s SIGTERM handler
        if info.is_main:
            print(banner(prep, self.model, train_args, tf32, self.mesh_shape), flush=True)
            if self.auto_probe is not None:
                print(self.auto_probe.line(), flush=True)
            if resume is not None:
                was, now = self.resumed_mesh, self.mesh_shape
                print(
                    f"resumed from {resume} at step {self.start_step} (was {self.resumed_world_size} ranks, now "
                    f"{info.world_size}; mesh was {was.dp_replicate} × {was.dp_shard}, now {now.dp_replicate} × "
                    f"{now.dp_shard})",
                    flush=True,
                )
                if line := resume_guard.banner_line(changed):
                    print(line, flush=True)
            out = Path(train_args.output_dir)
            (out / "args.json").write_text(
                json.dumps(resolved_dict(model_args, data_args, train_args), indent=2, default=str)
            )
            prep.tokenizer.save_pretrained(str(out / "tokenizer"))

    def _resume(self, path: Path) -> int:
        state = store.load(path, self.model, self.optimizer, self.scheduler, self.info.rank)
        G = self.prep.plan.global_batch_size
        if state["global_batch_size"] != G:
            raise UsageError(
                f"--resume_from_checkpoint {path}: trained with --global_batch_size {state['global_batch_size']}; "
                f"resuming with {G} would change the data order: pass --global_batch_size {state['global_batch_size']}."
            )
        self.resumed_world_size = state["world_size"]
        # checkpoints written before HSDP have no mesh: it was 1 × W
        self.resumed_mesh = mesh.MeshShape(state.get("dp_replicate", 1), state.get("dp_shard", state["world_size"]))
        return state["global_step"]

    def _async_saver(self) -> async_store.AsyncCheckpointer | None:
        on, why = async_store.use_async(self.args.async_save, self.model, int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
        if self.info.is_main:
            logger.info("periodic checkpoints: %s (%s)", "asynchronous" if on else "synchronous", why)
        return (
            async_store.AsyncCheckpointer(
                self.args.output_dir, self.args.save_total_limit, self.info.rank, self.info.device
            )
            if on
            else None
        )

    def save(self, step: int, background: bool = False) -> None:
        """Checkpoint `step`; `background`: return once staged (periodic saves), else when complete."""
        prep = self.prep
        state = {
            "global_step": step,
            "global_batch_size": prep.plan.global_batch_size,
            "world_size": self.info.world_size,
            "dp_replicate": self.mesh_shape.dp_replicate,
            "dp_shard": self.mesh_shape.dp_shard,
            "seed": self.args.seed,
            "num_train_samples": prep.order.num_samples,
            "total_steps": prep.total_steps,
        }
        extra = {resume_guard.FINGERPRINT_FILE: self.fingerprint}
        if self.async_saver is not None:
            if background:
                self.async_saver.save(step, self.model, self.optimizer, self.scheduler, state, extra)
                return
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
        )

    def _log(self, rec: dict[str, Any]) -> None:
        self.writer.write(rec)
        if self.info.is_main:
            tqdm.write(metrics.format_line(rec, self.prep.total_steps))
        self.last = {**self.last, **rec}

    def log_eval(self, step: int) -> None:
        test_fault("eval", step)
        eval_loss = evaluate(
            self.model,
            self.prep.datasets["validation"],
            self.prep.collator,
            self.args.per_device_eval_batch_size,
            self.info,
        )
        self._log({"step": step, "eval_loss": eval_loss, "perplexity": metrics.perplexity(eval_loss)})

    def log_train(self, step: int, loss: float, lr: float, grad_norm: float, window: metrics.ThroughputWindow) -> None:
        info, G = self.info, self.prep.plan.global_batch_size
        rec = {
            "step": step,
            "loss": loss,
            "learning_rate": lr,
            "grad_norm": grad_norm,
            **window.record(self.tokens.padded),
        }
        tps = rec["tokens_per_second"]
        rec.update(
            {
                "tokens_per_second_per_device": tps / info.world_size,
                "world_size": info.world_size,
                "global_batch_size": G,
                "epoch": step / self.prep.order.steps_per_epoch,
            }
        )
        if (u := metrics.mfu(tps, self.flops_per_token, self.peak_flops, info.world_size)) is not None:
            rec["mfu"] = u
        if (mem := metrics.max_memory_gb(info.device)) is not None:
            rec["max_memory_allocated_gb"] = mem
        self._log(rec)

    def optimizer_step(self, step: int, cpu: StepBatches) -> tuple[torch.Tensor, float, torch.Tensor]:
        """Step `step` (1-based) on its loader item: forward/backward, clip, AdamW, schedule. Returns this rank's
        loss part, lr, grad norm (tensors: read them on logging steps only, so the host runs ahead of the device)."""
        loss = train_step(self.model, self.prep, step - 1, self.info, cpu)
        grad_norm = clip_gradients(self.model, self.args.max_grad_norm)
        lr = self.scheduler.get_last_lr()[0]
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss, lr, grad_norm

    def train(self) -> dict[str, Any]:
        """Train from start_step to end_step; return the last logged record (rank 0)."""
        args, info, total = self.args, self.info, self.prep.total_steps
        self.preemption = preemption = Preemption(args.save_on_preempt)
        preemption.watch(self.model)
        if args.eval_on_start and self.start_step == 0:
            self.log_eval(0)
        bar = tqdm(
            total=self.end_step,
            initial=self.start_step,
            disable=args.disable_tqdm or not info.is_main,
            desc="train",
            unit="step",
            dynamic_ncols=True,
        )
        self.model.train()
        self.batches = iter(steps(self.prep, info, self.start_step, self.end_step))  # 0-based steps
        window = metrics.ThroughputWindow()
        for step in range(self.start_step + 1, self.end_step + 1):
            loss, lr, grad_norm = self.optimizer_step(step, next(self.batches))
            if step == self.start_step + 1 and info.is_main:
                if info.device.type == "cuda":
                    torch.cuda.synchronize()  # once: the first step's time must count its finished work
                logger.info(
                    "first step done %.1f s after the process started (%.1f s of CPU)", *metrics.since_process_start()
                )
            window.add(*self.tokens.count(step - 1, self.prep.plan))
            bar.update(1)
            if step % args.logging_steps == 0 or step == self.end_step:
                if info.device.type == "cuda":
                    torch.cuda.synchronize()  # tokens/s must count finished work
                self.log_train(step, global_loss(loss), lr, grad_norm.item(), window)
                window.reset()
            if args.eval_steps and step % args.eval_steps == 0 and step != total:
                with metrics.paused(window):
                    self.log_eval(step)
            preemption.beat()
            if distributed.any_rank(preemption.requested is not None, info.device):
                if info.is_main:
                    tqdm.write(
                        f"{preemption.requested or 'SIGTERM'}: saving checkpoint-{step} before exiting "
                        f"(exit {errors.EXIT_PREEMPTED})"
                    )
                self.save(step)
                self.close(bar)
                sys.exit(errors.EXIT_PREEMPTED)
            if self.async_saver is not None:
                self.async_saver.poll()  # commit a finished background write (no wait)
            if args.save_steps and step % args.save_steps == 0 and step != self.end_step:
                with metrics.paused(window):
                    self.save(step, background=True)
        bar.close()
        self.finish()
        return self.last

    def finish(self) -> None:
        """End of the run: final eval, checkpoint, safetensors export and loss.png."""
        out = Path(self.args.output_dir)
        if self.end_step == self.prep.total_steps:
            self.log_eval(self.end_step)
        if self.end_step > self.start_step:
            self.save(self.end_step)
        if self.end_step == self.prep.total_steps and self.args.export_final and lora.is_peft(self.model):
            with protected():  # the preemption watchdog waits for the export, however long
                final = export.export_adapter(
                    self.model,
                    self.prep.tokenizer,
                    self.model_args.model_name_or_path,
                    out / "final",
                    self.info.rank,
                    self.model_args.merge_lora,
                )
            if self.info.is_main:
                print(f"final adapter: {final} (PeftModel.from_pretrained loads it over the base)", flush=True)
        elif self.end_step == self.prep.total_steps and self.args.export_final:
            with protected():
                final = export.export_safetensors(
                    self.model, self.prep.config, self.prep.tokenizer, out / "final", self.info.rank
                )
            if self.info.is_main:
                print(f"final model: {final} (AutoModelForCausalLM.from_pretrained loads it)", flush=True)
        if self.info.is_main:
            png = metrics.plot_losses(str(out))
            print(f"metrics: {out / 'metrics.jsonl'}, curves: {png}", flush=True)
        self.close()

    def close(self, bar: tqdm | None = None) -> None:
        if bar is not None:
            bar.close()
        self.batches = None  # the DataLoader iterator's workers stop when it is dropped
        if self.async_saver is not None:
            self.async_saver.close()  # a write still in flight completes and commits before exit
        if self.preemption is not None:
            self.preemption.close()
        self.writer.close()
        distributed.destroy()


def run(model_args: ModelArguments, data_args: DataArguments, train_args: TrainArguments) -> dict[str, Any]:
    lazy_deepspeed.unwrap_without_importing_deepspeed()  # the final export's save_pretrained would import it
    trainer = FSDPTrainer(model_args, data_args, train_args)
    try:
        return trainer.train()
    except BaseException:
        trainer.writer.close(failed=True)  # an MLflow or W&B run ends as failed, not left running (no-op once closed)
        raise


def main(argv: list[str] | None = None) -> None:
    def body() -> None:
        try:
            run(*parse_args(argv))
        finally:
            run_guard.release_locks()

    errors.run_main(body, cleanup=lambda: distributed.destroy(sync=False))

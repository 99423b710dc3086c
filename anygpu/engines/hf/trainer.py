"""`Trainer` glue for the HF engine: our data order, optimizer, schedule, evaluation, atomic
checkpoints and metrics under Hugging Face's own training loop (DDP, FSDP2, DeepSpeed, DataParallel).

What the loop computes, per optimizer step k and rank r (G = m·W·A as in `anygpu.config.batch`):
- data: rank r's A micro-batches of m sequences from global batch k of `GlobalOrder`, from a batch
  sampler of our own that accelerate never sees (so it cannot reshard, reshuffle or drop), started
  at the resume step (so Trainer's skip-batches logic is switched off: `ignore_data_skip`);
- loss: `get_batch_samples` counts the target tokens (`labels[:, 1:] != -100`) of the rank's A
  micro-batches itself, whatever the transformers release, and sums the count over the ranks
  (`average_tokens_across_devices`): N = target tokens of the whole global batch. Each
  micro-batch's loss is its token-loss sum / N, times W (Trainer's `loss *= num_processes`) because
  DDP/ZeRO/FSDP average gradients over ranks: the step's gradient is that of the global-batch token
  mean, whatever W, m and A — the same normalisation as the FSDP2 engine. The logged loss (per-rank
  sums gathered and averaged, × W / N) is the global-batch token mean.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import time
from pathlib import Path
from typing import Any, Iterator

import torch
from torch.utils.data import DataLoader
from tqdm.auto import tqdm
from transformers import Trainer, TrainerCallback
from transformers.trainer_pt_utils import nested_gather

from anygpu.checkpoint import resume_guard, store
from anygpu.config.args import TrainArguments
from anygpu.config.batch import BatchPlan
from anygpu.data.collate import count_targets
from anygpu.data.order import MicroBatchSampler, eval_shards
from anygpu.data.prepare import Prepared
from anygpu.model import dropout, lean_loss, moe
from anygpu.reliability.preempt import Preemption
from anygpu.runtime import distributed
from anygpu.runtime.faults import test_fault
from anygpu.runtime.progress import protected
from anygpu.train import metrics, optim

ANYGPU_STATE = "anygpu_state.json"  # our keys next to Trainer's trainer_state.json in each checkpoint


class AnygpuTrainer(Trainer):
    """Trainer with the library's data order, AdamW groups, schedule, evaluation and atomic checkpoints."""

    def __init__(
        self,
        *args: Any,
        prep: Prepared,
        sampler_plan: BatchPlan,
        start_step: int,
        train_config: TrainArguments,
        num_devices: int,
        strategy: str,
        fingerprint: dict[str, Any],
        **kwargs: Any,
    ) -> None:
        self.prep = prep
        self.sampler_plan = sampler_plan  # this process's split (m·GPUs per micro-batch under DataParallel)
        self.start_step = start_step
        self.train_config = train_config
        self.num_devices = num_devices  # data-parallel devices: processes, or GPUs under DataParallel
        self.strategy = strategy  # hf_strategy's kind, recorded in each checkpoint
        self.fingerprint = fingerprint  # resume_guard's, saved in each checkpoint
        self._step_loss: torch.Tensor | None = None  # this optimizer step's loss, summed over its micro-batches
        self._unwrapped_cache: tuple[torch.nn.Module, torch.nn.Module] | None = None  # (wrapper, unwrapped)
        super().__init__(*args, **kwargs)

    # ------------------------------------------------------------------ data
    def get_train_dataloader(self) -> DataLoader:
        """This rank's micro-batches for steps [start_step, total_steps), in `GlobalOrder`.

        Not passed through `accelerator.prepare`: a prepared loader gets a BatchSamplerShard (which
        would shard our already per-rank batches again) and, with dispatch_batches, a broadcast from
        rank 0. The loop moves each batch to the device itself (`_prepare_inputs`).
        """
        sampler = MicroBatchSampler(
            self.prep.order, self.sampler_plan, self.args.process_index, self.start_step, self.prep.total_steps
        )
        self.sample_queue = dropout.SampleQueue(sampler)  # each micro-batch's data set indices, for keyed dropout
        return DataLoader(
            self.train_dataset,
            batch_sampler=self.sample_queue,
            collate_fn=self.prep.collator,
            num_workers=0,
            pin_memory=self.args.device.type == "cuda",
        )

    def _prepare_inputs(self, inputs: dict[str, Any]) -> dict[str, Any]:
        # No KV cache in training: transformers confines attention to packed samples only without one.
        return {**super()._prepare_inputs(inputs), "use_cache": False}

    def get_batch_samples(self, epoch_iterator: Iterator, num_batches: int, device: torch.device) -> tuple[list, Any]:
        """The step's micro-batches and its target-token count, counted here rather than by Trainer: releases
        before transformers#46204 count labels[:, 0] too (never a target: the model shifts labels)."""
        self._step_loss = None  # summed over the step's micro-batches in training_step
        batches = []
        for _ in range(num_batches):
            try:
                batches.append(next(epoch_iterator))
            except StopIteration:
                break
        if not batches:
            return batches, None
        num_items = torch.tensor(sum(count_targets(b) for b in batches), dtype=torch.long, device=device)
        if self.args.world_size > 1:  # average_tokens_across_devices: the global batch's count
            num_items = self.accelerator.gather(num_items.reshape(1)).sum()
        if self.args.n_gpu > 1:  # DataParallel: every replica's loss is divided by the same count
            num_items = num_items.unsqueeze(0).expand(self.args.n_gpu, -1)
        return batches, num_items

    # ------------------------------------------------------------------ optimizer and schedule
    def create_optimizer(self, model: torch.nn.Module | None = None) -> torch.optim.Optimizer:
        if self.optimizer is None:
            self.optimizer = optim.build_optimizer(
                model if model is not None else self.model, self.train_config, self.args.device
            )
        return self.optimizer

    def create_scheduler(self, num_training_steps: int, optimizer: torch.optim.Optimizer | None = None):
        # The schedule spans the whole run (prep.total_steps), also when --stop_at_step ends it early.
        if self.lr_scheduler is None:
            self.lr_scheduler = optim.build_scheduler(
                optimizer if optimizer is not None else self.optimizer, self.train_config, self.prep.total_steps
            )
            self._created_lr_scheduler = True
        return self.lr_scheduler

    def _own_clipping(self, model: torch.nn.Module) -> bool:
        """Plain or FSDP2 gradients: the library's sharding-independent norm (both engines log the same norm on any
        world size); DeepSpeed and FSDP1 clip their own partitions, Trainer's mixed-mesh path stays Trainer's."""
        return not (
            self.is_deepspeed_enabled
            or (self.is_fsdp_enabled and not getattr(self.accelerator, "is_fsdp2", False))
            or self._has_mixed_mesh_grads(model)
        )

    def _clip_grad_norm(self, model: torch.nn.Module):
        if not self._own_clipping(model):
            return super()._clip_grad_norm(model)
        self.accelerator.unscale_gradients()  # fp16's loss scale, as accelerator.clip_grad_norm_ does first
        return optim.clip_grad_norm(model.parameters(), self.args.max_grad_norm)

    def _get_grad_norm(self, model: torch.nn.Module, grad_norm=None):
        if grad_norm is None and self._own_clipping(model):  # --max_grad_norm 0: the norm, no clipping
            self.accelerator.unscale_gradients()
            grad_norm = optim.clip_grad_norm(model.parameters(), 0.0)
        return super()._get_grad_norm(model, grad_norm)

    def unwrapped(self, model: torch.nn.Module) -> torch.nn.Module:
        """`accelerator.unwrap_model(model)`, remembered per wrapper: it costs ~1 ms a call (1% of a
        tiny-preset step), and the training step needs it for every micro-batch."""
        if self._unwrapped_cache is None or self._unwrapped_cache[0] is not model:
            self._unwrapped_cache = (model, self.accelerator.unwrap_model(model))
        return self._unwrapped_cache[1]

    def training_step(self, model, inputs, num_items_in_batch=None):
        """Trainer's step, with dropout masks keyed by this micro-batch's samples (`anygpu.model.dropout`)."""
        with dropout.keys(self.unwrapped(model), self.state.global_step, self.sample_queue.pop()):
            loss = super().training_step(model, inputs, num_items_in_batch)
        self._step_loss = loss if self._step_loss is None else self._step_loss + loss
        return loss

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """The logged loss is the logging step's own (as the FSDP2 engine logs it), not Trainer's mean
        since its last log: read (a host sync) on logging steps only, by Trainer's own gather + mean."""
        if "loss" in logs and self._step_loss is not None:
            logs = {**logs, "loss": nested_gather(self._step_loss, self.args.parallel_mode).mean().item()}
        super().log(logs, start_time)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """Trainer's loss, through the lean loss where it is installed (`anygpu.model.lean_loss`); a MoE router
        loss in its global-batch form (`anygpu.model.moe`), as the FSDP2 engine."""
        unwrapped = self.unwrapped(model)
        with lean_loss.active(unwrapped):
            return self._compute_loss(model, unwrapped, inputs, return_outputs, num_items_in_batch)

    def _compute_loss(self, model, unwrapped, inputs, return_outputs, num_items_in_batch):
        if not model.training or not moe.aux_loss_coef(unwrapped):
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

        def forward(**kwargs):  # the model's outputs, its loss in the global-batch form
            outputs = model(**kwargs)
            outputs["loss"] = moe.global_batch_loss(unwrapped, outputs, inputs, self.prep.plan.global_batch_size)
            return outputs

        # through Trainer's own compute_loss, so its `loss × num_processes` (DDP averages gradients) applies as to any model
        return super().compute_loss(forward, inputs, return_outputs, num_items_in_batch)

    # ------------------------------------------------------------------ evaluation
    @torch.no_grad()
    def evaluate(
        self, eval_dataset: Any = None, ignore_keys: Any = None, metric_key_prefix: str = "eval"
    ) -> dict[str, float]:
        """Mean token loss over the whole validation set, as the FSDP2 engine computes it.

        Every rank runs the same number of forward passes (ZeRO-3 and FSDP gather parameters
        collectively); a rank short of samples runs a dummy batch and discards it.
        """
        test_fault("eval", self.state.global_step)
        model = self.model_wrapped
        if isinstance(model, torch.nn.DataParallel):  # evaluation needs no second GPU
            model = model.module
        was_training = model.training
        model.eval()
        device = self.args.device
        dataset = self.prep.datasets["validation"]
        totals = torch.zeros(2, dtype=torch.float64, device=device)
        batch_size = self.train_config.per_device_eval_batch_size
        for idx in eval_shards(len(dataset), self.args.world_size, self.args.process_index, batch_size):
            batch = {k: v.to(device) for k, v in self.prep.collator.read(dataset, idx or [0]).items()}
            # num_items_in_batch=1: the model's loss is the token-loss sum (HF's own loss path).
            with lean_loss.active(self.unwrapped(model)):
                loss_sum = model(
                    **batch,
                    use_cache=False,
                    num_items_in_batch=torch.tensor(1, device=device),
                    **moe.eval_kwargs(self.unwrapped(model)),
                ).loss
            if idx:
                totals += torch.stack(
                    [loss_sum.double(), torch.tensor(float(count_targets(batch)), device=device, dtype=torch.float64)]
                )
        distributed.all_reduce_sum(totals)
        if was_training:
            model.train()
        eval_loss = (totals[0] / totals[1]).item()
        result = {f"{metric_key_prefix}_loss": eval_loss, "perplexity": metrics.perplexity(eval_loss)}
        self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, metrics=result)
        for flow in (c for c in self.callback_handler.callbacks if isinstance(c, FlowCallback)):
            # a signal during the evaluation: the checkpoint is of this step, saved right after it
            self.control = flow.check_preemption(self.control)
        return result

    # ------------------------------------------------------------------ checkpoints
    def _save_checkpoint(self, model: torch.nn.Module, trial: Any) -> None:
        """Trainer's checkpoint, written under a temporary folder and renamed when complete.

        `<output_dir>/.checkpoint-<step>.tmp/checkpoint-<step>` is filled by every rank (model,
        optimizer, scheduler, RNG, trainer_state.json, our anygpu_state.json); after a barrier,
        rank 0 renames it to `<output_dir>/checkpoint-<step>`, so a crash mid-save never leaves a
        half-written checkpoint where `--resume_from_checkpoint latest` would find it.
        """
        root = Path(self.args.output_dir)
        step = self.state.global_step
        rank = 0 if self.args.should_save else 1
        needed = self._checkpoint_bytes(root)
        staging = store.start(root, step, rank, needed)  # clears a crash's leftovers; a short disk: SaveError
        self._staging_dir = str(staging)
        folder, final = staging / f"checkpoint-{step}", root / f"checkpoint-{step}"
        with protected(), store.disk_errors(root, staging, final, rank, needed):
            try:
                super()._save_checkpoint(model, trial)
                test_fault("save", step)
            finally:
                self._staging_dir = None
            distributed.barrier()  # every rank's files (RNG states, ZeRO partitions) are in place
            if self.args.should_save:
                state = {
                    "global_step": step,
                    "global_batch_size": self.prep.plan.global_batch_size,
                    "world_size": self.num_devices,
                    "seed": self.train_config.seed,
                    "num_train_samples": self.prep.order.num_samples,
                    "total_steps": self.prep.total_steps,
                    "strategy": self.strategy,
                }
                # state files, manifest (fsyncs Trainer's files), rename, rotation
                store.finalize(
                    root,
                    folder,
                    final,
                    step,
                    self.num_devices,
                    "hf",
                    self.train_config.save_total_limit,
                    {ANYGPU_STATE: state, resume_guard.FINGERPRINT_FILE: self.fingerprint},
                )
                shutil.rmtree(staging, ignore_errors=True)
        distributed.barrier()

    def _checkpoint_bytes(self, root: Path) -> int | None:
        """The next checkpoint's size: the newest one's; before the first, under DDP (one whole copy of the
        trained parameters and their AdamW state, written by rank 0) the bytes this process holds; else unknown."""
        from anygpu.checkpoint import disk_space

        found = store.checkpoints(root)
        estimate = None
        if self.strategy in ("ddp", "dataparallel", "single") and self.optimizer is not None:
            tensors = [
                p for p in self.model.parameters() if p.requires_grad
            ]  # a LoRA checkpoint holds the adapter only
            tensors += [v for st in self.optimizer.state.values() for v in st.values() if torch.is_tensor(v)]
            estimate = sum(t.numel() * t.element_size() for t in tensors)
        return disk_space.needed_bytes(found[-1] if found else None, estimate)

    def _get_output_dir(self, trial: Any) -> str:
        staging = getattr(self, "_staging_dir", None)
        return staging if staging else super()._get_output_dir(trial)


class MetricsCallback(TrainerCallback):
    """metrics.jsonl / --report_to tracker records with the FSDP2 engine's keys, console lines and the tqdm bar.

    Trainer logs every --logging_steps steps and at the last step, as the FSDP2 engine does, with the
    logging step's own global-batch mean loss (`AnygpuTrainer.log`): no host sync on other steps.
    """

    def __init__(
        self,
        writer: metrics.MetricsWriter,
        prep: Prepared,
        train_config: TrainArguments,
        world_size: int,
        device: torch.device,
        flops_per_token: float,
        peak_flops: float | None,
        start_step: int,
        end_step: int,
        is_main: bool,
    ) -> None:
        self.writer, self.prep, self.cfg = writer, prep, train_config
        self.world_size, self.device = world_size, device
        self.fpt, self.peak = flops_per_token, peak_flops
        self.start_step, self.end_step, self.is_main = start_step, end_step, is_main
        self.tokens = metrics.StepTokens(prep.datasets["train"], prep.order, prep.block_size)
        self.lr: float | None = None
        self.bar = None
        self.window = metrics.ThroughputWindow()
        self.mark = time.perf_counter()  # end of the last step or hook: what follows until a hook is a pause
        self.last: dict[str, Any] = {}

    def on_train_begin(self, args, state, control, **kwargs):
        self.bar = tqdm(
            total=self.end_step,
            initial=self.start_step,
            disable=self.cfg.disable_tqdm or not self.is_main,
            desc="train",
            unit="step",
            dynamic_ncols=True,
        )
        self.window.reset()

    def on_step_begin(self, args, state, control, optimizer=None, **kwargs):
        # The rate this step will use (DeepSpeed steps its scheduler inside backward, so reading it
        # after the step would give the next step's).
        if optimizer is not None:
            self.lr = float(optimizer.param_groups[0]["lr"])

    def on_step_end(self, args, state, control, **kwargs):
        self.window.add(*self.tokens.count(state.global_step - 1, self.prep.plan))
        self.mark = time.perf_counter()
        if self.bar is not None:
            self.bar.update(1)

    def on_log(self, args, state, control, logs=None, **kwargs):
        logs = logs or {}
        step = state.global_step
        if "loss" not in logs or "train_runtime" in logs:
            return
        if not (step % self.cfg.logging_steps == 0 or step == self.end_step):
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        grad_norm = logs.get("grad_norm")
        rec = {
            "step": step,
            "loss": float(logs["loss"]),
            "learning_rate": self.lr,
            "grad_norm": float(grad_norm) if grad_norm is not None else float("nan"),
            **self.window.record(self.tokens.padded),
        }
        tps = rec["tokens_per_second"]
        rec.update(
            {
                "tokens_per_second_per_device": tps / self.world_size,
                "world_size": self.world_size,
                "global_batch_size": self.prep.plan.global_batch_size,
                "epoch": step / self.prep.order.steps_per_epoch,
            }
        )
        if (u := metrics.mfu(tps, self.fpt, self.peak, self.world_size)) is not None:
            rec["mfu"] = u
        if (mem := metrics.max_memory_gb(self.device)) is not None:
            rec["max_memory_allocated_gb"] = mem
        self.writer.write(rec)
        if self.is_main:
            tqdm.write(metrics.format_line(rec, self.prep.total_steps))
        self.last = rec
        self.window.reset()
        self.mark = time.perf_counter()

    def _pause_since_mark(self) -> None:
        """Trainer evaluates and saves after logging a step: that time is left out of tokens/s."""
        now = time.perf_counter()
        self.window.pause(now - self.mark)
        self.mark = now

    def on_save(self, args, state, control, **kwargs):
        self._pause_since_mark()

    def on_evaluate(self, args, state, control, **kwargs):
        self._pause_since_mark()
        result = kwargs.get("metrics") or {}
        if "eval_loss" not in result:
            return
        rec = {"step": state.global_step, "eval_loss": result["eval_loss"], "perplexity": result["perplexity"]}
        self.writer.write(rec)
        if self.is_main:
            tqdm.write(metrics.format_line(rec, self.prep.total_steps))
        self.last = {**self.last, **rec}

    def on_train_end(self, args, state, control, **kwargs):
        if self.bar is not None:
            self.bar.close()


class FlowCallback(TrainerCallback):
    """When to evaluate, save and stop: the FSDP2 engine's rules, plus a checkpoint on SIGTERM/SIGUSR1.

    Evaluate every --eval_steps and once at the end of the schedule; save every --save_steps and at
    the last step of this run (--stop_at_step or the end); stop at --stop_at_step. A SIGTERM or SIGUSR1
    seen by any rank makes every rank save at the next step boundary and stop (see `anygpu.reliability.preempt`).
    """

    def __init__(self, train_config: TrainArguments, total_steps: int, end_step: int, device: torch.device) -> None:
        self.cfg, self.total_steps, self.end_step, self.device = train_config, total_steps, end_step, device
        self.terminated = False
        self.preemption = Preemption(train_config.save_on_preempt)

    def on_step_end(self, args, state, control, **kwargs):
        step = state.global_step
        eval_steps, save_steps = self.cfg.eval_steps, self.cfg.save_steps
        if (eval_steps and step % eval_steps == 0 and step != self.total_steps) or step == self.total_steps:
            control.should_evaluate = True
        if (save_steps and step % save_steps == 0) or step == self.end_step:
            control.should_save = True
        if step == self.end_step:  # Trainer logs every --logging_steps; the run's last step too, as the FSDP2 engine
            control.should_log = True
        if step >= self.end_step:
            control.should_training_stop = True
        return self.check_preemption(control)

    def check_preemption(self, control):
        """At a step boundary (or after the evaluation that follows one): a signal on any rank → save and stop."""
        self.preemption.beat()
        if distributed.any_rank(self.preemption.requested is not None, self.device):
            self.terminated = True
            control.should_save = True
            control.should_training_stop = True
        return control


# ---------------------------------------------------------------------- model building and export
@contextlib.contextmanager
def plain_model_construction(deepspeed_plugin: Any) -> Iterator[None]:
    """Build the model as an ordinary module even under ZeRO-3.

    accelerate registers its DeepSpeed config with transformers, and with ZeRO-3 `from_config` then
    partitions the model while it is built (zero.Init), before our seeded initialisation could fill
    it. Unregister it for the build; DeepSpeed partitions the finished model when training starts.
    """
    if deepspeed_plugin is None:
        yield
        return
    from transformers.integrations import unset_hf_deepspeed_config

    unset_hf_deepspeed_config()
    try:
        yield
    finally:
        deepspeed_plugin.set_deepspeed_weakref()


def zero3_state_dict(model: torch.nn.Module, is_main: bool) -> dict[str, torch.Tensor] | None:
    """ZeRO-3's partitioned model as whole tensors on rank 0's CPU (empty elsewhere); None for any other
    strategy (DDP, ZeRO-1/2, FSDP2), which `export.gather_full` gathers. Every rank calls it (collective).

    Ours, not accelerate's `get_state_dict`: that one needs `zero3_save_16bit_model: true`, which the
    shipped ZeRO-3 configs leave off (checkpoints hold partitions). One tensor is gathered at a time.
    """
    tensors = model.state_dict(keep_vars=True)
    if not any(hasattr(t, "ds_id") for t in tensors.values()):
        return None
    import deepspeed

    out: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        if hasattr(tensor, "ds_id"):  # a partitioned parameter: empty until gathered
            with deepspeed.zero.GatheredParameters([tensor], modifier_rank=None):
                full = tensor.data.detach().to("cpu", copy=True) if is_main else None
        else:  # a buffer: whole on every rank
            full = tensor.detach().to("cpu")
        if is_main and full is not None:
            out[name] = full
    return out


def read_resume_step(path: Path) -> int:
    """The optimizer step a Trainer checkpoint was written at."""
    return int(json.loads((path / "trainer_state.json").read_text())["global_step"])


def read_anygpu_state(path: Path) -> dict[str, Any] | None:
    file = path / ANYGPU_STATE
    return json.loads(file.read_text()) if file.exists() else None

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
import shutil
from pathlib import Path
from typing import Any, Iterator

import torch
from torch.utils.data import DataLoader
from transformers import Trainer, TrainerCallback
from transformers.trainer_pt_utils import nested_gather

from anygpu.checkpoint import resume_guard, store
from anygpu.config.args import TrainArguments
from anygpu.config.batch import BatchPlan
from anygpu.data.collate import step_count
from anygpu.data.order import MicroBatchSampler
from anygpu.data.prepare import Prepared
from anygpu.engines.trunk.evaluator import evaluate_run
from anygpu.engines.trunk.log import RunLog
from anygpu.engines.trunk.schedule import SaveClock, Schedule
from anygpu.engines.trunk.state import HF_STATE_FILE, RunState
from anygpu.model import dropout, lean_loss, moe
from anygpu.reliability.preempt import Preemption
from anygpu.runtime import distributed, faults, progress
from anygpu.train import dpo, metrics, optim


@contextlib.contextmanager
def own_layout_saves() -> Iterator[None]:
    """`save_pretrained` of any model writes its weights as the model holds them (save_original_format=False)."""
    from transformers import PreTrainedModel

    save = PreTrainedModel.save_pretrained

    def own_layout(self, *args, **kwargs):
        kwargs.setdefault("save_original_format", False)
        return save(self, *args, **kwargs)

    PreTrainedModel.save_pretrained = own_layout
    try:
        yield
    finally:
        PreTrainedModel.save_pretrained = save


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
        watched: progress.Progress | None = None,
        **kwargs: Any,
    ) -> None:
        self.prep = prep
        self.sampler_plan = sampler_plan  # this process's split (m·GPUs per micro-batch under DataParallel)
        self.start_step = start_step
        self.train_config = train_config
        self.num_devices = num_devices  # data-parallel devices: processes, or GPUs under DataParallel
        self.strategy = strategy  # hf_strategy's kind, recorded in each checkpoint
        self.fingerprint = fingerprint  # resume_guard's, saved in each checkpoint
        self.watched = watched  # the run's progress, which the preemption watchdog reads (saves hold it off)
        self._step_loss: torch.Tensor | None = None  # this optimizer step's loss, summed over its micro-batches
        self._unwrapped_cache: tuple[torch.nn.Module, torch.nn.Module] | None = None  # (wrapper, unwrapped)
        self._parameter_count: tuple[torch.nn.Module, int] | None = None  # (model, non-embedding parameters)
        self.objective: dpo.DPOObjective | None = None  # --objective dpo's (HFRun sets it once its reference is ready)
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
        # Precomputed reference log-probs stay fp64 (Trainer would cast floating inputs to DeepSpeed's dtype).
        ref = {k: v.to(self.args.device) for k, v in inputs.items() if k == "ref_logps"}
        rest = {k: v for k, v in inputs.items() if k != "ref_logps"}
        return {**super()._prepare_inputs(rest), **ref, "use_cache": False}

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
        num_items = step_count(self.prep.collator, batches).to(device)  # --objective dpo: [pairs, chosen tokens]
        if self.args.world_size > 1:  # average_tokens_across_devices: the global batch's count
            num_items = self.accelerator.gather(num_items.reshape(1, -1)).sum(0).reshape(num_items.shape)
        if self.objective is not None:
            self.objective.new_step(num_items)
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

    def floating_point_ops(self, inputs: dict[str, Any]) -> int:
        """Trainer's count for its `total_flos` (6 × input tokens × non-embedding parameters), the parameters counted
        once per model: Trainer's `num_parameters` walks every module and parameter at every micro-batch (0.2 ms of
        CPU a step on the tiny preset, 0.3% of its step; more on a larger model). The count is the same each time."""
        main_input = getattr(self.model, "main_input_name", "input_ids")
        if main_input not in inputs or not hasattr(self.model, "num_parameters"):
            return 0
        if self._parameter_count is None or self._parameter_count[0] is not self.model:
            self._parameter_count = (self.model, self.model.num_parameters(exclude_embeddings=True))
        return 6 * inputs[main_input].numel() * self._parameter_count[1]

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
            if self.objective is not None:  # every rank logs (Trainer gathers the loss the same way): a collective
                logs.update(self.objective.logged())
        super().log(logs, start_time)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """Trainer's loss, through the lean loss where it is installed (`anygpu.model.lean_loss`); a MoE router
        loss in its global-batch form (`anygpu.model.moe`), as the FSDP2 engine."""
        unwrapped = self.unwrapped(model)
        if self.objective is not None:  # this micro-batch's share, × W as Trainer scales (DDP averages gradients)
            loss = self.objective.loss(unwrapped, model, inputs, num_items_in_batch) * self.accelerator.num_processes
            return (loss, None) if return_outputs else loss
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
        """Mean token loss over the whole validation set: the trunk's evaluation, as the FSDP2 engine's."""
        faults.at("eval", self.state.global_step)
        model = self.model_wrapped
        if isinstance(model, torch.nn.DataParallel):  # evaluation needs no second GPU
            model = model.module
        args = (
            self.train_config.per_device_eval_batch_size,
            self.args.process_index,
            self.args.world_size,
            self.args.device,
        )
        if self.objective is not None:  # the loss and TRL's eval_ metrics
            validation = self.prep.datasets["validation"]
            result = self.objective.evaluate(self.unwrapped(model), model, validation, self.prep.collator, *args)
        else:
            losses = evaluate_run(model, self.prep, *args, self.unwrapped(model))
            result = {
                **{k.replace("eval", metric_key_prefix, 1): v for k, v in losses.items()},
                "perplexity": metrics.perplexity(losses["eval_loss"]),
            }
        self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, metrics=result)
        for trunk in (c for c in self.callback_handler.callbacks if isinstance(c, TrunkCallback)):
            # a signal during the evaluation: the checkpoint is of this step, saved right after it
            self.control = trunk.check_preemption(self.control)
        return result

    # ------------------------------------------------------------------ checkpoints
    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        """Trainer's, the weights in the model's own layout: Trainer reloads a checkpoint with load_state_dict,
        without the conversions from_pretrained applies, so a layout save_pretrained reverts (transformers 5 fuses
        MoE experts and saves them one tensor per expert) came back as missing keys and a resume left the experts at
        their starting weights. The final export keeps the Hub's layout (`anygpu.checkpoint.export`)."""
        with own_layout_saves():
            super()._save(output_dir, state_dict)

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
        with progress.protected(self.watched), store.disk_errors(root, staging, final, rank, needed):
            try:
                super()._save_checkpoint(model, trial)
                faults.at("save", step)
            finally:
                self._staging_dir = None
            distributed.barrier()  # every rank's files (RNG states, ZeRO partitions) are in place
            if self.args.should_save:
                prep = self.prep
                state = RunState(
                    step,
                    prep.plan.global_batch_size,
                    self.num_devices,
                    self.train_config.seed,
                    prep.order.num_samples,
                    prep.total_steps,
                    strategy=self.strategy,
                )
                # state files, manifest (fsyncs Trainer's files), rename, rotation
                store.finalize(
                    root,
                    folder,
                    final,
                    step,
                    self.num_devices,
                    "hf",
                    self.train_config.save_total_limit,
                    {HF_STATE_FILE: state.to_json(), resume_guard.FINGERPRINT_FILE: self.fingerprint},
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


class TrunkCallback(TrainerCallback):
    """The trunk's run around Trainer's step: its `Schedule` decides when to evaluate, save, log the last step
    and stop; its `RunLog` writes the records, the bar and the throughput; a SIGTERM or SIGUSR1 seen by any
    rank makes every rank save at the next step boundary and stop (see `anygpu.reliability.preempt`).

    Trainer logs every --logging_steps steps (and, told here, the run's last), with the logging step's own
    global-batch mean loss (`AnygpuTrainer.log`): no host sync on other steps."""

    def __init__(
        self,
        schedule: Schedule,
        log: RunLog,
        preemption: Preemption,
        device: torch.device,
        save_clock: SaveClock | None = None,
        is_main: bool = True,
    ) -> None:
        self.schedule, self.log, self.preemption, self.device = schedule, log, preemption, device
        self.save_clock, self.is_main = save_clock or SaveClock(), is_main  # --save_every_minutes
        self.terminated = False
        self.lr: float | None = None

    def on_train_begin(self, args, state, control, **kwargs):
        self.save_clock.saved()  # training time counts, not the start-up's
        self.log.open_bar()

    def on_step_begin(self, args, state, control, optimizer=None, **kwargs):
        # The rate this step will use (DeepSpeed steps its scheduler inside backward, so reading it
        # after the step would give the next step's).
        if optimizer is not None:
            self.lr = float(optimizer.param_groups[0]["lr"])

    def on_step_end(self, args, state, control, **kwargs):
        step, schedule = state.global_step, self.schedule
        control.should_evaluate = control.should_evaluate or schedule.should_eval(step)
        control.should_save = control.should_save or schedule.should_save(step)
        self.log.step_done(step, pause_follows=control.should_evaluate or control.should_save)
        control.should_log = control.should_log or step == schedule.end_step
        control.should_training_stop = control.should_training_stop or schedule.is_last(step)
        return self.check_preemption(control)

    def check_preemption(self, control):
        """At a step boundary (or after the evaluation that follows one), agreed by every rank in one collective:
        a signal on any rank → save and stop; a time-based checkpoint due (--save_every_minutes) → save."""
        self.preemption.beat()
        due = self.save_clock.due(self.is_main)
        preempted, due = distributed.any_ranks([self.preemption.requested is not None, due], self.device)
        if preempted:
            self.terminated = True
            control.should_save = True
            control.should_training_stop = True
        control.should_save = control.should_save or due
        return control

    def on_log(self, args, state, control, logs=None, **kwargs):
        logs = logs or {}
        if "loss" not in logs or "train_runtime" in logs or not self.schedule.should_log(state.global_step):
            return
        grad_norm = logs.get("grad_norm")
        extra = {k: float(logs[k]) for k in dpo.METRICS if k in logs}  # --objective dpo's
        self.log.train(
            state.global_step,
            float(logs["loss"]),
            self.lr,
            float(grad_norm) if grad_norm is not None else float("nan"),
            extra,
        )

    def on_save(self, args, state, control, **kwargs):
        self.save_clock.saved()
        self.log.pause_since_mark()  # Trainer saves after logging a step: not training time

    def on_evaluate(self, args, state, control, **kwargs):
        self.log.pause_since_mark()
        result = kwargs.get("metrics") or {}
        if "eval_loss" in result:
            lm = (
                "perplexity" in result
            )  # the language-model objective's record; --objective dpo's has its eval_ metrics
            values = {k: v for k, v in result.items() if k != "perplexity" and (not lm or k.startswith("eval_loss"))}
            self.log.eval(state.global_step, values, perplexity=lm)

    def on_train_end(self, args, state, control, **kwargs):
        self.log.close_bar()


# ---------------------------------------------------------------------- model building and export
def zero3_state_dict(
    model: torch.nn.Module, is_main: bool, dtype: torch.dtype = torch.float32
) -> dict[str, torch.Tensor] | None:
    """ZeRO-3's partitioned model as whole tensors in `dtype` (floating ones) on rank 0's CPU (empty elsewhere);
    None for any other strategy (DDP, ZeRO-1/2, FSDP2), which the export gathers. Every rank calls it (collective).

    Ours, not accelerate's `get_state_dict`: that one needs `zero3_save_16bit_model: true`, which the
    shipped ZeRO-3 configs leave off (checkpoints hold partitions). One tensor is gathered at a time and cast
    as it arrives, so rank 0 holds the model in the export dtype, not in fp32; a tied weight is gathered once.
    """
    tensors = model.state_dict(keep_vars=True)
    if not any(hasattr(t, "ds_id") for t in tensors.values()):
        return None
    import deepspeed

    out: dict[str, torch.Tensor] = {}
    seen: dict[int, str] = {}
    for name, tensor in tensors.items():
        if id(tensor) in seen:
            if is_main:
                out[name] = out[seen[id(tensor)]]
            continue
        seen[id(tensor)] = name
        cast = dtype if tensor.is_floating_point() else tensor.dtype
        if hasattr(tensor, "ds_id"):  # a partitioned parameter: empty until gathered
            with deepspeed.zero.GatheredParameters([tensor], modifier_rank=None):
                full = tensor.data.detach().to("cpu", cast, copy=True) if is_main else None
        else:  # a buffer: whole on every rank
            full = tensor.detach().to("cpu", cast)
        if is_main and full is not None:
            out[name] = full
    return out

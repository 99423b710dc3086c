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
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from anygpu import checkpoint, distributed, dropout, hardware, lora, metrics, modeling, moe, optim, parallel
from anygpu.data.order import eval_shards
from anygpu.data.packing import read_batch
from anygpu.args import DataArguments, ModelArguments, TrainArguments, parse_args, resolved_dict
from anygpu.prepare import Prepared, check_run, prepare, summary_lines

logger = logging.getLogger("anygpu")


class _Terminate:
    """Remembers a SIGTERM so the loop can checkpoint at the next step boundary.

    torchrun also sends SIGTERM to the survivors when a rank dies; they are then stuck in a
    collective that will never complete, so if no checkpoint has started after
    ANYGPU_SIGTERM_GRACE_S seconds (default 20, under torchrun's 30 s before SIGKILL) the
    process exits at once: a failed job ends in seconds, not at the collective timeout.
    """

    def __init__(self) -> None:
        self.requested = False
        self.saving = False
        self.grace_s = float(os.environ.get("ANYGPU_SIGTERM_GRACE_S", "20"))
        signal.signal(signal.SIGTERM, self._handler)

    def _handler(self, signum: int, frame: Any) -> None:
        if self.requested:
            return
        self.requested = True
        timer = threading.Timer(self.grace_s, self._give_up)
        timer.daemon = True
        timer.start()

    def _give_up(self) -> None:
        if not self.saving:
            print(f"SIGTERM: no step boundary within {self.grace_s:.0f} s (a peer rank is gone?): exiting without a checkpoint",
                  file=sys.stderr, flush=True)
            os._exit(143)


def build_model(prep: Prepared, model_args: ModelArguments, train_args: TrainArguments, info: distributed.DistInfo):
    """Meta model → AC / compile / FSDP2 → materialised on the device → initial or pretrained weights."""
    model = lora.wrap(modeling.build_meta_model(prep.config, model_args), model_args)  # adapter before sharding
    modeling.check_loss_kwargs(model)
    dropout.install(model, train_args.seed)
    buffers = {n: b.clone() for n, b in model.named_buffers()}
    parallel.shard_model(model, info.device, info.world_size, train_args.bf16, train_args.gradient_checkpointing,
                         train_args.torch_compile)
    model.to_empty(device=info.device)
    modeling.restore_buffers(model, buffers)
    if prep.from_scratch:
        modeling.init_parameters(model, prep.config, train_args.seed)
    else:
        modeling.load_pretrained_weights(model, model_args.model_name_or_path)
    if lora.is_peft(model):
        lora.init_adapter(model, train_args.seed)
    return model


@torch.no_grad()
def evaluate(model, dataset, batch_size: int, info: distributed.DistInfo) -> float:
    """Mean token loss over the whole validation set (every rank runs the same number of batches)."""
    model.eval()
    totals = torch.zeros(2, dtype=torch.float64, device=info.device)
    for idx in eval_shards(len(dataset), info.world_size, info.rank, batch_size):
        batch = read_batch(dataset, idx or [0])
        ids = batch["input_ids"].to(info.device)
        # num_items_in_batch=1 turns the model's loss into a token-loss sum (HF's own loss path)
        loss_sum = model(input_ids=ids, labels=ids, num_items_in_batch=torch.tensor(1, device=info.device),
                         **moe.eval_kwargs(model)).loss
        if idx:
            totals += torch.stack([loss_sum.double(), torch.tensor(float(ids[:, 1:].numel()), device=info.device, dtype=torch.float64)])
    distributed.all_reduce_sum(totals)
    model.train()
    return (totals[0] / totals[1]).item()


def train_step(model, prep: Prepared, step: int, info: distributed.DistInfo) -> float:
    """Forward/backward of one optimizer step's micro-batches; returns the global-batch mean loss."""
    micro = prep.order.micro_batches(step, prep.plan, info.rank)  # data set indices of each micro-batch
    batches = [read_batch(prep.datasets["train"], idx) for idx in micro]
    # labels are shifted inside the model: each sequence has len-1 targets (no padding in packed data)
    num_targets = torch.tensor(float(sum((b["labels"][:, 1:] != -100).sum().item() for b in batches)), device=info.device)
    distributed.all_reduce_sum(num_targets)
    loss_sum = torch.zeros((), device=info.device)
    for j, (batch, idx) in enumerate(zip(batches, micro)):
        model.set_requires_gradient_sync(j == len(batches) - 1)  # reduce-scatter once per step
        ids, labels = batch["input_ids"].to(info.device), batch["labels"].to(info.device)
        with dropout.keys(model, step, idx):  # masks keyed by sample, also in checkpointing's recomputation
            out = model(input_ids=ids, labels=labels, num_items_in_batch=num_targets)
            loss = moe.global_batch_loss(model, out, ids.shape[0], prep.plan.global_batch_size)
            (loss * info.world_size).backward()
        loss_sum += loss.detach()
    return distributed.all_reduce_sum(loss_sum).item()


def clip_gradients(model, max_norm: float) -> float:
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm if max_norm > 0 else float("inf"))
    norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
    return norm.item()


def banner(prep: Prepared, model, train_args: TrainArguments, tf32: bool) -> str:
    return "\n".join(["anygpu FSDP2 engine", *summary_lines(prep, model, train_args, tf32)])


class FSDPTrainer:
    """One training run: set-up (checks, data, sharded model, optimizer, resume), then `train()`."""

    def __init__(self, model_args: ModelArguments, data_args: DataArguments, train_args: TrainArguments) -> None:
        checked = check_run(model_args, data_args, train_args, distributed.world_size_from_env())  # refuse bad input first
        self.args, self.model_args = train_args, model_args
        self.info = info = distributed.init_distributed(train_args.ddp_timeout)
        logging.basicConfig(level=logging.INFO if info.is_main else logging.WARNING, format="[%(levelname)s] %(message)s")
        if train_args.fp16:
            raise ValueError("--fp16 is not supported by the FSDP2 engine: use --bf16 (same memory, no loss scaling).")
        if train_args.bf16 and info.device.type == "cuda" and not hardware.supports_bf16():
            raise ValueError("--bf16: this GPU has no bf16; drop --bf16 (fp32) or use the HF engine with --fp16.")
        tf32 = hardware.configure_tf32(train_args.tf32)
        torch.manual_seed(train_args.seed + info.rank)
        self.prep = prep = prepare(model_args, data_args, train_args, info, checked)
        resume = checkpoint.resolve_resume(train_args.resume_from_checkpoint, train_args.output_dir)
        self.model = build_model(prep, model_args, train_args, info)
        self.optimizer = optim.build_optimizer(self.model, train_args, info.device)
        self.scheduler = optim.build_scheduler(self.optimizer, train_args, prep.total_steps)
        self.writer = metrics.MetricsWriter(train_args.output_dir, info.is_main, bool({"tensorboard", "all"} & set(train_args.report_to)))
        self.start_step = self._resume(resume) if resume is not None else 0
        self.end_step = min(prep.total_steps, train_args.stop_at_step or prep.total_steps)
        self.peak_flops = hardware.peak_bf16_flops(hardware.devices()[0].name) if info.device.type == "cuda" else None
        self.flops_per_token = metrics.flops_per_token(prep.config, modeling.count_parameters(self.model, exclude_embeddings=True), prep.block_size)
        self.last: dict[str, Any] = {}
        if info.is_main:
            print(banner(prep, self.model, train_args, tf32), flush=True)
            if resume is not None:
                print(f"resumed from {resume} at step {self.start_step} (was {self.resumed_world_size} ranks, now {info.world_size})", flush=True)
            out = Path(train_args.output_dir)
            (out / "args.json").write_text(json.dumps(resolved_dict(model_args, data_args, train_args), indent=2, default=str))
            prep.tokenizer.save_pretrained(str(out / "tokenizer"))

    def _resume(self, path: Path) -> int:
        state = checkpoint.load(path, self.model, self.optimizer, self.scheduler, self.info.rank)
        G = self.prep.plan.global_batch_size
        if state["global_batch_size"] != G:
            raise ValueError(
                f"--resume_from_checkpoint {path}: trained with --global_batch_size {state['global_batch_size']}; "
                f"resuming with {G} would change the data order: pass --global_batch_size {state['global_batch_size']}."
            )
        self.resumed_world_size = state["world_size"]
        self.writer.truncate_after(state["global_step"])
        return state["global_step"]

    def save(self, step: int) -> None:
        prep = self.prep
        checkpoint.save(self.args.output_dir, step, self.model, self.optimizer, self.scheduler, {
            "global_step": step, "global_batch_size": prep.plan.global_batch_size, "world_size": self.info.world_size,
            "seed": self.args.seed, "num_train_samples": prep.order.num_samples, "total_steps": prep.total_steps,
        }, self.args.save_total_limit, self.info.rank)

    def _log(self, rec: dict[str, Any]) -> None:
        self.writer.write(rec)
        if self.info.is_main:
            tqdm.write(metrics.format_line(rec, self.prep.total_steps))
        self.last = {**self.last, **rec}

    def log_eval(self, step: int) -> None:
        eval_loss = evaluate(self.model, self.prep.datasets["validation"], self.args.per_device_eval_batch_size, self.info)
        self._log({"step": step, "eval_loss": eval_loss, "perplexity": metrics.perplexity(eval_loss)})

    def log_train(self, step: int, loss: float, lr: float, grad_norm: float, seconds: float, num_steps: int) -> None:
        info, G = self.info, self.prep.plan.global_batch_size
        tps = G * self.prep.block_size * num_steps / seconds
        rec = {"step": step, "loss": loss, "learning_rate": lr, "grad_norm": grad_norm, "tokens_per_second": tps,
               "tokens_per_second_per_device": tps / info.world_size, "world_size": info.world_size,
               "global_batch_size": G, "epoch": step / self.prep.order.steps_per_epoch}
        if (u := metrics.mfu(tps, self.flops_per_token, self.peak_flops, info.world_size)) is not None:
            rec["mfu"] = u
        if (mem := metrics.max_memory_gb(info.device)) is not None:
            rec["max_memory_allocated_gb"] = mem
        self._log(rec)

    def optimizer_step(self, step: int) -> tuple[float, float, float]:
        """Step `step` (1-based): forward/backward, clip, AdamW, schedule. Returns loss, lr, grad norm."""
        loss = train_step(self.model, self.prep, step - 1, self.info)
        grad_norm = clip_gradients(self.model, self.args.max_grad_norm)
        lr = self.scheduler.get_last_lr()[0]
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss, lr, grad_norm

    def train(self) -> dict[str, Any]:
        """Train from start_step to end_step; return the last logged record (rank 0)."""
        args, info, total = self.args, self.info, self.prep.total_steps
        terminate = _Terminate()
        if args.eval_on_start and self.start_step == 0:
            self.log_eval(0)
        bar = tqdm(total=self.end_step, initial=self.start_step, disable=args.disable_tqdm or not info.is_main,
                   desc="train", unit="step", dynamic_ncols=True)
        self.model.train()
        window_start, window_steps = time.perf_counter(), 0
        for step in range(self.start_step + 1, self.end_step + 1):
            loss, lr, grad_norm = self.optimizer_step(step)
            window_steps += 1
            bar.update(1)
            if step % args.logging_steps == 0 or step == self.end_step:
                if info.device.type == "cuda":
                    torch.cuda.synchronize()  # tokens/s must count finished work
                self.log_train(step, loss, lr, grad_norm, time.perf_counter() - window_start, window_steps)
                window_start, window_steps = time.perf_counter(), 0
            if args.eval_steps and step % args.eval_steps == 0 and step != total:
                self.log_eval(step)
            if distributed.any_rank(terminate.requested, info.device):
                terminate.saving = True
                if info.is_main:
                    tqdm.write(f"SIGTERM: saving checkpoint-{step} before exiting")
                self.save(step)
                self.close(bar)
                sys.exit(143)
            if args.save_steps and step % args.save_steps == 0 and step != self.end_step:
                self.save(step)
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
            final = lora.export_adapter(self.model, self.prep.tokenizer, self.model_args.model_name_or_path, out / "final",
                                        self.info.rank, self.model_args.merge_lora)
            if self.info.is_main:
                print(f"final adapter: {final} (PeftModel.from_pretrained loads it over the base)", flush=True)
        elif self.end_step == self.prep.total_steps and self.args.export_final:
            final = checkpoint.export_safetensors(self.model, self.prep.config, self.prep.tokenizer, out / "final", self.info.rank)
            if self.info.is_main:
                print(f"final model: {final} (AutoModelForCausalLM.from_pretrained loads it)", flush=True)
        if self.info.is_main:
            png = metrics.plot_losses(str(out))
            print(f"metrics: {out / 'metrics.jsonl'}, curves: {png}", flush=True)
        self.close()

    def close(self, bar: tqdm | None = None) -> None:
        if bar is not None:
            bar.close()
        self.writer.close()
        distributed.destroy()


def run(model_args: ModelArguments, data_args: DataArguments, train_args: TrainArguments) -> dict[str, Any]:
    return FSDPTrainer(model_args, data_args, train_args).train()


def main(argv: list[str] | None = None) -> None:
    try:
        model_args, data_args, train_args = parse_args(argv)
        run(model_args, data_args, train_args)
    except ValueError as e:  # bad input: one clear line, no traceback
        print(f"error: {e}", file=sys.stderr)
        distributed.destroy(sync=False)
        sys.exit(2)

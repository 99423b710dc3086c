"""The native FSDP2 training loop (run_fsdp_standalone.py).

Per optimizer step, on every rank: its G/W sequences of global batch k, in A micro-batches
of m (G = m·W·A). Each micro-batch's loss is its token-loss sum over the number of target
tokens in the *whole global batch* (all-reduced up front), times W because FSDP averages
gradients over ranks: the gradient is the global-batch token mean whatever W, m and A.
"""
from __future__ import annotations

import json
import logging
import signal
import sys
import time
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from anygpu import checkpoint, data, distributed, hardware, metrics, modeling, optim, parallel
from anygpu.args import DataArguments, ModelArguments, TrainArguments, parse_args, resolved_dict
from anygpu.prepare import Prepared, check_run, prepare

logger = logging.getLogger("anygpu")


class _Terminate:
    """Remembers a SIGTERM so the loop can checkpoint at the next step boundary."""

    def __init__(self) -> None:
        self.requested = False
        signal.signal(signal.SIGTERM, self._handler)

    def _handler(self, signum: int, frame: Any) -> None:
        self.requested = True


def build_model(prep: Prepared, model_args: ModelArguments, train_args: TrainArguments, info: distributed.DistInfo):
    """Meta model → AC / compile / FSDP2 → materialised on the device → initial or pretrained weights."""
    model = modeling.build_meta_model(prep.config, model_args)
    buffers = {n: b.clone() for n, b in model.named_buffers()}
    parallel.shard_model(model, info.device, info.world_size, train_args.bf16, train_args.gradient_checkpointing,
                         train_args.torch_compile)
    model.to_empty(device=info.device)
    modeling.restore_buffers(model, buffers)
    if prep.from_scratch:
        modeling.init_parameters(model, prep.config, train_args.seed)
    else:
        modeling.load_pretrained_weights(model, model_args.model_name_or_path)
    return model


@torch.no_grad()
def evaluate(model, dataset, batch_size: int, info: distributed.DistInfo) -> float:
    """Mean token loss over the whole validation set (every rank runs the same number of batches)."""
    model.eval()
    totals = torch.zeros(2, dtype=torch.float64, device=info.device)
    for idx in data.eval_shards(len(dataset), info.world_size, info.rank, batch_size):
        batch = data.collate([dataset[i] for i in (idx or [0])])
        ids = batch["input_ids"].to(info.device)
        # num_items_in_batch=1 turns the model's loss into a token-loss sum (HF's own loss path)
        loss_sum = model(input_ids=ids, labels=ids, num_items_in_batch=torch.tensor(1, device=info.device)).loss
        if idx:
            totals += torch.stack([loss_sum.double(), torch.tensor(float(ids[:, 1:].numel()), device=info.device, dtype=torch.float64)])
    distributed.all_reduce_sum(totals)
    model.train()
    return (totals[0] / totals[1]).item()


def train_step(model, prep: Prepared, step: int, info: distributed.DistInfo) -> float:
    """Forward/backward of one optimizer step's micro-batches; returns the global-batch mean loss."""
    batches = [data.collate([prep.datasets["train"][i] for i in idx]) for idx in prep.order.micro_batches(step, prep.plan, info.rank)]
    # labels are shifted inside the model: each sequence has len-1 targets (no padding in packed data)
    num_targets = torch.tensor(float(sum((b["labels"][:, 1:] != -100).sum().item() for b in batches)), device=info.device)
    distributed.all_reduce_sum(num_targets)
    loss_sum = torch.zeros((), device=info.device)
    for j, batch in enumerate(batches):
        model.set_requires_gradient_sync(j == len(batches) - 1)  # reduce-scatter once per step
        ids, labels = batch["input_ids"].to(info.device), batch["labels"].to(info.device)
        loss = model(input_ids=ids, labels=labels, num_items_in_batch=num_targets).loss
        (loss * info.world_size).backward()
        loss_sum += loss.detach()
    return distributed.all_reduce_sum(loss_sum).item()


def clip_gradients(model, max_norm: float) -> float:
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm if max_norm > 0 else float("inf"))
    norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
    return norm.item()


def banner(prep: Prepared, info: distributed.DistInfo, model, train_args: TrainArguments, tf32: bool) -> str:
    n = modeling.count_parameters(model)
    lines = [
        "anygpu FSDP2 engine",
        hardware.describe(),
        f"model: {prep.config.model_type}, {n / 1e6:.1f}M parameters, vocab {prep.config.vocab_size}, block {prep.block_size}",
        f"data: {len(prep.datasets['train'])} train / {len(prep.datasets['validation'])} eval blocks"
        + (" (embedded default: Python standard library sources)" if prep.used_default_corpus else ""),
        prep.plan.banner(),
        f"steps: {prep.total_steps} ({prep.order.steps_per_epoch} per epoch), precision: "
        + ("bf16 mixed" if train_args.bf16 else "fp32") + (", TF32 matmuls" if tf32 else ""),
    ]
    return "\n".join(lines)


def run(model_args: ModelArguments, data_args: DataArguments, train_args: TrainArguments) -> dict[str, Any]:
    """Train; return the last logged record (rank 0)."""
    check_run(model_args, data_args, train_args, distributed.world_size_from_env())  # refuse bad input first
    info = distributed.init_distributed(train_args.ddp_timeout)
    logging.basicConfig(level=logging.INFO if info.is_main else logging.WARNING, format="[%(levelname)s] %(message)s")
    if train_args.fp16:
        raise ValueError("--fp16 is not supported by the FSDP2 engine: use --bf16 (same memory, no loss scaling).")
    if train_args.bf16 and info.device.type == "cuda" and not hardware.supports_bf16():
        raise ValueError("--bf16: this GPU has no bf16; drop --bf16 (fp32) or use the HF engine with --fp16.")
    tf32 = hardware.configure_tf32(train_args.tf32)
    torch.manual_seed(train_args.seed + info.rank)
    prep = prepare(model_args, data_args, train_args, info)
    resume = checkpoint.resolve_resume(train_args.resume_from_checkpoint, train_args.output_dir)

    model = build_model(prep, model_args, train_args, info)
    optimizer = optim.build_optimizer(model, train_args, info.device)
    scheduler = optim.build_scheduler(optimizer, train_args, prep.total_steps)
    writer = metrics.MetricsWriter(train_args.output_dir, info.is_main, "tensorboard" in train_args.report_to or "all" in train_args.report_to)
    start_step = 0
    if resume is not None:
        state = checkpoint.load(resume, model, optimizer, scheduler, info.rank)
        if state["global_batch_size"] != prep.plan.global_batch_size:
            raise ValueError(
                f"--resume_from_checkpoint {resume}: trained with --global_batch_size {state['global_batch_size']}; "
                f"resuming with {prep.plan.global_batch_size} would change the data order: pass --global_batch_size {state['global_batch_size']}."
            )
        start_step = state["global_step"]
        writer.truncate_after(start_step)
    if info.is_main:
        print(banner(prep, info, model, train_args, tf32), flush=True)
        if resume is not None:
            print(f"resumed from {resume} at step {start_step} (was {state['world_size']} ranks, now {info.world_size})", flush=True)
        Path(train_args.output_dir, "args.json").write_text(json.dumps(resolved_dict(model_args, data_args, train_args), indent=2, default=str))
        prep.tokenizer.save_pretrained(str(Path(train_args.output_dir) / "tokenizer"))

    peak = hardware.peak_bf16_flops(hardware.devices()[0].name) if info.device.type == "cuda" else None
    fpt = metrics.flops_per_token(prep.config, modeling.count_parameters(model, exclude_embeddings=True), prep.block_size)
    tokens_per_step = prep.plan.global_batch_size * prep.block_size
    end_step = min(prep.total_steps, train_args.stop_at_step or prep.total_steps)
    terminate = _Terminate()
    last: dict[str, Any] = {}

    def save(step: int) -> None:
        checkpoint.save(train_args.output_dir, step, model, optimizer, scheduler, {
            "global_step": step, "global_batch_size": prep.plan.global_batch_size, "world_size": info.world_size,
            "seed": train_args.seed, "num_train_samples": prep.order.num_samples, "total_steps": prep.total_steps,
        }, train_args.save_total_limit, info.rank)

    def log_eval(step: int) -> None:
        nonlocal last
        eval_loss = evaluate(model, prep.datasets["validation"], train_args.per_device_eval_batch_size, info)
        rec = {"step": step, "eval_loss": eval_loss, "perplexity": metrics.perplexity(eval_loss)}
        writer.write(rec)
        if info.is_main:
            tqdm.write(metrics.format_line(rec, prep.total_steps))
        last = {**last, **rec}

    if train_args.eval_on_start and start_step == 0:
        log_eval(0)
    bar = tqdm(total=end_step, initial=start_step, disable=train_args.disable_tqdm or not info.is_main, desc="train", unit="step", dynamic_ncols=True)
    model.train()
    window_t, window_steps = time.perf_counter(), 0
    step = start_step
    for step in range(start_step + 1, end_step + 1):
        loss = train_step(model, prep, step - 1, info)
        grad_norm = clip_gradients(model, train_args.max_grad_norm)
        lr = scheduler.get_last_lr()[0]
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        window_steps += 1
        bar.update(1)
        if step % train_args.logging_steps == 0 or step == end_step:
            if info.device.type == "cuda":
                torch.cuda.synchronize()
            elapsed = time.perf_counter() - window_t
            tps = tokens_per_step * window_steps / elapsed
            rec = {"step": step, "loss": loss, "learning_rate": lr, "grad_norm": grad_norm, "tokens_per_second": tps,
                   "tokens_per_second_per_device": tps / info.world_size, "world_size": info.world_size,
                   "global_batch_size": prep.plan.global_batch_size, "epoch": step / prep.order.steps_per_epoch}
            if (u := metrics.mfu(tps, fpt, peak, info.world_size)) is not None:
                rec["mfu"] = u
            if (mem := metrics.max_memory_gb(info.device)) is not None:
                rec["max_memory_allocated_gb"] = mem
            writer.write(rec)
            if info.is_main:
                tqdm.write(metrics.format_line(rec, prep.total_steps))
            last = rec
            window_t, window_steps = time.perf_counter(), 0
        if train_args.eval_steps and step % train_args.eval_steps == 0 and step != prep.total_steps:
            log_eval(step)
        if distributed.any_rank(terminate.requested, info.device):
            if info.is_main:
                tqdm.write(f"SIGTERM: saving checkpoint-{step} before exiting")
            save(step)
            writer.close()
            bar.close()
            distributed.destroy()
            sys.exit(143)
        if train_args.save_steps and step % train_args.save_steps == 0 and step != end_step:
            save(step)
    bar.close()
    if end_step == prep.total_steps:
        log_eval(end_step)
    if end_step > start_step:
        save(end_step)
    if end_step == prep.total_steps and train_args.export_final:
        out = checkpoint.export_safetensors(model, prep.config, prep.tokenizer, Path(train_args.output_dir) / "final", info.rank)
        if info.is_main:
            print(f"final model: {out} (AutoModelForCausalLM.from_pretrained loads it)", flush=True)
    writer.close()
    if info.is_main:
        png = metrics.plot_losses(train_args.output_dir)
        print(f"metrics: {Path(train_args.output_dir) / 'metrics.jsonl'}, curves: {png}", flush=True)
    distributed.destroy()
    return last


def main(argv: list[str] | None = None) -> None:
    try:
        model_args, data_args, train_args = parse_args(argv)
        run(model_args, data_args, train_args)
    except ValueError as e:  # bad input: one clear line, no traceback
        print(f"error: {e}", file=sys.stderr)
        distributed.destroy()
        sys.exit(2)

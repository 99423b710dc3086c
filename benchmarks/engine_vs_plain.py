"""Steps/s of the FSDP2 engine against a plain PyTorch loop over the same model and batches.

One process. The plain loop is what you would write by hand: the unsharded model, AdamW,
forward/backward per micro-batch, clip, step. Both read the same micro-batches from the packed dataset each step; the engine runs them as
its loop does: `fsdp_engine.train_step` on the step DataLoader's items (a worker process on a GPU or a spare core; token-normalised loss; FSDP2 wrapping
where it shards, i.e. not on one fp32 process), clipping, and the loss and gradient norm read on logging
steps only (every 10, the default --logging_steps; the plain loop reads them as often). Both take the
model's own loss (`--lean_loss false` for the engine): this measures the loop, benchmarks/lean_loss.py the loss.
Rounds alternate between the two so machine noise hits both alike.

    .venv/bin/python benchmarks/engine_vs_plain.py [--config_name tiny] [--steps 20] [--rounds 3] [--block_size 128] [--loader_workers N]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import anygpu  # noqa: E402

anygpu.set_offline_defaults()

import torch  # noqa: E402

from anygpu.config.args import parse_args  # noqa: E402
from anygpu.data.prepare import prepare  # noqa: E402
from anygpu.engines import fsdp as fsdp_engine  # noqa: E402
from anygpu.model import modeling
from anygpu.runtime import distributed, parallel
from anygpu.train import optim

LOG_EVERY = 10


def plain_step(model, opt, prep, micro_batches, device, max_norm: float, step: int) -> None:
    batches = [
        {k: v.to(device) for k, v in prep.collator.read(prep.datasets["train"], idx).items()} for idx in micro_batches
    ]
    n = sum(b["labels"][:, 1:].numel() for b in batches)
    for b in batches:
        loss = model(input_ids=b["input_ids"], labels=b["labels"], num_items_in_batch=n).loss
        loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    opt.step()
    opt.zero_grad(set_to_none=True)
    if step % LOG_EVERY == 0:
        loss.item(), norm.item()


def engine_step(model, opt, prep, step, info, max_norm: float, cpu) -> None:
    loss = fsdp_engine.train_step(model, prep, step, info, cpu)
    norm = fsdp_engine.clip_gradients(model, max_norm)
    opt.step()
    opt.zero_grad(set_to_none=True)
    if step % LOG_EVERY == 0:
        fsdp_engine.global_loss(loss), norm.item()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config_name", default="tiny")
    p.add_argument("--block_size", default="128")
    p.add_argument("--global_batch_size", default="8")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--loader_workers", type=int, default=None, help="DataLoader workers (default: the engine's choice)")
    a = p.parse_args()
    model_args, data_args, train_args = parse_args(
        [
            "--config_name",
            a.config_name,
            "--block_size",
            a.block_size,
            "--global_batch_size",
            a.global_batch_size,
            "--max_corpus_mb",
            "2",
            "--output_dir",
            "/tmp/anygpu-bench",
            # the loop's cost, not the loss kernel's: both sides take the model's own loss
            # (the lean loss against it: benchmarks/lean_loss.py)
            "--lean_loss",
            "false",
        ]
    )
    info = distributed.init_distributed()
    prep = prepare(model_args, data_args, train_args, info)
    engine = fsdp_engine.build_model(prep, model_args, train_args, info)
    engine_opt = optim.build_optimizer(engine, train_args, info.device)
    plain = modeling.build_full_model(prep.config, model_args, train_args.seed).to(info.device)
    plain_opt = optim.build_optimizer(plain, train_args, info.device)
    # both loops read the same micro-batches of the global order from the packed dataset each step
    micro = [prep.order.micro_batches(s, prep.plan, 0) for s in range(a.steps)]

    def timed(fn) -> float:
        start = time.perf_counter()
        for s in range(a.steps):
            fn(s)
        if info.device.type == "cuda":
            torch.cuda.synchronize()
        return a.steps / (time.perf_counter() - start)

    run_plain = lambda s: plain_step(plain, plain_opt, prep, micro[s], info.device, train_args.max_grad_norm, s)  # noqa: E731
    # each round replays steps 0..steps-1: a fresh loader iterator per round, as a resumed run would start one
    batches = {}

    def run_engine(s: int) -> None:
        if s == 0:
            batches[0] = iter(fsdp_engine.steps(prep, info, 0, a.steps, a.loader_workers))
        engine_step(engine, engine_opt, prep, s, info, train_args.max_grad_norm, next(batches[0]))

    run_plain(0), run_engine(0)  # warm-up (allocator, lazy init)
    ratios, plain_rates, engine_rates = [], [], []
    for r in range(a.rounds):
        pr, er = timed(run_plain), timed(run_engine)
        plain_rates.append(pr), engine_rates.append(er), ratios.append(er / pr)
        print(f"round {r + 1}: plain {pr:.2f} steps/s, engine {er:.2f} steps/s, ratio {er / pr:.3f}", flush=True)
    print(
        f"{a.config_name} preset, block {prep.block_size}, {prep.plan.banner()}, {info.device}: "
        f"{'FSDP2-sharded' if parallel.is_sharded(engine) else 'unsharded'} engine: engine/plain steps/s = {statistics.median(ratios):.3f} (median of {a.rounds} rounds of {a.steps} steps; target ≥ 0.97)"
    )
    batches.clear()  # workers, if any, stop
    distributed.destroy()


if __name__ == "__main__":
    main()

"""Gradient accumulation on the native FSDP2 engine: tokens/s of reduce-scattering every micro-batch (what the engine
does: a rank holds only its shard of the gradients) against deferring the reduce-scatter to the last micro-batch
(the engine before: +1x the model's fp32 size per rank until then), as a ratio.

One launch; both ways on the same sharded model and the same steps, in alternating rounds (machine noise hits both
alike), median time per optimizer step after a warm-up step.

    torchrun --standalone --nproc-per-node 2 benchmarks/accumulation_speed.py [--config_name default]
        [--block_size 128] [--accumulation 4] [--rounds 3] [--steps 2]
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
from anygpu.runtime import distributed, parallel  # noqa: E402
from anygpu.train import optim  # noqa: E402

EVERY_MICRO_BATCH = parallel.set_gradient_reduction


def deferred(model, last_micro_batch: bool) -> None:
    """The engine before: the whole reduction (reduce-scatter and all-reduce) waits for the last micro-batch."""
    model.set_requires_gradient_sync(last_micro_batch)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config_name", default="default")
    p.add_argument("--block_size", type=int, default=128)
    p.add_argument("--accumulation", type=int, default=4)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=2, help="optimizer steps per round and way")
    p.add_argument("--bf16", action="store_true")
    args = p.parse_args()
    info = distributed.init_distributed()
    world = info.world_size
    engine_args = ["--config_name", args.config_name, "--block_size", str(args.block_size)]
    engine_args += ["--per_device_train_batch_size", "1", "--global_batch_size", str(world * args.accumulation)]
    engine_args += ["--max_corpus_mb", "2", "--output_dir", "/tmp/anygpu-bench", "--report_to", "none"]
    engine_args += ["--bf16", "true"] if args.bf16 else []
    model_args, data_args, train_args = parse_args(engine_args)
    prep = prepare(model_args, data_args, train_args, info)
    model = fsdp_engine.build_model(prep, model_args, train_args, info)
    opt = optim.build_optimizer(model, train_args, info.device)
    ways = {"every micro-batch": EVERY_MICRO_BATCH, "deferred": deferred}
    times: dict[str, list[float]] = {name: [] for name in ways}
    step = 0
    for r in range(args.rounds + 1):  # round 0: warm-up
        for name, way in ways.items():
            parallel.set_gradient_reduction = way
            for _ in range(args.steps):
                t0 = time.perf_counter()
                fsdp_engine.train_step(model, prep, step, info)
                opt.step()
                opt.zero_grad(set_to_none=True)
                if info.device.type == "cuda":
                    torch.cuda.synchronize()
                distributed.barrier()
                if r:
                    times[name].append(time.perf_counter() - t0)
                step += 1
    parallel.set_gradient_reduction = EVERY_MICRO_BATCH
    tokens = world * args.accumulation * args.block_size
    rate = {name: tokens / statistics.median(t) for name, t in times.items()}
    if info.is_main:
        print(
            f"{args.config_name}, {world} ranks × {args.accumulation} accumulation steps × 1 × {args.block_size} tokens"
        )
        for name, r in rate.items():
            print(f"  reduce-scatter {name}: {r:.0f} tokens/s")
        print(f"ratio (every micro-batch / deferred): {rate['every micro-batch'] / rate['deferred']:.3f}")
    distributed.destroy()


if __name__ == "__main__":
    main()

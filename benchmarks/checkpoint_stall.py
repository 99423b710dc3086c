"""Training stall per checkpoint: synchronous save vs asynchronous save (`--async_save`).

One process, the FSDP2 engine's model and AdamW state (after one step, so the optimizer state exists).
The stall of a synchronous save is the whole write; that of an asynchronous one is the staging copy
plus any wait for the previous write (`AsyncCheckpointer.stalls`). Between asynchronous saves the loop
trains `--steps_between` steps, as a run would; each save is committed before the next.

    .venv/bin/python benchmarks/checkpoint_stall.py [--config_name default] [--saves 3]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time

from _common import setup

from anygpu.checkpoint import async_store, store
from anygpu.engines import fsdp as fsdp_engine
from anygpu.runtime import distributed
from anygpu.train import optim


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config_name", default="default")
    p.add_argument("--block_size", type=int, default=128)
    p.add_argument("--global_batch_size", type=int, default=8)
    p.add_argument("--saves", type=int, default=3)
    p.add_argument("--steps_between", type=int, default=3)
    a = p.parse_args()
    model_args, _, train_args, info, prep = setup(a.config_name, a.block_size, a.global_batch_size)
    model = fsdp_engine.build_model(prep, model_args, train_args, info)
    opt = optim.build_optimizer(model, train_args, info.device)
    sched = optim.build_scheduler(opt, train_args, 1000)
    step = 0

    def train(n: int) -> None:
        nonlocal step
        for _ in range(n):
            fsdp_engine.train_step(model, prep, step, info)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            step += 1

    train(1)
    out = tempfile.mkdtemp(prefix="anygpu-stall-")
    state = {"global_step": 0, "global_batch_size": a.global_batch_size, "world_size": info.world_size}
    sync_stalls = []
    for i in range(a.saves):
        train(a.steps_between)
        start = time.perf_counter()
        store.save(out, step, model, opt, sched, state, 2, info.rank)
        sync_stalls.append(time.perf_counter() - start)
    saver = async_store.AsyncCheckpointer(out, 2, info.rank, info.device)
    for i in range(a.saves):
        train(a.steps_between)
        saver.poll()
        saver.save(step, model, opt, sched, state)
    saver.close()
    nbytes = sum(f.stat().st_size for f in store.checkpoints(out)[-1].rglob("*") if f.is_file())
    sync_s, async_s = statistics.median(sync_stalls), statistics.median(saver.stalls)
    print(
        f"{a.config_name} preset, checkpoint {nbytes / 2**20:.0f} MiB, {info.device}: stall per save "
        f"sync {sync_s * 1000:.0f} ms, async {async_s * 1000:.0f} ms; async/sync = {async_s / sync_s:.3f} "
        f"(median of {a.saves} saves; target <= 0.25)"
    )
    shutil.rmtree(out, ignore_errors=True)
    distributed.destroy()


if __name__ == "__main__":
    main()

"""Steps/s of the FSDP2 engine's loop on a large packed corpus (~700k samples) against a small one (2,000),
same model and batch: the per-step cost of the data order and the reads must not grow with the corpus.

The large corpus is synthetic packed token ids written to disk and memory-mapped, as `pack` leaves them
(tokenising 700k real blocks would take an hour here). Also printed: the per-step cost of the data
order as it was before (a whole-corpus randperm every step). Rounds alternate between the two corpora.

    .venv/bin/python benchmarks/corpus_scaling.py [--large 700000] [--steps 20] [--rounds 3]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import numpy as np
import torch
from _common import setup
from datasets import Dataset, load_from_disk

from anygpu.data.order import GlobalOrder
from anygpu.engines import fsdp as fsdp_engine
from anygpu.runtime import distributed
from anygpu.train import optim
from _scratch import scratch_folder


def synthetic(num_samples: int, block_size: int, vocab: int, folder: str) -> Dataset:
    """`num_samples` packed rows of random ids, saved and memory-mapped like the engine's cache."""
    rng = np.random.default_rng(0)

    def rows():
        for start in range(0, num_samples, 50_000):
            n = min(50_000, num_samples - start)
            yield {"input_ids": rng.integers(0, vocab, (n, block_size), dtype=np.int64).tolist()}

    chunks = [Dataset.from_dict(r) for r in rows()]
    from datasets import concatenate_datasets

    concatenate_datasets(chunks).save_to_disk(folder)
    return load_from_disk(folder)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config_name", default="tiny")
    p.add_argument("--block_size", type=int, default=64)
    p.add_argument("--global_batch_size", type=int, default=8)
    p.add_argument("--small", type=int, default=2_000)
    p.add_argument("--large", type=int, default=700_000)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args()
    model_args, _, train_args, info, prep = setup(a.config_name, a.block_size, a.global_batch_size)
    folder = scratch_folder("anygpu-corpus-")
    t0 = time.perf_counter()
    large = synthetic(a.large, prep.block_size, prep.config.vocab_size, folder)
    print(f"synthetic corpus of {len(large):,} packed samples written in {time.perf_counter() - t0:.0f} s", flush=True)
    small = large.select(range(a.small)).flatten_indices()
    model = fsdp_engine.build_model(prep, model_args, train_args, info)
    opt = optim.build_optimizer(model, train_args, info.device)

    def variant(ds: Dataset):
        return dataclasses.replace(
            prep,
            datasets={"train": ds, "validation": prep.datasets["validation"]},
            order=GlobalOrder(len(ds), prep.plan.global_batch_size, train_args.seed),
        )

    preps = {"small": variant(small), "large": variant(large)}

    def timed(pr) -> float:
        start = time.perf_counter()
        batches = iter(fsdp_engine.steps(pr, info, 0, a.steps))
        for s in range(a.steps):
            fsdp_engine.train_step(model, pr, s, info, next(batches))
            fsdp_engine.clip_gradients(model, train_args.max_grad_norm)
            opt.step()
            opt.zero_grad(set_to_none=True)
        del batches  # workers, if any, stop
        if info.device.type == "cuda":
            torch.cuda.synchronize()
        return a.steps / (time.perf_counter() - start)

    timed(preps["small"]), timed(preps["large"])  # warm-up: the epoch permutations, the file cache
    ratios = []
    for r in range(a.rounds):
        sm, lg = timed(preps["small"]), timed(preps["large"])
        ratios.append(lg / sm)
        print(
            f"round {r + 1}: {a.small:,} samples {sm:.2f} steps/s, {len(large):,} samples {lg:.2f} steps/s, ratio {lg / sm:.3f}",
            flush=True,
        )
    g = torch.Generator()
    start = time.perf_counter()
    for s in range(5):
        torch.randperm(len(large), generator=g.manual_seed(s))
    old = (time.perf_counter() - start) / 5
    print(
        f"{a.config_name} preset, block {prep.block_size}, global batch {prep.plan.global_batch_size}: steps/s at "
        f"{len(large):,} / at {a.small:,} samples = {statistics.median(ratios):.3f} (median of {a.rounds}; target >= 0.9); "
        f"the old per-step whole-corpus randperm alone cost {old * 1000:.1f} ms per step at {len(large):,}"
    )
    distributed.destroy()


if __name__ == "__main__":
    main()

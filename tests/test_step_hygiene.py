"""What a step costs besides its math, in process: torch.compile's graph breaks and recompilations counted, the
garbage collector on a schedule, flash attention's sample boundaries computed on the CPU once per micro-batch,
and MFU's attention term over each packed sample's own length."""

from __future__ import annotations

import gc

import numpy as np
import torch
from datasets import Dataset

from anygpu.config.batch import plan_batch
from anygpu.data.collate import Collator, pack_samples
from anygpu.data.order import GlobalOrder
from anygpu.runtime import compile_stats
from anygpu.runtime.gc_schedule import GarbageCollection
from anygpu.train import metrics


def test_compile_watch_reports_graph_breaks_then_recompilations():
    def branchy(x: torch.Tensor, scale: float) -> torch.Tensor:
        y = x * 2
        if y.sum() > 0:  # data-dependent control flow: a graph break
            y = y + 1
        return y * scale

    watch = compile_stats.CompileWatch(True)
    compiled = torch.compile(branchy, backend="eager")
    compiled(torch.ones(4), 2.0)
    line, warn = watch.after_step(1)
    assert warn and "graph break" in line and "0 graph breaks" not in line and "Data-dependent" in line
    compiled(torch.ones(4), 2.0)
    assert watch.after_step(2) is None  # nothing compiled again
    compiled(torch.ones(4), 3.0)  # a new Python float: the guard on `scale` fails, a recompilation
    line, warn = watch.after_step(3)
    assert warn and "between steps 1 and 3" in line and "recompilations" in line
    assert compile_stats.CompileWatch(False).after_step(1) is None


def test_the_collector_runs_between_steps_on_its_schedule_only():
    runs: list[int] = []

    def seen(phase: str, info: dict) -> None:
        if phase == "start":
            runs.append(info["generation"])

    gc.callbacks.append(seen)
    try:
        collector = GarbageCollection(3)
        assert not gc.isenabled() and runs == [1]  # one collection before training
        for step in range(1, 8):
            [[] for _ in range(10_000)]  # garbage an automatic collector would collect mid-step
            collector.after_step(step)
        assert runs == [1, 1, 1]  # after steps 3 and 6 only
        collector.close()
        assert gc.isenabled()
    finally:
        gc.callbacks.remove(seen)
        gc.enable()
    assert GarbageCollection(0).every == 0 and gc.isenabled()


def test_flash_attentions_sample_boundaries_are_transformers_own():
    """The collator's boundaries for packed rows flattened into one row equal what transformers' flash attention
    derives from the positions (then in every layer, on the GPU, with a host sync)."""
    from transformers.modeling_flash_attention_utils import prepare_fa_kwargs_from_position_ids

    collator = Collator(pad_token_id=0, packed=True, varlen=True)
    rows = {
        "input_ids": [[5] * 7, [6] * 4, [7] * 9],
        "labels": [[5] * 7, [6] * 4, [7] * 9],
        "position_ids": [[0, 1, 2, 0, 1, 0, 1], [0, 1, 2, 3], [0, 1, 2, 3, 4, 5, 0, 1, 2]],
    }
    batch = collator.collate(rows)
    (cu_q, cu_k), (max_q, max_k) = prepare_fa_kwargs_from_position_ids(batch["position_ids"].reshape(1, -1))
    assert torch.equal(batch["cu_seq_lens_q"], cu_q.to(torch.int32)) and torch.equal(batch["cu_seq_lens_k"], cu_k)
    assert batch["max_length_q"] == int(max_q) == batch["max_length_k"] == 6
    assert "cu_seq_lens_q" not in Collator(pad_token_id=0, packed=True).collate(rows)  # sdpa, eager: not needed


def test_mfu_counts_attention_over_each_packed_samples_own_length():
    """Packed rows of short samples do a fraction of one long sequence's attention: Σ s² over the samples."""
    lengths = [3, 5, 8, 2, 6, 4, 7, 1] * 6
    samples = Dataset.from_dict({"input_ids": [[1] * n for n in lengths], "labels": [[1] * n for n in lengths]})
    packed = pack_samples(samples, capacity=16)
    positions = packed["position_ids"]
    expected = [sum(len(s) ** 2 for s in _runs(p)) for p in positions]
    assert metrics.sample_squares(packed, 16, chunk_rows=3).tolist() == expected  # read a few rows at a time
    order, plan = GlobalOrder(len(packed), 4, seed=0), plan_batch(4, 2, 1)
    step_squares = metrics.StepTokens(packed, order, 16).squares(0, plan)
    assert step_squares == sum(expected[i] for i in order.global_batch(0)) < 4 * 16**2
    blocks = Dataset.from_dict({"input_ids": [[1] * 16] * 8})  # raw-text blocks: one sequence each
    assert metrics.StepTokens(blocks, GlobalOrder(8, 4, seed=0), 16).squares(0, plan) == 4 * 16**2
    flops = metrics.Flops(per_token=100.0, per_token_squared=10.0)
    assert flops.of(64, step_squares) == 100 * 64 + 10 * step_squares and flops.at(16) == 100 + 10 * 16


def _runs(positions: list[int]) -> list[list[int]]:
    starts = [i for i, p in enumerate(positions) if p == 0] + [len(positions)]
    return [positions[a:b] for a, b in zip(starts, starts[1:])]


def test_sample_squares_of_padded_rows_are_their_lengths():
    rows = Dataset.from_dict({"input_ids": [[1] * 3, [1] * 5], "labels": [[1] * 3, [1] * 5]})
    assert np.array_equal(metrics.sample_squares(rows, 8), [9, 25])

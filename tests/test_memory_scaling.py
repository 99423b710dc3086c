"""Memory that divides by the number of ranks, measured: benchmarks/memory_scaling.py's two launches (1 and 2
ranks of `accelerate launch` with the ZeRO-3 config, ranks forked from a warm launcher), the benchmark's model with 8
of its 24 layers (34M parameters, 0.54 GB of training state in fp32, which still dominates; 10 s less on 2 cores),
1 optimizer step each (the peak is reached in the first step, where AdamW makes its states). Peak resident set per
rank above its baseline. 2 ranks, not the benchmark's 4 (0.34 and 0.37 there, docs/memory.md): 2 cores run 3
processes, not 5, and a rank that held the whole model would still read ~1.0. That 4 accumulation steps hold no more
gradient than 1 is counted exactly, in bytes after each micro-batch, by tests/test_fsdp_engine.py (the benchmark
measures its peak: +0.01x)."""

from __future__ import annotations

import sys

import pytest
from conftest import ROOT, WARM

sys.path.insert(0, str(ROOT / "benchmarks"))

import memory_scaling  # noqa: E402

pytestmark = pytest.mark.slow  # starts training processes


@pytest.fixture(scope="module")
def measured() -> dict:
    from conftest import env

    got = memory_scaling.measure(
        2,
        1,
        launcher=[*WARM[:2], "accelerate", "launch"],
        env=env(),
        native_steps=1,
        accumulation=False,
        hf_checkpoint=False,
        layers=8,
    )
    print("memory_scaling:", got)  # the figures, with -s
    return got


def test_native_engine_peak_per_rank_divides_by_the_ranks(measured):
    """The native FSDP2 engine on 2 ranks: each rank's peak at most 0.6x one rank's (ideal 0.5x, measured 0.51 with 8
    layers, 0.52 with 24: what stays above it is the units FSDP2 gathers, each a few % of the model)."""
    assert measured["fsdp_ratio"] <= 0.6, measured


def test_hf_engine_zero3_peak_per_rank_divides_by_the_ranks(measured):
    """The HF engine under DeepSpeed ZeRO-3 on 2 ranks: each rank's peak at most 0.6x one rank's (measured 0.54 with
    8 or 24 layers; no rank builds the whole fp32 model: zero.Init partitions it as it is built, then each rank writes
    its seeded partitions)."""
    assert measured["hf_zero3_ratio"] <= 0.6, measured

"""`--per_device_train_batch_size auto`: the largest divisor of the per-rank share that fits the
memory budget, the same on every rank, the global batch unchanged (so the loss curve equals the run
with that micro-batch given by hand). On CPU the budget is --max_memory_per_device_gb against the
plan's estimate; on a GPU the probe measures a forward + backward."""

from __future__ import annotations

import re

import pytest
import torch
from conftest import TINY, assert_close, fsdp_runs, losses

from anygpu.config.args import parse_args
from anygpu.planning import auto_batch, memory_plan
from anygpu.tools.plan import load_shapes

CPU = torch.device("cpu")


def test_largest_fitting_divisor():
    cost = {12: 120, 6: 60, 4: 40, 3: 30, 2: 20, 1: 10}
    probe = auto_batch.choose(12, cost.__getitem__, budget_bytes=50, device=CPU, how="estimated")
    assert probe.micro_batch == 4  # 40 ≤ 0.9 × 50 = 45 < 60
    assert [m for m, _, _ in probe.tried] == [12, 6, 4]
    assert "chosen 4 on every rank" in probe.line()
    with pytest.raises(ValueError, match="--per_device_train_batch_size auto.*--max_memory_per_device_gb"):
        auto_batch.choose(12, cost.__getitem__, budget_bytes=5, device=CPU, how="estimated")


def test_auto_is_accepted_and_refused_with_accumulation():
    _, _, t = parse_args(["--per_device_train_batch_size", "auto", "--global_batch_size", "8"])
    assert t.auto_micro_batch and t.per_device_train_batch_size is None and t.global_batch_size == 8
    with pytest.raises(ValueError, match="--gradient_accumulation_steps 2"):
        parse_args(["--per_device_train_batch_size=auto", "--gradient_accumulation_steps", "2"])
    with pytest.raises(ValueError, match="--max_memory_per_device_gb"):
        auto_batch.budget(None, CPU)


def budget_gb_between(m_fit: int, m_too_big: int, world: int) -> float:
    """A budget under which the plan's estimate fits m_fit but not m_too_big (tiny, fp32, FSDP2)."""
    shapes, _, _ = load_shapes(None, "tiny")
    cost = auto_batch.estimate_cost(shapes, "fsdp2", "fp32", world, 64, False)
    lo, hi = cost(m_fit) / memory_plan.SAFETY, cost(m_too_big) / memory_plan.SAFETY
    assert lo < hi
    return (lo + hi) / 2 / 2**30


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """2 ranks, G = 8 (4 sequences per rank): auto under a budget that fits 2 but not 4, and m = 2 by hand,
    one after the other in one torchrun launch (each run's own stdout)."""
    common = [*TINY, "--max_steps", "4", "--export_final", "false"]
    auto_dir, hand_dir = tmp_path_factory.mktemp("auto"), tmp_path_factory.mktemp("hand")
    auto, _ = fsdp_runs(
        2,
        [
            [
                *common,
                "--output_dir",
                str(auto_dir),
                "--per_device_train_batch_size",
                "auto",
                "--max_memory_per_device_gb",
                str(budget_gb_between(2, 4, 2)),
            ],
            [*common, "--output_dir", str(hand_dir), "--per_device_train_batch_size", "2"],
        ],
    )
    return auto, auto_dir, hand_dir


@pytest.mark.slow
def test_auto_picks_the_largest_fitting_divisor_on_every_rank(runs):
    auto, _, _ = runs
    # ranks print at once (lines may interleave): find each rank's choice
    assert sorted(re.findall(r"rank (\d): micro-batch auto → (\d+)", auto)) == [("0", "2"), ("1", "2")]
    assert "global batch 8 = 2 per device × 2 devices × 2 accumulation steps" in auto
    assert "micro-batch auto (estimated" in auto and "4 → " in auto and "too big" in auto


@pytest.mark.slow
def test_auto_loss_curve_equals_the_hand_given_micro_batch(runs):
    _, auto_dir, hand_dir = runs
    assert_close(losses(auto_dir), losses(hand_dir), rel=1e-5)


@pytest.mark.slow
def test_hf_engine_auto_under_a_budget(tmp_path):
    """The HF engine (one process, plain python): 8 sequences per rank, a budget that fits 4 but not 8."""
    from conftest import python

    proc = python(
        "run_hf_standalone.py",
        [
            *TINY,
            "--max_steps",
            "1",
            "--export_final",
            "false",
            "--output_dir",
            str(tmp_path),
            "--per_device_train_batch_size",
            "auto",
            "--max_memory_per_device_gb",
            str(budget_gb_between(4, 8, 1)),
        ],
    )
    assert "rank 0: micro-batch auto → 4" in proc.stdout
    assert "global batch 8 = 4 per device × 1 device × 2 accumulation steps" in proc.stdout
    assert "8 → " in proc.stdout and "chosen 4 on every rank" in proc.stdout


def test_auto_counts_a_lora_model_as_the_engines_hold_it(tmp_path):
    """With --use_peft the estimate holds the frozen base's weights only (no gradients, no AdamW state for it)."""
    from types import SimpleNamespace

    from test_lora import build_base

    from anygpu.config.batch import plan_batch
    from anygpu.model import modeling

    build_base(tmp_path)
    m, _, t = parse_args(
        [
            "--model_name_or_path",
            str(tmp_path),
            "--use_peft",
            "true",
            "--lora_target_modules",
            "all-linear",
            "--per_device_train_batch_size",
            "auto",
            "--global_batch_size",
            "4",
            "--max_memory_per_device_gb",
            "1",
        ]
    )
    prep = SimpleNamespace(config=modeling.resolve_config(m), plan=plan_batch(4, 1), block_size=64)
    probe = auto_batch.apply(prep, m, t, CPU, "fsdp2")
    lora_shapes, _, _ = load_shapes(str(tmp_path), None, m.lora_r, ("all-linear",))
    full_shapes, _, _ = load_shapes(str(tmp_path), None)
    expected = auto_batch.estimate_cost(lora_shapes, "fsdp2", "fp32", 1, 64, False)
    full = auto_batch.estimate_cost(full_shapes, "fsdp2", "fp32", 1, 64, False)
    assert [b for _, b, _ in probe.tried] == [expected(mb) for mb, _, _ in probe.tried]
    assert expected(1) < full(1)  # the adapter's states instead of the whole model's


ONE_RANK_FAILS = """
import datetime, torch, torch.distributed as dist
from anygpu.planning import auto_batch
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
rank = dist.get_rank()
def out_of_memory_on_rank1(m):
    if rank == 1 and m == 4:
        raise torch.OutOfMemoryError("CUDA out of memory (forced on rank 1)")
    return m
def broken_on_rank1(m):
    if rank == 1:
        raise ValueError("a probe that breaks on rank 1")
    return m
outcomes = []
for cost in (out_of_memory_on_rank1, broken_on_rank1):
    try:
        outcomes.append(auto_batch.choose(4, cost, 100, torch.device("cpu"), "estimated").micro_batch)
    except Exception as e:
        outcomes.append(type(e).__name__)
every = [None, None]
dist.all_gather_object(every, outcomes)  # the ranks still agree on the sequence of collectives
print(f"rank {rank}: {every}", flush=True)
dist.destroy_process_group()
"""


@pytest.mark.slow  # a 2-rank launch
def test_a_probe_that_fails_on_one_rank_is_agreed_on_by_every_rank(tmp_path):
    """Rank 1's probe runs out of memory at micro-batch 4: every rank takes 2, and the ranks stay in one sequence
    of collectives (no hang); a probe that raises another error on rank 1 stops every rank at that candidate."""
    from conftest import torchrun

    script = tmp_path / "one_rank_fails.py"
    script.write_text(ONE_RANK_FAILS)
    proc = torchrun(2, str(script), [], check=False, timeout=120)
    expected = [[2, "RuntimeError"], [2, "ValueError"]]
    for rank in (0, 1):
        assert f"rank {rank}: {expected}" in proc.stdout, (proc.stdout[-2000:], proc.stderr[-3000:])


OOM_INSIDE_SHARDED_PROBE = """
import datetime, sys, time, torch, torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM
from anygpu.planning import auto_batch
from anygpu.runtime import parallel
from anygpu.runtime.mesh import MeshShape
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=600))  # a hang would outlast the test
rank, oom_ranks = dist.get_rank(), [int(r) for r in sys.argv[1].split(",")]
torch.manual_seed(0)
config = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64)
model = parallel.shard_model(LlamaForCausalLM(config), torch.device("cpu"), MeshShape(1, 2), False, False, False)
def out_of_memory_at_4(module, args, kwargs):  # after FSDP2's all-gather of this layer: mid-forward
    hidden = args[0] if args else kwargs["hidden_states"]
    if rank in oom_ranks and hidden.shape[0] == 4:
        raise torch.OutOfMemoryError("CUDA out of memory (forced in decoder layer 0)")
model.model.layers[0].register_forward_pre_hook(out_of_memory_at_4, with_kwargs=True)
cost = auto_batch.measured_cost(model, 128, 16, torch.device("cpu"), 0)
start = time.monotonic()
probe = auto_batch.choose(4, cost, 2**30, torch.device("cpu"), "measured")
print(f"rank {rank}: chose {probe.micro_batch} after {time.monotonic() - start:.0f} s", flush=True)
dist.destroy_process_group()
"""


@pytest.mark.slow  # a 2-rank launch each
@pytest.mark.parametrize("oom_ranks", ["1", "0,1"])
def test_an_out_of_memory_inside_a_sharded_probe_never_hangs(tmp_path, oom_ranks):
    """A real FSDP2-sharded model over 2 gloo ranks, probed at micro-batches 4, 2, 1; an out-of-memory is raised
    inside decoder layer 0's forward at micro-batch 4. On rank 1 alone: rank 0 is left waiting in the probe's next
    collective, so rank 1 stops the job at once, saying which rank, which micro-batch and what to pass instead. On
    both ranks: micro-batch 4 is agreed too big and both take 2."""
    from conftest import torchrun

    script = tmp_path / "oom_inside_probe.py"
    script.write_text(OOM_INSIDE_SHARDED_PROBE)
    # rank 1 alone: rank 0 never says the same, so the wait for it is all its length (2 s, not the default 20)
    short = {"ANYGPU_OOM_AGREE_S": "2"} if oom_ranks == "1" else {}
    proc = torchrun(2, str(script), [oom_ranks], check=False, timeout=120, extra_env=short)
    out = proc.stdout + proc.stderr
    if oom_ranks == "1":
        assert proc.returncode != 0, out[-3000:]
        assert "rank 1 ran out of memory inside the sharded probe of micro-batch 4" in out, out[-3000:]
        assert "the other ranks did not within 2 s" in out  # the wait as ANYGPU_OOM_AGREE_S set it
        assert "--per_device_train_batch_size 2" in out
        assert "chose" not in out
    else:
        assert proc.returncode == 0, out[-3000:]
        assert sorted(re.findall(r"rank (\d): chose (\d)", out)) == [("0", "2"), ("1", "2")], out[-3000:]

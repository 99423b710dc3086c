"""--cpu_offload (FSDP2 engine): FSDP2's CPU offload policy on every unit, the same losses as without it on 1 and 2
ranks, checkpoints that resume on another world size, the host bytes a rank holds as the engine's check counts
them, and the refusals. On CPU the shards stay where they are: what a GPU moves is the GPU lease's to measure."""

from __future__ import annotations

import json

import pytest
from conftest import TINY, assert_close, losses, python, torchrun

from anygpu.config.args import parse_args
from anygpu.engines.trunk import startup
from anygpu.errors import UsageError
from anygpu.planning import memory_plan
from anygpu.runtime import hardware, offload
from anygpu.tools import plan as plan_tool

SIX = [*TINY, "--max_steps", "6", "--save_steps", "3", "--export_final", "false"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The plain one-process run; 2 offloaded ranks saving at step 3; one offloaded rank resuming that checkpoint."""
    root = tmp_path_factory.mktemp("offload")
    out = {name: root / name for name in ("plain", "two", "resumed")}
    python("run_fsdp_standalone.py", [*SIX, "--output_dir", str(out["plain"])])
    two = torchrun(2, "run_fsdp_standalone.py", [*SIX, "--cpu_offload", "true", "--output_dir", str(out["two"])])
    resumed = python(
        "run_fsdp_standalone.py",
        [*SIX, "--cpu_offload", "true", "--output_dir", str(out["resumed"]),
         "--resume_from_checkpoint", str(out["two"] / "checkpoint-3")],
    )  # fmt: skip
    return {"dirs": out, "stdout": {"two": two.stdout, "resumed": resumed.stdout}}


@pytest.mark.slow
def test_offloaded_ranks_train_the_same_curve(runs):
    """2 offloaded ranks against one plain process: the same losses (the offload moves state, not math)."""
    assert (
        "their shards in host memory, the optimizer step on the CPU (--cpu_offload: the same curve)"
        in runs["stdout"]["two"]
    )
    assert_close(losses(runs["dirs"]["plain"]), losses(runs["dirs"]["two"]), rel=1e-5, steps=range(1, 7))


@pytest.mark.slow
def test_an_offloaded_checkpoint_resumes_on_another_world_size(runs):
    """The 2-rank offloaded run's step-3 checkpoint, resumed by one offloaded process (FSDP2 on one rank: the
    offload needs it): steps 4-6 as the uninterrupted run's."""
    out = runs["stdout"]["resumed"]
    assert "resumed from" in out and "was 2 ranks, now 1" in out, out[-2000:]
    assert "mesh 1 × 1" in out and "(--cpu_offload: the same curve)" in out
    assert_close(losses(runs["dirs"]["plain"]), losses(runs["dirs"]["resumed"]), rel=1e-5, steps=range(4, 7))


@pytest.mark.slow
def test_a_rank_holds_on_the_host_what_the_check_counts():
    """After a step on 2 offloaded ranks with 8-bit AdamW state (--optim adamw_torch_8bit, offloaded like AdamW's):
    every FSDP2 parameter has the offload flag; each rank's host bytes of parameters, gradients and optimizer state
    are what `parallel.state_bytes_per_rank` (the start-up check) counts, half of one rank's; each rank's optimizer
    tensors are the plan's optimizer bytes for that rank, about a quarter of AdamW's."""
    args = [
        *TINY,
        "--max_steps",
        "1",
        "--cpu_offload",
        "true",
        "--optim",
        "adamw_torch_8bit",
        "--output_dir",
        "/tmp/unused",
    ]
    held, optim = {}, {}
    for n in (1, 2):
        proc = (
            python("tests/scripts/shard_bytes.py", args)
            if n == 1
            else torchrun(n, "tests/scripts/shard_bytes.py", args)
        )
        held[n] = json.loads(proc.stdout.split("OFFLOAD ", 1)[1].splitlines()[0])
        optim[n] = json.loads(proc.stdout.split("OPTIM ", 1)[1].splitlines()[0])
    for rank in held[2]:
        assert rank["offloaded"] and all(rank["offloaded"]), rank
        assert rank["host"] == rank["planned"], rank
        assert abs(rank["host"] - held[1][0]["host"] / 2) <= 0.05 * held[1][0]["host"] / 2, held
    shapes, _, _ = plan_tool.load_shapes(None, "tiny")  # anygpu plan's offload row: rank 0's bytes exactly
    low = memory_plan.replace(shapes, optim="adamw_torch_8bit")
    row = memory_plan.row_for(low, memory_plan.Machine(2, 80 << 30), "fsdp2_offload", "fp32", False, False, 1, 64)
    assert row.cpu_bytes == held[2][0]["host"], (row.cpu_bytes, held[2][0])
    for rank, got in enumerate(optim[2]):
        planned = memory_plan.model_state_bytes(low, "fsdp2", "fp32", 2, rank)[0]["optimizer"]
        adamw = memory_plan.model_state_bytes(shapes, "fsdp2", "fp32", 2, rank)[0]["optimizer"]
        assert got == planned and got < 0.3 * adamw, (rank, got, planned, adamw)


def test_the_host_check_refuses_what_the_node_cannot_hold(tmp_path):
    """The node's ranks times a rank's bytes against MemAvailable: refused in one message naming the option, the
    sizes and what to do; nothing refused where Linux does not say."""
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       16384000 kB\nMemAvailable:    8192000 kB\n")
    available = hardware.host_memory_bytes("MemAvailable", meminfo)
    assert available == 8192000 * 1024
    offload.check_host_memory(available // 8, 8, available)  # exactly fits
    with pytest.raises(UsageError, match=r"--cpu_offload true: this node's 8 rank\(s\) would hold 8\.0 GiB") as e:
        offload.check_host_memory(2**30, 8, 2**30)
    assert "more nodes" in str(e.value) and "--use_peft true" in str(e.value) and "anygpu plan" in str(e.value)
    offload.check_host_memory(2**40, 8, hardware.host_memory_bytes("MemAvailable", tmp_path / "absent"))


@pytest.mark.parametrize(
    "engine, extra, expected",
    [
        ("hf", [], "--cpu_offload true is the FSDP2 engine's"),
        ("fsdp", ["--fp8", "rowwise"], "--cpu_offload true with --fp8 rowwise"),
    ],
)
def test_offload_where_it_cannot_run_is_refused(engine, extra, expected):
    model_args, _, train_args = parse_args([*TINY, "--cpu_offload", "true", *extra, "--output_dir", "/tmp/unused"])
    with pytest.raises(UsageError, match=expected.replace("(", r"\(")):
        startup.check_levers(model_args, train_args, engine)

"""--train_timeout: once the first step is done a rank that hangs ends the job within the short timeout, not
--ddp_timeout's half hour (torchtitan's train_timeout_seconds); a checkpoint that keeps the other ranks waiting
longer than that is not a hang (it keeps --ddp_timeout). Real 2-rank gloo jobs."""

from __future__ import annotations


import pytest
from conftest import TINY, losses, torchrun

pytestmark = pytest.mark.slow

ARGS = [*TINY, "--max_steps", "4", "--export_final", "false", "--ddp_timeout", "600", "--train_timeout", "3"]


def test_a_rank_that_hangs_mid_training_ends_the_job_in_seconds(tmp_path):
    proc = torchrun(
        2,
        "run_fsdp_standalone.py",
        [*ARGS, "--save_strategy", "no", "--output_dir", str(tmp_path)],
        check=False,
        timeout=240,
        extra_env={"ANYGPU_TEST_STALL": "1:step:2:120"},  # rank 1 stops for 2 minutes after step 2
    )
    assert proc.returncode != 0
    assert "timed out" in (proc.stdout + proc.stderr).lower(), (proc.stdout + proc.stderr)[-3000:]


def test_a_slow_checkpoint_write_is_not_a_hang(tmp_path):
    """Rank 0 spends 8 s writing checkpoint-2 while rank 1 waits at the save's barrier: past the 3-s training
    timeout, inside --ddp_timeout, which checkpoints keep. The run completes with every step."""
    proc = torchrun(
        2,
        "run_fsdp_standalone.py",
        [*ARGS, "--save_steps", "2", "--async_save", "false", "--output_dir", str(tmp_path)],
        timeout=240,
        extra_env={"ANYGPU_TEST_STALL": "0:save:2:8"},
    )
    assert proc.returncode == 0
    assert sorted(losses(tmp_path)) == [1, 2, 3, 4]
    assert (tmp_path / "checkpoint-2").is_dir() and (tmp_path / "checkpoint-4").is_dir()

"""Fault injection for the tests, off unless its environment variables are set; called at the points
a fault matters (an evaluation, a checkpoint write)."""

from __future__ import annotations

import os
import signal
import time


def test_fault(point: str, step: int) -> None:
    """Fault injection for the tests, off unless set: ANYGPU_TEST_SIGTERM_AT=eval:4 makes rank 0 send itself
    SIGTERM as the evaluation at step 4 starts; ANYGPU_TEST_SLOW_SAVE=10:60 sleeps 60 s inside the write of
    checkpoint-10 (after the shards, before the rename), so a test can kill the job mid-write;
    ANYGPU_TEST_SLOW_RANK0=3 makes rank 0 wait 3 s at `point` "refusal" (before printing a refusal), so a
    test sees the other ranks' exits race it."""
    if os.environ.get("ANYGPU_TEST_SIGTERM_AT") == f"{point}:{step}" and os.environ.get("RANK", "0") == "0":
        os.kill(os.getpid(), signal.SIGTERM)
    slow = os.environ.get("ANYGPU_TEST_SLOW_SAVE", "")
    if point == "save" and slow.startswith(f"{step}:"):
        time.sleep(float(slow.split(":")[1]))
    slow_rank0 = os.environ.get("ANYGPU_TEST_SLOW_RANK0")
    if point == "refusal" and slow_rank0 and os.environ.get("RANK", "0") == "0":
        time.sleep(float(slow_rank0))

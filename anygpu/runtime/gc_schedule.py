"""Python's garbage collector on a schedule during training (torchtitan's `GarbageCollection`).

An automatic collection starts whenever allocations cross a threshold, so mid-step, on one rank at a time: that
rank then reaches the next collective late and the others wait for it (at 8 ranks a step pays the slowest rank's
pauses). While training, automatic collection is off and the young generations are collected every N steps,
between steps, on every rank at once; it is back on after training (the export, the end of the run).
"""

from __future__ import annotations

import gc
import logging
import time

logger = logging.getLogger(__name__)


class GarbageCollection:
    def __init__(self, every_steps: int) -> None:
        """`every_steps`: collect every N steps; 0 leaves the automatic collector as it is."""
        self.every = every_steps
        self.was_enabled = gc.isenabled()
        if self.every:
            gc.disable()
            self.collect("before training")

    def after_step(self, step: int) -> None:
        if self.every and step % self.every == 0:
            self.collect(f"at step {step}")

    def collect(self, when: str) -> None:
        start = time.monotonic()
        gc.collect(1)  # the young generations: what a step leaves behind; a full collection costs far more
        logger.debug("garbage collection %s: %.3f s", when, time.monotonic() - start)

    def close(self) -> None:
        if self.every and self.was_enabled:
            gc.enable()

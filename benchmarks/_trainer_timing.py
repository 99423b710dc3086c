"""Runs a training script (run_hf_standalone.py or benchmarks/_bare_trainer.py) and prints, as `TIMING {json}`,
its steady-state time between Trainer's loss logs (the first log left out: start-up) and, within it, the time
spent in `transformers.Trainer.training_step` itself (the model's forward and backward): the rest is the
loop around the model (data, optimizer, callbacks, and for the engine its overrides). Each as wall-clock
seconds and as the process's CPU seconds (`time.process_time`, all its threads), which another process's load
on a shared machine changes less.

    python benchmarks/_trainer_timing.py SCRIPT [script arguments]
"""

from __future__ import annotations

import atexit
import json
import runpy
import sys
import time
from pathlib import Path

from transformers import Trainer

inside = [0.0, 0.0]  # wall-clock and CPU seconds inside training_step
# at each loss log: (wall clock, CPU, wall clock inside training_step, CPU inside it)
marks: list[tuple[float, float, float, float]] = []


def _timed_training_step(original):
    def training_step(self, *args, **kwargs):
        start, cpu = time.perf_counter(), time.process_time()
        try:
            return original(self, *args, **kwargs)
        finally:
            inside[0] += time.perf_counter() - start
            inside[1] += time.process_time() - cpu

    return training_step


def _marking_log(original):
    def log(self, logs, *args, **kwargs):
        if "loss" in logs:
            marks.append((time.perf_counter(), time.process_time(), *inside))
        return original(self, logs, *args, **kwargs)

    return log


def _report() -> None:
    if len(marks) < 3:
        return
    (w0, c0, m0, mc0), (w1, c1, m1, mc1) = marks[1], marks[-1]
    timing = {
        "seconds": w1 - w0,
        "model_seconds": m1 - m0,
        "cpu_seconds": c1 - c0,
        "model_cpu_seconds": mc1 - mc0,
        "logs": len(marks) - 2,
    }
    print("TIMING " + json.dumps(timing), flush=True)


def main() -> None:
    Trainer.training_step = _timed_training_step(Trainer.training_step)
    Trainer.log = _marking_log(Trainer.log)
    atexit.register(_report)
    script = sys.argv[1]
    sys.argv = sys.argv[1:]
    sys.path.insert(0, str(Path(script).resolve().parent))
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()

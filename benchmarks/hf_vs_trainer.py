"""Tokens/s of the HF engine (run_hf_standalone.py: our sampler, callbacks, token-normalised loss, metrics)
against a bare `transformers.Trainer` on the same model, packed data, batch and optimizer (fused AdamW)
(benchmarks/_bare_trainer.py), one process each, alternating which goes first. Steady state: the time from
the second loss log to the last, so start-up is not counted. Target >= 0.97.

Each process also reports its time inside `Trainer.training_step` (the model's forward and backward,
benchmarks/_trainer_timing.py); the rest per step is the loop around the model, where the engine's own
code runs. On a shared CPU the model's time alone varies by ~10% from one process to the next, so the
per-step difference outside the model is the steadier measure of what the engine adds.

Each figure also comes as CPU time (the process's, all threads): other processes' load slows the wall clock
of a round by up to tens of percent on a shared machine, its CPU time much less. With `--threads 1` (one
intra-op thread, as benchmarks/lean_loss.py measures) the CPU time has no thread waiting for another in it:
the CPU-time ratio is then the steady figure; tokens/s stays the one the target is on.

    .venv/bin/python benchmarks/hf_vs_trainer.py [--config_name tiny] [--steps 150] [--rounds 5] [--threads N]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from _scratch import scratch_folder

ROOT = Path(__file__).resolve().parent.parent


def run(cmd: list[str], threads: int) -> str:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false"}
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)  # torch's intra-op threads in both processes
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} exited {proc.returncode}\n{proc.stderr[-3000:]}")
    return proc.stdout


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config_name", default="tiny")
    p.add_argument("--block_size", default="128")
    p.add_argument("--global_batch_size", default="8")
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--every", type=int, default=10)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=0, help="OMP_NUM_THREADS of both processes (0: torch's default)")
    a = p.parse_args()
    common = [
        "--config_name",
        a.config_name,
        "--block_size",
        a.block_size,
        "--global_batch_size",
        a.global_batch_size,
        "--max_corpus_mb",
        "2",
        "--max_steps",
        str(a.steps),
        "--logging_steps",
        str(a.every),
        "--report_to",
        "none",
        "--disable_tqdm",
        "true",
    ]
    steps = a.steps - 2 * a.every  # between the second log and the last
    tokens = int(a.global_batch_size) * int(a.block_size) * steps
    timing = [sys.executable, "benchmarks/_trainer_timing.py"]
    ratios, cpu_ratios, bare_step_ms = [], [], []
    loop_ms = {"engine": [], "bare": []}  # wall clock per step outside the model's forward and backward
    loop_cpu_ms = {"engine": [], "bare": []}  # the same in CPU time
    for r in range(a.rounds):
        out = scratch_folder("anygpu-hfbench-")
        # --lean_loss false: the bare Trainer takes the model's own loss (the lean one: benchmarks/lean_loss.py)
        engine_cmd = [
            *timing,
            "run_hf_standalone.py",
            *common,
            "--eval_steps",
            "0",
            "--eval_on_start",
            "false",
            "--export_final",
            "false",
            "--lean_loss",
            "false",
            "--output_dir",
            f"{out}/engine",
        ]
        bare_cmd = [*timing, "benchmarks/_bare_trainer.py", *common, "--output_dir", f"{out}/bare"]
        # who goes first alternates, so a slow spell of the machine hits both alike
        order = [("engine", engine_cmd), ("bare", bare_cmd)][:: 1 if r % 2 == 0 else -1]
        t = {name: json.loads(run(cmd, a.threads).split("TIMING ", 1)[1].splitlines()[0]) for name, cmd in order}
        for name in t:
            loop_ms[name].append(1000 * (t[name]["seconds"] - t[name]["model_seconds"]) / steps)
            loop_cpu_ms[name].append(1000 * (t[name]["cpu_seconds"] - t[name]["model_cpu_seconds"]) / steps)
        ratios.append(t["bare"]["seconds"] / t["engine"]["seconds"])
        cpu_ratios.append(t["bare"]["cpu_seconds"] / t["engine"]["cpu_seconds"])
        bare_step_ms.append(1000 * t["bare"]["seconds"] / steps)
        print(
            f"round {r + 1}: HF engine {tokens / t['engine']['seconds']:,.0f} tokens/s, bare Trainer "
            f"{tokens / t['bare']['seconds']:,.0f} tokens/s, ratio {ratios[-1]:.3f} (CPU time: {cpu_ratios[-1]:.3f}); "
            f"outside the model's forward and backward: {loop_ms['engine'][-1]:.2f} vs {loop_ms['bare'][-1]:.2f} ms "
            f"per step ({loop_cpu_ms['engine'][-1]:.2f} vs {loop_cpu_ms['bare'][-1]:.2f} ms of CPU)",
            flush=True,
        )
    extra = statistics.median(loop_ms["engine"]) - statistics.median(loop_ms["bare"])
    extra_cpu = statistics.median(loop_cpu_ms["engine"]) - statistics.median(loop_cpu_ms["bare"])
    bare_step = statistics.median(bare_step_ms)
    threads = f"{a.threads} thread{'s' if a.threads > 1 else ''}" if a.threads else "torch's default threads"
    print(
        f"{a.config_name} preset, block {a.block_size}, global batch {a.global_batch_size}, CPU, {threads}: HF engine / "
        f"bare Trainer tokens/s = {statistics.median(ratios):.3f} (median of {a.rounds}; target >= 0.97), CPU time per "
        f"step {statistics.median(cpu_ratios):.3f}. The engine's own cost per step, outside the model: {extra:+.2f} ms "
        f"over the bare Trainer's loop ({extra / bare_step:+.1%} of a {bare_step:.0f} ms step), {extra_cpu:+.2f} ms of "
        "CPU; the model's own time varies from process to process by more than that on a shared CPU."
    )


if __name__ == "__main__":
    main()

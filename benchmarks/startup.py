"""Start-up: seconds from the command to the end of the FSDP2 engine's first step (tiny preset, data
already cached, one process, as the engine logs it), against the bare imports of torch + transformers
(with the model classes a training script loads). Target: engine <= imports + 3 s. Both in wall-clock
and in CPU seconds (CPU time barely moves when other jobs share the cores; wall time does).
Rounds alternate so machine noise hits both.

    .venv/bin/python benchmarks/startup.py [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from _scratch import scratch_folder

ROOT = Path(__file__).resolve().parent.parent
IMPORTS = "import torch, transformers; from transformers import AutoModelForCausalLM, LlamaForCausalLM"
TINY = [
    "--config_name",
    "tiny",
    "--max_corpus_mb",
    "1",
    "--block_size",
    "64",
    "--global_batch_size",
    "8",
    "--logging_steps",
    "1",
    "--eval_steps",
    "0",
    "--eval_on_start",
    "false",
    "--disable_tqdm",
    "true",
    "--export_final",
    "false",
    "--max_steps",
    "3",
]


def env() -> dict[str, str]:
    return {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}


def imports_cost() -> tuple[float, float]:
    """(wall, CPU) seconds of a process that only imports torch and transformers."""
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-c", IMPORTS], cwd=ROOT, env=env())
    _, status, usage = os.wait4(proc.pid, 0)
    assert status == 0
    return time.perf_counter() - start, usage.ru_utime + usage.ru_stime


def engine_cost(cmd: list[str]) -> tuple[float, float]:
    """(wall, CPU) seconds from the process start to the end of its first step, from the engine's log line."""
    proc = subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True)
    m = re.search(
        r"first step done ([\d.]+) s after the process started \(([\d.]+) s of CPU\)", proc.stderr + proc.stdout
    )
    if proc.returncode != 0 or not m:
        raise SystemExit(f"{' '.join(cmd)} exited {proc.returncode}\n{proc.stderr[-3000:]}")
    return float(m.group(1)), float(m.group(2))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args()
    out = scratch_folder("anygpu-startup-")
    # the same folder each round (its caches stay warm); each run replaces the last
    engine_cmd = [
        sys.executable,
        "run_fsdp_standalone.py",
        *TINY,
        "--output_dir",
        out,
        "--overwrite_output_dir",
        "true",
    ]
    engine_cost(engine_cmd)  # fills the data and tokenizer cache, warms the file cache
    imports, engine = [], []
    for r in range(a.rounds):
        imports.append(imports_cost())
        engine.append(engine_cost(engine_cmd))
        print(
            f"round {r + 1}: imports {imports[-1][0]:.2f} s ({imports[-1][1]:.2f} s CPU), engine to first step "
            f"{engine[-1][0]:.2f} s ({engine[-1][1]:.2f} s CPU)",
            flush=True,
        )
    for k, kind in ((0, "wall"), (1, "CPU")):
        i, e = statistics.median(x[k] for x in imports), statistics.median(x[k] for x in engine)
        print(
            f"start-up ({kind}): engine to first step {e:.2f} s, bare torch + transformers imports {i:.2f} s: "
            f"engine - imports = {e - i:.2f} s (median of {a.rounds}; target <= 3 s)"
        )


if __name__ == "__main__":
    main()

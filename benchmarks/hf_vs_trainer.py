"""Tokens/s of the HF engine (run_hf_standalone.py: our sampler, callbacks, token-normalised loss, metrics)
against a bare `transformers.Trainer` on the same model, packed data and batch (benchmarks/_bare_trainer.py),
one process each, alternating. Steady state: the median over logging windows after the first, so
start-up is not counted. Target >= 0.97.

    .venv/bin/python benchmarks/hf_vs_trainer.py [--config_name tiny] [--steps 150] [--rounds 3]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run(cmd: list[str]) -> str:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false"}
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
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args()
    common = ["--config_name", a.config_name, "--block_size", a.block_size, "--global_batch_size", a.global_batch_size,
              "--max_corpus_mb", "2", "--max_steps", str(a.steps), "--logging_steps", str(a.every), "--report_to", "none",
              "--disable_tqdm", "true"]
    ratios = []
    for r in range(a.rounds):
        out = tempfile.mkdtemp(prefix="anygpu-hfbench-")
        run([sys.executable, "run_hf_standalone.py", *common, "--eval_steps", "0", "--eval_on_start", "false",
             "--export_final", "false", "--output_dir", f"{out}/engine"])
        recs = [json.loads(x) for x in Path(out, "engine", "metrics.jsonl").read_text().splitlines()]
        engine = statistics.median(x["tokens_per_second"] for x in recs if "tokens_per_second" in x and x["step"] > a.every)
        bare_out = run([sys.executable, "benchmarks/_bare_trainer.py", *common, "--output_dir", f"{out}/bare"])
        bare = json.loads(bare_out.split("BARE ", 1)[1].splitlines()[0])["tokens_per_second"]
        ratios.append(engine / bare)
        print(f"round {r + 1}: HF engine {engine:,.0f} tokens/s, bare Trainer {bare:,.0f} tokens/s, ratio {engine / bare:.3f}", flush=True)
    print(f"{a.config_name} preset, block {a.block_size}, global batch {a.global_batch_size}, CPU: HF engine / bare "
          f"Trainer tokens/s = {statistics.median(ratios):.3f} (median of {a.rounds}; target >= 0.97)")


if __name__ == "__main__":
    main()

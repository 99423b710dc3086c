"""Memory that divides by the number of ranks: each rank's peak memory on 4 ranks against 1, both engines, as ratios.

An 85M-parameter Llama (benchmarks/memory_model.json: 24 layers of hidden 512, vocabulary 8192), so that its
training state (16 bytes per parameter in fp32: weights, gradients, AdamW's two moments, 1.37 GB) dominates, trained
from scratch for 2 optimizer steps on 32-token micro-batches of 1 sequence, in two launches at once (`accelerate
launch` with the ZeRO-3 config, `--num_processes` 1 and 4; the native engine's runs go through the same launches):
- the native FSDP2 engine and the HF engine under DeepSpeed ZeRO-3, 1 accumulation step: each rank's peak on 4
  ranks / the peak of 1 rank (ideal 0.25);
- the native engine on 4 ranks with 4 accumulation steps against 1 (the same micro-batch): the extra peak per rank,
  as a fraction of the model's fp32 size (a full-size accumulated gradient would be 1.0).
A rank's peak is its process's peak resident set above what it held before the training (VmHWM, reset then),
measured with glibc returning freed tensors of 1 MiB and more to the system (`mallopt`, what
MALLOC_MMAP_THRESHOLD_=1048576 sets): glibc's default keeps freed tensors below 32 MiB in its per-thread heaps, which
on 4 ranks made the resident set of a rank as large as one rank's whole training state (see docs/memory.md).

    .venv/bin/python benchmarks/memory_scaling.py [--ranks 4] [--steps 2] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODEL = ROOT / "benchmarks" / "memory_model.json"
RANK_SCRIPT = "benchmarks/_peak_memory_runs.py"
LAUNCH = [sys.executable, "-m", "accelerate.commands.launch"]


def train_args(out: Path, name: str, global_batch: int, steps: int, model: Path = MODEL) -> list[str]:
    return [
        "--config_name",
        str(model),
        "--max_corpus_mb",
        "1",
        "--block_size",
        "32",
        "--per_device_train_batch_size",
        "1",
        "--global_batch_size",
        str(global_batch),
        "--max_steps",
        str(steps),
        "--warmup_steps",
        "1",
        "--eval_steps",
        "0",
        "--eval_on_start",
        "false",
        "--max_eval_samples",
        "1",
        "--export_final",
        "false",
        "--logging_steps",
        "1",
        "--report_to",
        "none",
        "--disable_tqdm",
        "true",
        "--output_dir",
        str(out / name),
    ]


def runs(
    ranks: int,
    out: Path,
    steps: int,
    native_steps: int | None = None,
    accumulation: bool = True,
    hf_checkpoint: bool = True,
    model: Path = MODEL,
) -> list[tuple[str, str, list[str]]]:
    """(label, engine, arguments) of one launch; on several ranks also 4 accumulation steps, before the 1-step run (what
    one training leaves behind in the process can only lower the next one's figure: the one subtracted)."""
    tag = f"w{ranks}"
    native_steps = native_steps or steps
    # first, unmeasured: a tiny run of each engine pays what a process allocates once (imports, data, DeepSpeed ops)
    warm = lambda name: ["--config_name", "tiny", *train_args(out, f"warm-{name}-{tag}", ranks, 1)[2:]]  # noqa: E731
    # The native engine's checkpoint is written from the shards (DCP) and adds nothing to its peak (ratio 0.262 with
    # it, 0.263 without): its runs skip it (~1 GB written per launch, 6 s of the test's 63 s). The HF engine's runs
    # keep theirs, what a user's run holds. (Its ratio: 0.31; 0.36 while the native runs before it wrote theirs,
    # which left the one-rank process holding more, lowering the figure subtracted from its peak.)
    no_checkpoint = ["--save_strategy", "no"]
    native = [("fsdp", "fsdp", train_args(out, f"fsdp-{tag}", ranks, native_steps, model) + no_checkpoint)]
    if ranks > 1 and accumulation:
        acc4 = train_args(out, f"fsdp-acc4-{tag}", 4 * ranks, native_steps, model) + no_checkpoint
        native.insert(0, ("fsdp_acc4", "fsdp", acc4))
    hf_args = train_args(out, f"hf-{tag}", ranks, steps, model) + ([] if hf_checkpoint else no_checkpoint)
    hf = [("warm_hf", "hf", warm("hf")), ("hf", "hf", hf_args)]
    return [("warm_fsdp", "fsdp", warm("fsdp")), *native, *hf]  # the native engine's first (see RANK_SCRIPT)


def launch(
    ranks: int,
    planned: list[tuple[str, str, list[str]]],
    launcher: list[str] | None = None,
    env: dict | None = None,
    config: str = "deepspeed_zero3",
) -> dict[str, list[int]]:
    """Label → each rank's peak (bytes above its baseline), from one launch of RANK_SCRIPT running `planned`
    ((label, engine, arguments) each) with accelerate_configs/<config>.yaml."""
    args: list[str] = []
    for label, engine, targs in planned:
        args += [":::", label, engine, *targs]
    path = ROOT / "accelerate_configs" / f"{config}.yaml"
    cmd = [*(launcher or LAUNCH), "--config_file", str(path), "--num_processes", str(ranks), RANK_SCRIPT, *args[1:]]
    proc = subprocess.run(cmd, cwd=ROOT, env=env or os.environ.copy(), capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    peaks: dict[str, list[int]] = {}
    for label, rank, value in re.findall(r"^PEAK (\S+) (\d+) (\d+)$", proc.stdout, flags=re.MULTILINE):
        peaks.setdefault(label, [0] * ranks)[int(rank)] = int(value)
    return peaks


def model_bytes(model: Path = MODEL) -> int:
    """The model's fp32 size (4 bytes per parameter), from its shapes on the meta device."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    data = json.loads(model.read_text())
    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(data.pop("model_type"), **data))
    return 4 * sum(p.numel() for p in model.parameters())


def measure(
    ranks: int = 4,
    steps: int = 2,
    launcher: list[str] | None = None,
    env: dict | None = None,
    native_steps: int | None = None,
    accumulation: bool = True,
    hf_checkpoint: bool = True,
    layers: int | None = None,
) -> dict:
    """The figures; `native_steps`: the native engine's runs' optimizer steps, if not `steps` (its peak is reached in
    the first step, where AdamW makes its states: the test takes 1, the 4 gloo ranks' longest part halved);
    `accumulation`: also the 4-accumulation-step run (the test leaves it to tests/test_fsdp_engine.py's count of the
    gradient bytes a rank holds after each micro-batch, exact and a fraction of its time); `layers`: the model with
    that many decoder layers instead of its 24 (the test's 8: 34M parameters, whose state still dominates)."""
    with tempfile.TemporaryDirectory(prefix="anygpu-memory-") as tmp, ThreadPoolExecutor(1) as pool:
        model = MODEL
        if layers is not None:
            model = Path(tmp) / "model.json"
            model.write_text(json.dumps({**json.loads(MODEL.read_text()), "num_hidden_layers": layers}))
        planned = lambda n: runs(n, Path(tmp), steps, native_steps, accumulation, hf_checkpoint, model)  # noqa: E731
        # both launches at once (a process's peak is its own): the 1-rank one leaves a core idle otherwise
        single = pool.submit(launch, 1, planned(1), launcher, env)
        many = {k: max(v) for k, v in launch(ranks, planned(ranks), launcher, env).items()}
        one = {k: max(v) for k, v in single.result().items()}
        size = model_bytes(model)
    return {
        "ranks": ranks,
        "model_fp32_bytes": size,
        "one_rank": one,
        f"{ranks}_ranks": many,
        "fsdp_ratio": many["fsdp"] / one["fsdp"],
        "hf_zero3_ratio": many["hf"] / one["hf"],
        "accumulation_extra_per_model": (many["fsdp_acc4"] - many["fsdp"]) / size if accumulation else None,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--json", action="store_true", help="print the figures as one JSON object")
    args = p.parse_args()
    got = measure(args.ranks, args.steps)
    if args.json:
        print(json.dumps(got))
        return
    mib = lambda b: f"{b / 2**20:.0f} MiB"  # noqa: E731
    n = args.ranks
    print(
        f"model: {got['model_fp32_bytes'] / 1e6:.0f} MB in fp32; peak per rank above its baseline, 1 rank → {n} ranks"
    )
    print(
        f"native FSDP2 engine: {mib(got['one_rank']['fsdp'])} → {mib(got[f'{n}_ranks']['fsdp'])}: {got['fsdp_ratio']:.2f}x"
    )
    print(
        f"HF engine, ZeRO-3:   {mib(got['one_rank']['hf'])} → {mib(got[f'{n}_ranks']['hf'])}: {got['hf_zero3_ratio']:.2f}x"
    )
    print(
        f"native, {n} ranks, 4 accumulation steps against 1: +{mib(got[f'{n}_ranks']['fsdp_acc4'] - got[f'{n}_ranks']['fsdp'])}"
        f" = {got['accumulation_extra_per_model']:.2f}x the model's fp32 size"
    )


if __name__ == "__main__":
    main()

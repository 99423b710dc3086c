"""`anygpu bench`: the same short job at several process counts; throughput and scaling.

    anygpu bench --engine fsdp --nproc 1,2,4,8 --output_dir outputs/bench
    anygpu bench --nproc 2,4,8 --config_name moe.json -- --ep 2 --bf16 true    # engine arguments after --

Each run is started exactly as the vendor launcher would start it (its own plan, with --nproc N),
with a fixed global batch (strong scaling: the same work per step whatever N). Tokens/s is the mean
over the logged steps after the first (compilation, allocator and communicator warm-up).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from anygpu.launch.suggest import ArgumentParser
from anygpu.launch import detect as gpu_detect
from anygpu.launch import launcher


@dataclass
class Result:
    nproc: int
    tokens_per_second: float
    tokens_per_second_per_process: float
    scaling_efficiency: float | None  # (tokens/s per process at N) / (tokens/s at 1 process)
    mfu: float | None
    output_dir: str


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(
        prog="anygpu bench",
        description="Run a short fixed training job at each process count and print tokens/s, tokens/s per "
        "process, scaling efficiency against one process and MFU (on GPUs), as a table and a PNG "
        "plot (bench.png) in --output_dir. Arguments after -- go to every run's engine, after bench's own (the "
        "same names win): e.g. -- --ep 2 --torch_compile true.",
    )
    p.add_argument("--engine", choices=sorted(launcher.ENGINES), default="fsdp", help="Engine (default fsdp).")
    p.add_argument("--nproc", default="1,2,4,8", help="Comma-separated process counts (default 1,2,4,8).")
    p.add_argument("--output_dir", default="outputs/bench", help="Runs, bench.json and bench.png go here.")
    p.add_argument(
        "--config_name",
        help="Model preset or config.json (default: default, or the model given after -- as --model_name_or_path).",
    )
    p.add_argument("--block_size", type=int, default=256, help="Tokens per sequence (default 256).")
    p.add_argument(
        "--per_process_batch",
        type=int,
        default=4,
        help="Sequences per process per step at the largest count; the global batch is this × the "
        "least common multiple of the counts, fixed for every run (default 4).",
    )
    p.add_argument("--max_steps", type=int, default=10, help="Optimizer steps per run (default 10).")
    p.add_argument("--bf16", action="store_true", help="bf16 mixed precision (GPUs).")
    p.add_argument("--json", action="store_true", help="Print the results as JSON instead of a table.")
    p.set_defaults(engine_args=[])  # what follows `--` (`main` cuts it off before parsing)
    return p


def parse_counts(text: str) -> list[int]:
    try:
        counts = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        counts = []
    if not counts or min(counts) < 1:
        raise ValueError(f"--nproc {text!r}: give process counts such as 1,2,4,8")
    return sorted(set(counts))


def engine_args(args: argparse.Namespace, global_batch: int, out: Path) -> list[str]:
    """Every run's engine arguments: bench's fixed job, then what the user gave after `--`."""
    extra = ["--bf16", "true"] if args.bf16 else []
    pretrained = any(a.split("=", 1)[0] == "--model_name_or_path" for a in args.engine_args)
    config = [] if pretrained and args.config_name is None else ["--config_name", args.config_name or "default"]
    return [
        *config,
        "--block_size",
        str(args.block_size),
        "--max_corpus_mb",
        "1",
        "--global_batch_size",
        str(global_batch),
        "--max_steps",
        str(args.max_steps),
        "--logging_steps",
        "1",
        "--eval_steps",
        "0",
        "--eval_on_start",
        "false",
        "--export_final",
        "false",
        "--report_to",
        "none",
        "--disable_tqdm",
        "true",
        "--warmup_steps",
        "1",
        "--save_strategy",  # a measurement: no checkpoint (at 70B, ~1 TB written after the timed steps)
        "no",
        "--output_dir",
        str(out),
        *extra,
        *args.engine_args,
    ]


def vendor_here() -> str:
    for vendor in gpu_detect.VENDORS:
        if gpu_detect.probe(vendor, env=os.environ).gpus:
            return vendor
    return gpu_detect.NVIDIA  # no GPU: either launcher falls back to CPU processes


def run_one(args: argparse.Namespace, nproc: int, global_batch: int) -> Result:
    out = Path(args.output_dir) / f"nproc{nproc}"
    if (out / "metrics.jsonl").exists():
        (out / "metrics.jsonl").unlink()  # a fresh measurement, not an append to an old one
    plan = launcher.make_plan(
        [
            "--vendor",
            vendor_here(),
            "--engine",
            args.engine,
            "--nproc",
            str(nproc),
            "--dry-run",
            "--",
            *engine_args(args, global_batch, out),
        ],
        os.environ,
    )
    proc = subprocess.run(plan.cmd, env=plan.env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{nproc} process(es) failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    records = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "tokens_per_second" in r and "loss" in r]
    timed = steps[1:] or steps  # the first step carries the warm-up
    tps = sum(r["tokens_per_second"] for r in timed) / len(timed)
    mfus = [r["mfu"] for r in timed if r.get("mfu") is not None]
    return Result(nproc, tps, tps / nproc, None, sum(mfus) / len(mfus) if mfus else None, str(out))


def plot(results: list[Result], path: Path, engine: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    n = [r.nproc for r in results]
    a.plot(n, [r.tokens_per_second for r in results], "o-", label="measured")
    base = results[0].tokens_per_second_per_process if results[0].nproc == 1 else None
    if base:
        a.plot(n, [base * k for k in n], "--", color="gray", label="linear from 1 process")
    a.set_xlabel("processes")
    a.set_ylabel("tokens/s")
    a.set_title(f"throughput ({engine} engine)")
    a.legend()
    b.plot(n, [r.scaling_efficiency if r.scaling_efficiency is not None else math.nan for r in results], "o-")
    b.set_ylim(0, 1.1)
    b.set_xlabel("processes")
    b.set_ylabel("scaling efficiency")
    b.set_title("tokens/s per process ÷ tokens/s at 1 process")
    for ax in (a, b):
        ax.grid(alpha=0.3)
        ax.set_xticks(n)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def table(results: list[Result]) -> str:
    lines = [f"{'processes':>9} {'tokens/s':>12} {'tokens/s/proc':>14} {'efficiency':>10} {'MFU':>7}"]
    for r in results:
        eff = f"{r.scaling_efficiency:.1%}" if r.scaling_efficiency is not None else "—"
        mfu = f"{r.mfu:.1%}" if r.mfu is not None else "—"
        lines.append(
            f"{r.nproc:>9} {r.tokens_per_second:>12.0f} {r.tokens_per_second_per_process:>14.0f} {eff:>10} {mfu:>7}"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    cut = argv.index("--") if "--" in argv else len(argv)
    args = build_parser().parse_args(argv[:cut])
    args.engine_args = argv[cut + 1 :]
    try:
        counts = parse_counts(args.nproc)
        for name in ("block_size", "per_process_batch", "max_steps"):
            if getattr(args, name) < 1:
                raise ValueError(f"--{name} {getattr(args, name)} must be at least 1")
    except ValueError as e:
        print(f"anygpu bench: error: {e}", file=sys.stderr)
        return 2
    global_batch = args.per_process_batch * math.lcm(*counts)
    Path(args.output_dir).mkdir(parents=True, exist_ok=True)
    results = []
    for n in counts:
        print(
            f"[bench] {args.engine} engine, {n} process(es), global batch {global_batch}", file=sys.stderr, flush=True
        )
        results.append(run_one(args, n, global_batch))
    one = next((r for r in results if r.nproc == 1), None)
    for r in results:
        r.scaling_efficiency = r.tokens_per_second_per_process / one.tokens_per_second if one else None
    out = Path(args.output_dir)
    (out / "bench.json").write_text(json.dumps([asdict(r) for r in results], indent=2))
    png = plot(results, out / "bench.png", args.engine)
    if args.json:
        print(
            json.dumps(
                {
                    "engine": args.engine,
                    "global_batch_size": global_batch,
                    "results": [asdict(r) for r in results],
                    "plot": str(png),
                },
                indent=2,
            )
        )
    else:
        sys.stdout.write(
            f"{args.engine} engine, {args.config_name or 'default'}, block {args.block_size}, global batch "
            f"{global_batch}, {args.max_steps} steps (tokens/s: mean after the first step)\n"
        )
        sys.stdout.write(table(results))
        print(f"plot: {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Interactive launch: `anygpu launch` (no --vendor, or --interactive) and `bash run_<vendor>_all.sh --interactive`.

Detects the GPUs (the launcher's own plan), shows `anygpu plan`'s recommendation, then asks engine,
accelerate config, GPUs (processes) to use, global batch and output folder, each with the
recommendation as its default (Enter keeps it). Prints the exact command and runs it through the
launcher, or stops there with --dry-run. Answers are read from standard input, one per line, when it
is not a terminal, so the dialogue can be scripted:  printf 'fsdp\\n4\\n64\\nouts/run1\\n' | anygpu launch --dry-run
"""
from __future__ import annotations

import argparse
import os
import shlex
import sys
from dataclasses import dataclass
from typing import TextIO

from anygpu.launch import detect as gpu_detect
from anygpu.launch import launcher

DEFAULT_GLOBAL_BATCH = 64
DEFAULT_OUTPUT = "outputs/run"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="anygpu launch",
        usage="anygpu launch [--interactive] [--vendor nvidia|amd] [--dry-run] [model options] [-- script args]",
        description="Interactive launch: detects the GPUs, shows the plan's recommendation, asks engine, "
                    "accelerate config, GPUs to use, global batch and output folder (the recommendation is each "
                    "default), prints the exact command and runs it (or stops with --dry-run). Answers come from "
                    "standard input, one per line, when it is not a terminal. `anygpu launch --vendor V [options]` "
                    "without --interactive is the vendor launcher itself (bash run_<vendor>_all.sh; see its --help).",
    )
    p.add_argument("--interactive", action="store_true", help="Ask even when --vendor is given.")
    p.add_argument("--vendor", choices=gpu_detect.VENDORS, help="GPU vendor (default: detected; NVIDIA when none).")
    p.add_argument("--dry-run", action="store_true", help="Print the command the answers imply, then exit 0.")
    p.add_argument("--model_name_or_path", help="Model folder or cached hub id (for the plan and the run).")
    p.add_argument("--config_name", help="Preset or config.json (default: 'default' without --model_name_or_path).")
    p.add_argument("--block_size", type=int, default=1024, help="Tokens per sequence (default 1024).")
    return p


@dataclass
class Defaults:
    engine: str
    accelerate_config: str
    nproc: int
    global_batch_size: int
    output_dir: str
    per_device_train_batch_size: int | None
    num_gpus: int  # usable GPUs here (0: CPU processes)
    lines: list[str]  # what was detected and recommended, shown before the questions


def detect_vendor() -> str:
    for vendor in gpu_detect.VENDORS:
        if gpu_detect.probe(vendor, env=os.environ).gpus:
            return vendor
    return gpu_detect.NVIDIA


def offer(vendor: str, args: argparse.Namespace) -> Defaults:
    """The defaults: the launcher's device count and `anygpu plan`'s recommendation for it."""
    from anygpu.tools import plan as plan_tool

    seen = launcher.make_plan(["--vendor", vendor, "--dry-run"], os.environ)
    count = len(seen.gpus) if seen.use_gpus else 0
    memory = seen.gpus[0].memory_mib if count and seen.gpus[0].memory_mib else None
    lines = [*seen.lines, *(f"warning: {w}" for w in seen.warnings)]
    if not count:
        return Defaults("hf", "ddp", 1, DEFAULT_GLOBAL_BATCH, DEFAULT_OUTPUT, None, 0,
                        lines + ["no GPU: CPU processes over gloo (the plan has nothing to recommend)"])
    rec = plan_tool.recommend(args.model_name_or_path, args.config_name, args.block_size, DEFAULT_GLOBAL_BATCH,
                              num_gpus=count, gpu_memory_gb=memory / 1024 if memory else None)
    if rec.strategy is None:
        lines.append("plan: nothing fits with the detected memory (see anygpu plan); defaults to DDP")
    else:
        lines.append(f"plan recommends {rec.strategy} (accelerate_configs/{rec.accelerate_config}.yaml), "
                     f"{rec.per_device_train_batch_size} per device × {count} GPUs × "
                     f"{rec.gradient_accumulation_steps} accumulation step(s) for a global batch of {DEFAULT_GLOBAL_BATCH}")
    return Defaults("hf", rec.accelerate_config, count, DEFAULT_GLOBAL_BATCH, DEFAULT_OUTPUT,
                    rec.per_device_train_batch_size, count, lines)


class Asker:
    """Questions on stdout, answers from stdin (a terminal or a script); Enter or end of input keeps the default."""

    def __init__(self, stdin: TextIO, stdout: TextIO) -> None:
        self.stdin, self.stdout = stdin, stdout

    def ask(self, question: str, default: str, valid: tuple[str, ...] | None = None, integer: bool = False) -> str:
        self.stdout.write(f"{question} [{default}]: ")
        self.stdout.flush()
        line = self.stdin.readline()
        answer = line.strip() or default
        if not self.stdin.isatty():
            self.stdout.write(answer + "\n")  # echo scripted answers so the transcript reads well
        if valid is not None and answer not in valid:
            raise ValueError(f"{question}: {answer!r} is not one of {', '.join(valid)}")
        if integer and not (answer.isdigit() and int(answer) > 0):
            raise ValueError(f"{question}: {answer!r} is not a positive whole number, e.g. {default}")
        return answer


def configs() -> tuple[str, ...]:
    return tuple(sorted(p.stem for p in launcher.CONFIG_DIR.glob("*.yaml")))


def dialogue(d: Defaults, asker: Asker, max_nproc: int | None) -> dict:
    engine = asker.ask("engine (hf: HF Trainer + accelerate; fsdp: native FSDP2)", d.engine, tuple(launcher.ENGINES))
    config = asker.ask("accelerate config", d.accelerate_config, configs()) if engine == "hf" else None
    what = f"GPUs to use (1..{max_nproc})" if max_nproc else "CPU processes"
    nproc = int(asker.ask(what, str(d.nproc), integer=True))
    if max_nproc and nproc > max_nproc:
        raise ValueError(f"{what}: {nproc} is more than the {max_nproc} usable GPUs")
    global_batch = int(asker.ask("global batch (sequences per optimizer step)", str(d.global_batch_size), integer=True))
    if global_batch % nproc:
        raise ValueError(f"global batch: {global_batch} does not split over {nproc} processes; use a multiple of {nproc}")
    output_dir = asker.ask("output folder", d.output_dir)
    return {"engine": engine, "config": config, "nproc": nproc, "global_batch_size": global_batch,
            "output_dir": output_dir}


def launcher_argv(vendor: str, answers: dict, args: argparse.Namespace, d: Defaults, script_args: list[str]) -> list[str]:
    argv = ["--vendor", vendor, "--engine", answers["engine"], "--nproc", str(answers["nproc"])]
    if answers["config"]:
        argv += ["--accelerate-config", answers["config"]]
    train = ["--global_batch_size", str(answers["global_batch_size"]), "--output_dir", answers["output_dir"],
             "--block_size", str(args.block_size)]
    if args.model_name_or_path:
        train += ["--model_name_or_path", args.model_name_or_path]
    if args.config_name:
        train += ["--config_name", args.config_name]
    share = answers["global_batch_size"] // answers["nproc"]
    m = d.per_device_train_batch_size
    if m and share % m == 0 and "--per_device_train_batch_size" not in script_args:
        train += ["--per_device_train_batch_size", str(m)]  # the plan's micro-batch, where it still divides
    return argv + ["--", *train, *script_args]


def main(argv: list[str], stdin: TextIO | None = None, stdout: TextIO | None = None) -> int:
    import anygpu

    stdin, stdout = stdin or sys.stdin, stdout or sys.stdout

    anygpu.set_offline_defaults()  # the plan reads configs only: presets, local folders, cached hub ids
    mine, script_args = launcher.split_argv(argv)
    args = build_parser().parse_args(mine)
    if args.block_size < 1:
        print(f"anygpu launch: error: --block_size {args.block_size} must be positive, e.g. 1024", file=sys.stderr)
        return 2
    vendor = args.vendor or detect_vendor()
    try:
        d = offer(vendor, args)
        for line in d.lines:
            stdout.write(f"# {line}\n")
        answers = dialogue(d, Asker(stdin, stdout), d.num_gpus or None)
        final = launcher_argv(vendor, answers, args, d, script_args)
        plan = launcher.make_plan([*final[:final.index("--")], "--dry-run", *final[final.index("--"):]], os.environ)
    except (ValueError, launcher.LaunchError) as e:
        print(f"anygpu launch: error: {e}", file=sys.stderr)
        return 2
    stdout.write("command:\n" + launcher.render_dry_run(plan))
    stdout.write(f"# the same with the vendor launcher: bash {launcher.SCRIPT_NAME[vendor]} {shlex.join(final[2:])}\n")
    stdout.flush()
    if args.dry_run:
        return 0
    return launcher.main(final)

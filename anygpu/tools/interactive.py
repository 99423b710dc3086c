"""Interactive launch: `anygpu launch` (no --vendor, or --interactive) and `bash run_<vendor>_all.sh --interactive`.

Detects the GPUs (the launcher's own plan), shows `anygpu plan`'s recommendation, then asks engine,
accelerate config, GPUs (processes) to use, global batch and output folder, each with the
recommendation or the engine's own value as its default (Enter keeps it; a wrong answer is asked
again). Prints the exact command and runs it through the launcher, or stops there with --dry-run. Answers are read from standard input, one per line, when it
is not a terminal, so the dialogue can be scripted:  printf 'fsdp\\n4\\n64\\nouts/run1\\n' | anygpu launch --dry-run
End of input before the last answer aborts (exit 1); Ctrl-C exits 130.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from dataclasses import dataclass
from typing import Callable, TextIO

from anygpu.launch.suggest import ArgumentParser
from anygpu.launch import detect as gpu_detect
from anygpu.launch import launcher

EXIT_ABORTED = 1  # end of input (Ctrl-D): nothing launched
EXIT_INTERRUPTED = 130  # Ctrl-C, as a shell reports SIGINT
PLAN_BLOCK_SIZE = 1024  # the plan's sequence length when none is given (the engines' default for most models)


class Aborted(Exception):
    """End of input before every question had an answer: never taken as consent."""


def engine_defaults() -> tuple[int, str]:
    """The engines' own global batch and output folder, so that Enter changes nothing the engine would do."""
    from anygpu.config.args import DEFAULT_GLOBAL_BATCH_SIZE, TrainArguments

    return DEFAULT_GLOBAL_BATCH_SIZE, TrainArguments.__dataclass_fields__["output_dir"].default


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(
        prog="anygpu launch",
        usage="anygpu launch [--interactive] [--vendor nvidia|amd] [--dry-run] [model options] [-- script args]",
        description="Interactive launch: detects the GPUs, shows the plan's recommendation, asks engine, "
        "accelerate config, GPUs to use, global batch and output folder (the recommendation or the "
        "engine's own default is each default; a wrong answer is asked again), prints the exact "
        "command and runs it (or stops with --dry-run). Answers come from standard input, one per "
        "line, when it is not a terminal; end of input aborts (exit 1), Ctrl-C exits 130. "
        "`anygpu launch --vendor V [options]` without --interactive is the vendor launcher itself "
        "(bash run_<vendor>_all.sh; see its --help).",
    )
    p.add_argument("--interactive", action="store_true", help="Ask even when --vendor is given.")
    p.add_argument("--vendor", choices=gpu_detect.VENDORS, help="GPU vendor (default: detected; NVIDIA when none).")
    p.add_argument("--dry-run", action="store_true", help="Print the command the answers imply, then exit 0.")
    p.add_argument("--model_name_or_path", help="Model folder or cached hub id (for the plan and the run).")
    p.add_argument("--config_name", help="Preset or config.json (default: 'default' without --model_name_or_path).")
    p.add_argument(
        "--block_size",
        type=int,
        help=f"Tokens per sequence (default: the engine's; the plan assumes {PLAN_BLOCK_SIZE}).",
    )
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


def script_option(script_args: list[str], name: str) -> str | None:
    """The value of `--name` among the training script's arguments (`--name V` or `--name=V`), last one wins."""
    value = None
    for i, word in enumerate(script_args):
        if word == f"--{name}" and i + 1 < len(script_args):
            value = script_args[i + 1]
        elif word.startswith(f"--{name}="):
            value = word.split("=", 1)[1]
    return value


def without_option(script_args: list[str], name: str) -> list[str]:
    out, skip = [], False
    for word in script_args:
        if skip:
            skip = False
        elif word == f"--{name}":
            skip = True
        elif not word.startswith(f"--{name}="):
            out.append(word)
    return out


def offer(vendor: str, args: argparse.Namespace, global_batch: int, output_dir: str) -> Defaults:
    """The defaults: the launcher's device count, `anygpu plan`'s recommendation for it, the engine's own
    global batch and output folder."""
    from anygpu.tools import plan as plan_tool

    seen = launcher.make_plan(["--vendor", vendor, "--dry-run"], os.environ)
    count = len(seen.gpus) if seen.use_gpus else 0
    memory = seen.gpus[0].memory_mib if count and seen.gpus[0].memory_mib else None
    label = gpu_detect.VENDOR_LABEL[vendor]
    if count:  # what was found; the command itself is shown once the answers are in
        head = [f"{count} {label} GPU(s): {seen.gpus[0].name}" + (f", {memory / 1024:.0f} GiB each" if memory else "")]
    else:
        reason = seen.lines[0].split(": training on the CPU")[0] if seen.lines else f"no {label} GPU"
        head = [f"{reason}: CPU processes over gloo (the plan has nothing to recommend)"]
    lines = [*head, *(f"warning: {w}" for w in seen.warnings)]
    if not count:
        return Defaults("hf", "ddp", 1, global_batch, output_dir, None, 0, lines)
    rec = plan_tool.recommend(
        args.model_name_or_path,
        args.config_name,
        args.block_size or PLAN_BLOCK_SIZE,
        global_batch,
        num_gpus=count,
        gpu_memory_gb=memory / 1024 if memory else None,
    )
    if rec.strategy is None:
        lines.append("plan: nothing fits with the detected memory (see anygpu plan); defaults to DDP")
    else:
        lines.append(
            f"plan recommends {rec.strategy} (accelerate_configs/{rec.accelerate_config}.yaml), "
            f"{rec.per_device_train_batch_size} per device × {count} GPUs × "
            f"{rec.gradient_accumulation_steps} accumulation step(s) for a global batch of {global_batch}"
        )
    return Defaults(
        "hf", rec.accelerate_config, count, global_batch, output_dir, rec.per_device_train_batch_size, count, lines
    )


class Asker:
    """Questions on stdout, answers from stdin (a terminal or a script); Enter keeps the default, a wrong
    answer is asked again with the valid ones, end of input aborts."""

    def __init__(self, stdin: TextIO, stdout: TextIO) -> None:
        self.stdin, self.stdout = stdin, stdout

    def ask(
        self,
        question: str,
        default: str,
        valid: tuple[str, ...] | None = None,
        check: Callable[[str], str | None] | None = None,
    ) -> str:
        """The answer; `check` returns why an answer is wrong (asked again), or None."""
        while True:
            self.stdout.write(f"{question} [{default}]: ")
            self.stdout.flush()
            line = self.stdin.readline()
            if not line:  # end of input (Ctrl-D): an abort, never a yes
                self.stdout.write("\n")
                raise Aborted(question)
            answer = line.strip() or default
            if not self.stdin.isatty():
                self.stdout.write(answer + "\n")  # echo scripted answers so the transcript reads well
            problem = (
                f"{answer!r} is not one of {', '.join(valid)}"
                if valid is not None and answer not in valid
                else check(answer)
                if check is not None
                else None
            )
            if problem is None:
                return answer
            self.stdout.write(f"  {problem}; try again (Enter: {default})\n")


def positive(answer: str) -> str | None:
    return None if answer.isdigit() and int(answer) > 0 else f"{answer!r} is not a positive whole number"


def configs(num_gpus: int) -> tuple[str, ...]:
    """The accelerate configs that can run here: accelerate's FSDP does not run on CPU."""
    names = sorted(p.stem for p in launcher.CONFIG_DIR.glob("*.yaml") if num_gpus or launcher._config_kind(p) != "FSDP")
    return tuple(names)


def dialogue(d: Defaults, asker: Asker, max_nproc: int | None) -> dict:
    engine = asker.ask("engine (hf: HF Trainer + accelerate; fsdp: native FSDP2)", d.engine, tuple(launcher.ENGINES))
    config = asker.ask("accelerate config", d.accelerate_config, configs(d.num_gpus)) if engine == "hf" else None
    what = f"GPUs to use (1..{max_nproc})" if max_nproc else "CPU processes"

    def count(answer: str) -> str | None:
        if problem := positive(answer):
            return problem
        return f"{answer} is more than the {max_nproc} usable GPUs" if max_nproc and int(answer) > max_nproc else None

    nproc = int(asker.ask(what, str(d.nproc), check=count))

    def splits(answer: str) -> str | None:
        if problem := positive(answer):
            return problem
        return (
            f"{answer} does not split over {nproc} processes: use a multiple of {nproc}"
            if int(answer) % nproc
            else None
        )

    default_batch = (
        d.global_batch_size if d.global_batch_size % nproc == 0 else nproc * max(1, d.global_batch_size // nproc)
    )
    global_batch = int(asker.ask("global batch (sequences per optimizer step)", str(default_batch), check=splits))
    output_dir = asker.ask("output folder", d.output_dir)
    return {
        "engine": engine,
        "config": config,
        "nproc": nproc,
        "global_batch_size": global_batch,
        "output_dir": output_dir,
    }


def launcher_argv(
    vendor: str, answers: dict, args: argparse.Namespace, d: Defaults, script_args: list[str]
) -> list[str]:
    """The launcher's words: each training option once (the answers replace the same options after --)."""
    argv = ["--vendor", vendor, "--engine", answers["engine"], "--nproc", str(answers["nproc"])]
    if answers["config"]:
        argv += ["--accelerate-config", answers["config"]]
    rest = without_option(without_option(script_args, "global_batch_size"), "output_dir")
    train = ["--global_batch_size", str(answers["global_batch_size"]), "--output_dir", answers["output_dir"]]
    for name in ("block_size", "model_name_or_path", "config_name"):
        value = getattr(args, name)
        if value is not None and script_option(rest, name) is None:
            train += [f"--{name}", str(value)]
    share = answers["global_batch_size"] // answers["nproc"]
    m = d.per_device_train_batch_size
    if m and share % m == 0 and script_option(rest, "per_device_train_batch_size") is None:
        train += ["--per_device_train_batch_size", str(m)]  # the plan's micro-batch, where it still divides
    return argv + ["--", *train, *rest]


def main(argv: list[str], stdin: TextIO | None = None, stdout: TextIO | None = None) -> int:
    import anygpu

    stdin, stdout = stdin or sys.stdin, stdout or sys.stdout
    anygpu.set_offline_defaults()  # the plan reads configs only: presets, local folders, cached hub ids
    anygpu.quiet_library_warnings()  # also when started by run_<vendor>_all.sh --interactive, not through cli
    mine, script_args = launcher.split_argv(argv)
    parser = build_parser()
    launcher.refuse_second_vendor(parser, launcher.vendors_given(mine))  # run_<vendor>_all.sh --interactive --vendor
    args = parser.parse_args(mine)
    for name in ("model_name_or_path", "config_name", "block_size"):  # the run's own values, for the plan
        if getattr(args, name) is None and (value := script_option(script_args, name)) is not None:
            setattr(args, name, value)
    try:
        args.block_size = None if args.block_size is None else int(args.block_size)
    except ValueError:
        args.block_size = 0
    if args.block_size is not None and args.block_size < 1:
        print(
            f"anygpu launch: error: --block_size {args.block_size} must be a positive whole number, e.g. 1024",
            file=sys.stderr,
        )
        return 2
    vendor = args.vendor or detect_vendor()
    batch, output = engine_defaults()
    batch = int(script_option(script_args, "global_batch_size") or batch)
    output = script_option(script_args, "output_dir") or output
    try:
        d = offer(vendor, args, batch, output)
        for line in d.lines:
            stdout.write(f"# {line}\n")
        answers = dialogue(d, Asker(stdin, stdout), d.num_gpus or None)
        final = launcher_argv(vendor, answers, args, d, script_args)
        plan = launcher.make_plan([*final[: final.index("--")], "--dry-run", *final[final.index("--") :]], os.environ)
    except KeyboardInterrupt:
        print("\nanygpu launch: interrupted, nothing launched", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Aborted:
        print("anygpu launch: end of input before every question had an answer: nothing launched", file=sys.stderr)
        return EXIT_ABORTED
    except (ValueError, launcher.LaunchError) as e:
        print(f"anygpu launch: error: {e}", file=sys.stderr)
        return 2
    stdout.write("command:\n" + launcher.render_dry_run(plan))
    stdout.write(f"# the same with the vendor launcher: bash {launcher.SCRIPT_NAME[vendor]} {shlex.join(final[2:])}\n")
    stdout.flush()
    if args.dry_run:
        return 0
    return launcher.main(final)

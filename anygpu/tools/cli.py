"""The `anygpu` console command: one table of subcommands, each a `main(argv) -> int` imported only when run."""

from __future__ import annotations

import importlib
import sys
from typing import NamedTuple


class Command(NamedTuple):
    target: str  # "module:function", imported only when the command runs (--help stays fast)
    usage: str
    summary: str


# The one list of subcommands: the usage text and the dispatch both read it. A new tool adds one line.
COMMANDS: dict[str, Command] = {
    "info": Command(
        "anygpu.tools.info:main", "info", "the accelerators torch sees (vendor, names, memory, capability)"
    ),
    "train": Command(
        "anygpu.tools.train_command:main",
        "train [args]",
        "the native FSDP2 engine in this process (run_fsdp_standalone.py; see --help); the launchers start several",
    ),
    "launch": Command(
        "anygpu.tools.launch_command:main",
        "launch [--vendor V] [--dry-run]",
        "interactive: detects the GPUs, asks engine, config, GPUs, global batch and output folder, "
        "shows the command and runs it; with --vendor and no --interactive, the vendor launcher",
    ),
    "prepare": Command(
        "anygpu.tools.prepare_command:main",
        "prepare [args]",
        "tokenise and pack a run's data ahead of the job (the engines' arguments; under torchrun, split over the "
        "processes), so training starts at once",
    ),
    "plan": Command(
        "anygpu.tools.plan:main",
        "plan [--gpu NAME]",
        "will a model fit, and how: the recommended strategy, micro-batch and memory per GPU",
    ),
    "doctor": Command(
        "anygpu.tools.doctor:main", "doctor", "what this machine can do, with active checks (exit 1 on failure)"
    ),
    "bench": Command(
        "anygpu.tools.bench:main", "bench --nproc 1,2,4", "tokens/s and scaling efficiency at several process counts"
    ),
    "verify": Command(
        "anygpu.tools.verify:main",
        "verify [...] -- <job>",
        "train a few steps of your job at several world sizes / engines (and resumed on another), compare "
        "losses, grad norms and weights: exit 0 if they agree, 1 if not",
    ),
}


def usage() -> str:
    width = max(len(c.usage) for c in COMMANDS.values()) + 2
    rows = [f"  {c.usage:<{width}}{c.summary}" for c in COMMANDS.values()]
    return (
        "usage: anygpu <command> [arguments]   (anygpu <command> --help for its options)\n\ncommands:\n"
        + "\n".join(rows)
        + "\n\n  --version"
        + " " * (width - 9)
        + "the installed version\n"
    )


def main(argv: list[str] | None = None) -> int:
    import anygpu
    from anygpu.launch.suggest import did_you_mean

    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        (sys.stdout if argv else sys.stderr).write(usage())
        return 0 if argv else 2
    if argv[0] in ("-V", "--version"):
        print(f"anygpu {anygpu.__version__}")
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(
            f"anygpu: unknown command {name!r}{did_you_mean(name, COMMANDS)}. Commands: {', '.join(COMMANDS)} "
            "(anygpu --help).",
            file=sys.stderr,
        )
        return 2
    anygpu.set_offline_defaults()  # nothing is downloaded unless HF_HUB_OFFLINE=0; set before the libraries load
    anygpu.quiet_library_warnings()
    module, function = COMMANDS[name].target.split(":")
    try:
        return getattr(importlib.import_module(module), function)(rest) or 0
    except KeyboardInterrupt:  # Ctrl-C: the shell's code for SIGINT, no traceback
        print(f"\nanygpu {name}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())

"""`anygpu` console command: `info`, `train [args]`, `launch` (interactive, or `--vendor nvidia|amd` for the vendor launcher), `plan`, `doctor`, `bench`, `verify`."""
from __future__ import annotations

import sys

USAGE = """usage: anygpu <command> [arguments]

commands:
  info                      the accelerators torch sees (vendor, names, memory, capability)
  train [args]              the native FSDP2 engine in this process (same as run_fsdp_standalone.py;
                            use torchrun or the launchers for several processes)
  launch [--dry-run]        interactive: detects the GPUs, shows the plan's recommendation, asks engine,
                            config, GPUs, global batch and output folder, prints the command and runs it
  launch --vendor V [...]   the launcher behind run_nvidia_all.sh / run_amd_all.sh (see --help);
                            with --interactive, the interactive launch for that vendor
  plan [...]                per-GPU memory of every strategy for a model, and the recommended one
  bench --nproc 1,2,4,8     tokens/s and scaling efficiency of a short job at several process counts
  verify [...] -- <job>     train a few steps of your job at several world sizes / engines (and resumed on
                            another), compare losses, grad norms and weights: exit 0 if they agree, 1 if not
  doctor [...]              what this machine can do, the launchers' commands, active checks (exit 1 on failure)
"""


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "info":
        from anygpu.runtime import hardware

        print(hardware.describe())
        return 0
    if command == "train":
        import anygpu

        anygpu.set_offline_defaults()
        from anygpu.engines.fsdp import main as train_main

        train_main(rest)
        return 0
    if command == "launch":
        from anygpu.launch.launcher import main as launch_main
        from anygpu.launch.launcher import split_argv

        mine, _ = split_argv(rest)
        if "--interactive" in mine or not any(a == "--vendor" or a.startswith("--vendor=") for a in mine):
            import anygpu

            anygpu.set_offline_defaults()
            from anygpu.tools.interactive import main as interactive_main

            return interactive_main(rest)
        return launch_main(rest)
    if command == "bench":
        from anygpu.tools.bench import main as bench_main

        return bench_main(rest)
    if command == "verify":
        from anygpu.tools.verify import main as verify_main

        return verify_main(rest)
    if command == "doctor":
        from anygpu.tools.doctor import main as doctor_main

        return doctor_main(rest)
    if command == "plan":
        import anygpu

        anygpu.set_offline_defaults()
        from anygpu.tools.plan import main as plan_main

        return plan_main(rest)
    print(f"anygpu: unknown command {command!r}\n\n{USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())

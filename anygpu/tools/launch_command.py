"""`anygpu launch`: the interactive launch, or with `--vendor V` (and no --interactive) the vendor launcher."""

from __future__ import annotations


def main(argv: list[str]) -> int:
    from anygpu.launch.launcher import split_argv

    mine, _ = split_argv(argv)
    if "--interactive" in mine or not any(a == "--vendor" or a.startswith("--vendor=") for a in mine):
        from anygpu.tools.interactive import main as interactive_main

        return interactive_main(argv)
    from anygpu.launch.launcher import main as launch_main

    return launch_main(argv)

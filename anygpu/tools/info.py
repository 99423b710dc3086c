"""`anygpu info`: the accelerators torch sees (vendor, names, memory, capability)."""

from __future__ import annotations

from anygpu.launch.suggest import ArgumentParser


def main(argv: list[str] | None = None) -> int:
    ArgumentParser(
        prog="anygpu info",
        description="The accelerators torch sees here: vendor, torch build, and per "
        "device its name, memory and capability (compute capability, or the gfx arch on AMD). "
        "For the checks a job needs, see anygpu doctor.",
    ).parse_args(argv)
    from anygpu.runtime import hardware

    print(hardware.describe())
    return 0

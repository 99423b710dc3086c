"""`anygpu train [config.yaml] [--option value ...]`: the native FSDP2 engine in this process."""

from __future__ import annotations

from anygpu.config.args import preflight


def main(argv: list[str]) -> int:
    preflight(argv, prog="anygpu train")  # --help and refusals before torch is imported (it takes seconds)
    from anygpu.engines.fsdp import main as train_main

    train_main(argv)
    return 0

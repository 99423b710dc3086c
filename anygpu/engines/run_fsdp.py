"""Native FSDP2 engine's entry: `python -m anygpu.engines.run_fsdp [config.yaml] [--arg value ...]`.

Under torchrun: `torchrun --nproc-per-node N -m anygpu.engines.run_fsdp ...`; also under `accelerate launch -m`.
The repository's run_fsdp_standalone.py is this module's main(). See --help.
"""

import anygpu
from anygpu import engines


def main(prog: str | None = None) -> None:
    """Offline defaults, then the arguments checked before torch is imported, then the training loop."""
    anygpu.set_offline_defaults()  # before transformers and datasets are imported: they read it at import
    anygpu.quiet_library_warnings()
    from anygpu.config.args import preflight

    # --help and bad input answered before torch is imported (seconds), one line, exit 2
    preflight(prog=prog, deeper=engines.preflight_checks("fsdp"))
    from anygpu.engines.fsdp import main as train

    train()


if __name__ == "__main__":
    main(prog=f"python -m {__spec__.name}")

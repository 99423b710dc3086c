"""HF Trainer engine's entry: `accelerate launch --config_file CFG --num_processes N -m anygpu.engines.run_hf
[config.yaml] [--arg value ...]`.

Also runs under `torchrun -m` (DDP) or as `python -m anygpu.engines.run_hf` (one process; nn.DataParallel over
several GPUs). The repository's run_hf_standalone.py is this module's main(). See --help.
"""

import anygpu
from anygpu import engines


def main(prog: str | None = None) -> None:
    """Offline defaults, then the arguments checked before torch is imported, then the Trainer."""
    anygpu.set_offline_defaults()  # before transformers and datasets are imported: they read it at import
    anygpu.quiet_library_warnings()
    from anygpu.config.args import HFEngineArguments, preflight

    # --help and bad input before torch is imported, exit 2
    preflight(extra=(HFEngineArguments,), prog=prog, deeper=engines.preflight_checks("hf"))
    from anygpu.engines.hf.engine import main as train

    train()


if __name__ == "__main__":
    main(prog=f"python -m {__spec__.name}")

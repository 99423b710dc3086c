#!/usr/bin/env python
"""Native FSDP2 engine: `torchrun --nproc-per-node N run_fsdp_standalone.py [config.yaml] [--arg value ...]`.

Also runs under `accelerate launch` or as plain `python` (one process). See --help.
"""
import anygpu

anygpu.set_offline_defaults()

from anygpu.engines.fsdp import main  # noqa: E402  (after the offline defaults)

if __name__ == "__main__":
    main()

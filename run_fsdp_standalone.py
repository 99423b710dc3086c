#!/usr/bin/env python
"""Native FSDP2 engine: `torchrun --nproc-per-node N run_fsdp_standalone.py [config.yaml] [--arg value ...]`.

Also runs under `accelerate launch` or as plain `python` (one process). See --help.
The code is anygpu/engines/run_fsdp.py, which an installed anygpu runs as `python -m anygpu.engines.run_fsdp`.
"""

from anygpu.engines.run_fsdp import main

if __name__ == "__main__":
    main()

#!/usr/bin/env python
"""Native FSDP2 engine: `torchrun --nproc-per-node N run_fsdp_standalone.py [config.yaml] [--arg value ...]`.

Also runs under `accelerate launch` or as plain `python` (one process). See --help.
"""

import anygpu

anygpu.set_offline_defaults()
anygpu.quiet_library_warnings()
from anygpu.config.args import preflight  # noqa: E402

if __name__ == "__main__":
    preflight()  # --help and bad input answered before torch is imported (seconds), one line, exit 2

from anygpu.engines.fsdp import main  # noqa: E402  (after the offline defaults)

if __name__ == "__main__":
    main()

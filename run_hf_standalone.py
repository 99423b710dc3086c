#!/usr/bin/env python
"""HF Trainer engine: `accelerate launch --config_file accelerate_configs/<ddp|fsdp|deepspeed_zero3>.yaml
--num_processes N run_hf_standalone.py [config.yaml] [--arg value ...]`.

Also runs under torchrun (DDP) or as plain `python` (one process; nn.DataParallel over several GPUs).
Same arguments, data order, initial weights and batch math as run_fsdp_standalone.py. See --help.
"""

import anygpu

anygpu.set_offline_defaults()
anygpu.quiet_library_warnings()
from anygpu.config.args import HFEngineArguments, preflight  # noqa: E402

if __name__ == "__main__":
    preflight(
        extra=(HFEngineArguments,)
    )  # --help and bad input answered before torch is imported (seconds), one line, exit 2

from anygpu.engines.hf.engine import main  # noqa: E402  (after the offline defaults)

if __name__ == "__main__":
    main()

#!/usr/bin/env python
"""HF Trainer engine: `accelerate launch --config_file accelerate_configs/<ddp|fsdp|deepspeed_zero3>.yaml
--num_processes N run_hf_standalone.py [config.yaml] [--arg value ...]`.

Also runs under torchrun (DDP) or as plain `python` (one process; nn.DataParallel over several GPUs).
Same arguments, data order, initial weights and batch math as run_fsdp_standalone.py. See --help.
The code is anygpu/engines/run_hf.py, which an installed anygpu runs as `python -m anygpu.engines.run_hf`.
"""

from anygpu.engines.run_hf import main

if __name__ == "__main__":
    main()

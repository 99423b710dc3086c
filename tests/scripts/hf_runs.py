"""Several HF-engine runs in one launch (start-up costs more than a tiny run): `accelerate launch … hf_runs.py
ARGS [::: ARGS ...]`, each ARGS a full argument list of run_hf_standalone.py (its own --output_dir). The runs
share the launch's process group and run one after another; before each, rank 0 prints `=== run I ===`."""

import os
import sys

import anygpu

anygpu.set_offline_defaults()

from argv_groups import split_args

from anygpu.config.args import parse_args
from anygpu.engines.hf import engine
from anygpu.engines.hf.engine import HFEngineArguments
from anygpu.reliability import run_guard
from anygpu.runtime import distributed

if __name__ == "__main__":
    runs = split_args(sys.argv[1:])
    distributed.init_distributed()  # one process group for all runs (accelerate joins it): the runs leave it open
    for i, args in enumerate(runs):
        distributed.barrier()
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"=== run {i} ===", flush=True)
        distributed.barrier()
        try:
            engine.run(*parse_args(args, extra=(HFEngineArguments,)))
        finally:
            run_guard.release_locks()
    distributed.destroy()

"""Several FSDP2-engine runs in one launch (start-up costs more than a tiny run): plain python or torchrun.

    fsdp_runs.py ARGS [::: ARGS ...]

Each ARGS is a full argument list of run_fsdp_standalone.py (its own --output_dir). The runs share one
process group and run one after another; before each, rank 0 prints `=== run I ===` on a line of its own
(between barriers, so every rank's lines of a run come after its marker): split_runs() cuts the output.
"""

import sys

import anygpu

anygpu.set_offline_defaults()

from argv_groups import split_args

from anygpu.config.args import parse_args
from anygpu.engines import fsdp as fsdp_engine
from anygpu.reliability import run_guard
from anygpu.runtime import distributed

if __name__ == "__main__":
    distributed.init_distributed()  # one process group for all runs: a run leaves a group it did not make open
    for i, args in enumerate(split_args(sys.argv[1:])):
        info = distributed.init_distributed()
        distributed.barrier()
        if info.rank == 0:
            print(f"=== run {i} ===", flush=True)
        distributed.barrier()
        try:
            fsdp_engine.run(*parse_args(args))
        finally:
            run_guard.release_locks()
    distributed.destroy()

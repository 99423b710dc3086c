"""One process: the FSDP2 engine's own steps, each counted for host syncs (`anygpu.runtime.host_syncs`): the
optimizer step, the log's per-step work and the step boundary's agreement, as `FSDPTrainer.train` runs them
(the loader's read-ahead of the CPU batches left out, as a worker does it on a GPU's host).

    step_syncs.py ARGS [::: ARGS ...]

Prints `SYNCS <run> [{"step": …, "count": …, "where": …}, …]` for each argument list."""

import json
import sys

import anygpu

anygpu.set_offline_defaults()

from argv_groups import split_args  # noqa: E402

from anygpu.config.args import parse_args  # noqa: E402
from anygpu.engines import fsdp as fsdp_engine  # noqa: E402
from anygpu.reliability import run_guard  # noqa: E402
from anygpu.runtime import distributed, host_syncs  # noqa: E402


def counted(argv: list[str]) -> list[dict]:
    trainer = fsdp_engine.FSDPTrainer(*parse_args(argv))
    trainer._start()
    end = trainer.schedule.end_step
    batches = iter(fsdp_engine.steps(trainer.prep, trainer.info, 0, end, cp=trainer.cp))
    out = []
    for step in range(1, end + 1):
        cpu = next(batches)
        with host_syncs.count(trainer.info.device) as syncs:
            trainer.optimizer_step(step, cpu)
            trainer.log.step_done(step)
            trainer._at_boundary()
        out.append({"step": step, "count": syncs.count, "where": syncs.summary()})
    batches = None
    trainer.close()
    return out


if __name__ == "__main__":
    distributed.init_distributed()  # one process group for all runs
    for i, argv in enumerate(split_args(sys.argv[1:])):
        try:
            print(f"SYNCS {i} " + json.dumps(counted(argv)), flush=True)
        finally:
            run_guard.release_locks()
    distributed.destroy()

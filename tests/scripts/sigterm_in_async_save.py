"""SIGTERM at several moments of a background checkpoint write, in one process (one start-up for all).

    sigterm_in_async_save.py MOMENT[,MOMENT...] ARGS

For each moment, one FSDP2-engine run of ARGS (plain python, one rank, --async_save true) into
<output_dir>/<moment>: the background write of checkpoint-4 sends this process SIGTERM at that moment and
then stalls for SLOW_S seconds, longer than the grace period the test sets (ANYGPU_SIGTERM_GRACE_S), so a
wait for it that the preemption watchdog does not know about ends the process. Moments:
  write-start  before any shard is written;
  mid-shard    after the first tensor of a shard is on disk;
  metadata     every shard written, DCP's metadata not yet;
  commit       the write finished, before rank 0 writes the manifest and renames the folder.
Prints `RESULT <moment> <exit code>` after each run. Then, when RESUME is set, resumes the first moment's
run with `latest` (the preemption checkpoint must load).
"""

import os
import signal
import sys
import time

import anygpu

anygpu.set_offline_defaults()

from torch.distributed.checkpoint import filesystem  # noqa: E402

from anygpu.config.args import parse_args  # noqa: E402
from anygpu.engines import fsdp as fsdp_engine  # noqa: E402
from anygpu.reliability import run_guard  # noqa: E402
from anygpu.runtime import distributed  # noqa: E402

SLOW_S = 3.0
moment = ""
armed = False  # inside checkpoint-4's background write


def stall(where: str) -> None:
    global armed
    if armed and moment == where:
        armed = False
        print(f"SIGTERM at {where}", flush=True)
        os.kill(os.getpid(), signal.SIGTERM)  # the main thread's handler runs; this thread goes on writing
        time.sleep(SLOW_S)


real_write_data, real_write_item, real_finish = (
    filesystem.FileSystemWriter.write_data,
    filesystem._write_item,
    filesystem.FileSystemWriter.finish,
)


def write_data(self, plan, planner):
    global armed
    armed = ".checkpoint-4.tmp" in str(self.path)
    stall("write-start")
    return real_write_data(self, plan, planner)


def write_item(*args, **kwargs):
    result = real_write_item(*args, **kwargs)
    stall("mid-shard")
    return result


def finish(self, metadata, results):
    stall("metadata")
    return real_finish(self, metadata, results)


filesystem.FileSystemWriter.write_data = write_data
filesystem._write_item = write_item
filesystem.FileSystemWriter.finish = finish

if __name__ == "__main__":
    moments, args = sys.argv[1].split(","), sys.argv[2:]
    i = args.index("--output_dir")
    out, args = args[i + 1], args[:i] + args[i + 2 :]
    distributed.init_distributed()  # one process group for all runs: a run leaves a group it did not make open
    for moment in moments:
        if moment == "commit":  # the fault hooks in AsyncCheckpointer._commit, after the write, before the rename
            os.environ.update(ANYGPU_TEST_SIGTERM_AT="save:4", ANYGPU_TEST_SLOW_SAVE=f"4:{SLOW_S}")
        code = 0
        try:
            fsdp_engine.run(*parse_args([*args, "--output_dir", f"{out}/{moment}"]))
        except SystemExit as e:
            code = e.code
        finally:
            run_guard.release_locks()
            for name in ("ANYGPU_TEST_SIGTERM_AT", "ANYGPU_TEST_SLOW_SAVE"):
                os.environ.pop(name, None)
        print(f"RESULT {moment} {code}", flush=True)
    if os.environ.get("RESUME"):
        moment = ""
        fsdp_engine.run(
            *parse_args([*args, "--output_dir", f"{out}/{moments[0]}", "--resume_from_checkpoint", "latest"])
        )

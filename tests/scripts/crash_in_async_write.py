"""The FSDP2 engine, killed while the background write of its second periodic checkpoint is under way."""

import os
import sys

import anygpu

anygpu.set_offline_defaults()

from torch.distributed.checkpoint import filesystem  # noqa: E402

from anygpu.engines.fsdp import main  # noqa: E402

real_write = filesystem.FileSystemWriter.write_data
writes = []


def write_then_die(self, plan, planner):
    writes.append(plan)
    if len(writes) == 2:  # the second checkpoint: some bytes on disk, then the process is gone
        (filesystem.Path(self.path) / "__0_0.distcp").write_bytes(b"partial")
        print("CRASH during the background write", flush=True)
        os._exit(137)
    return real_write(self, plan, planner)


filesystem.FileSystemWriter.write_data = write_then_die
if __name__ == "__main__":
    main(sys.argv[1:])

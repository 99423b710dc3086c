"""The FSDP2 engine, counting the checksums each rank computes of the checkpoint it resumes from; at the end
each rank prints `HASHED rank R: checkpoint-N COUNT` (the newest checkpoint in --output_dir at start-up)."""

import os
import sys
from pathlib import Path

import anygpu

anygpu.set_offline_defaults()

from anygpu.checkpoint import manifest, store  # noqa: E402
from anygpu.engines.fsdp import main  # noqa: E402

real_sha256 = manifest.sha256
hashed: list[Path] = []


def counting_sha256(path: Path) -> str:
    hashed.append(Path(path))
    return real_sha256(path)


manifest.sha256 = counting_sha256
if __name__ == "__main__":
    out = sys.argv[sys.argv.index("--output_dir") + 1]
    resumed = store.checkpoints(out)[-1].name
    try:
        main(sys.argv[1:])
    finally:
        count = sum(1 for p in hashed if p.parent.name == resumed or p.parent.parent.name == resumed)
        # one write of the whole line: print() writes the text and its newline apart, and the ranks end together
        sys.stdout.write(f"HASHED rank {os.environ.get('RANK', '0')}: {resumed} {count}\n")
        sys.stdout.flush()

"""Rank side of benchmarks/corpus_at_scale.py: one FSDP2-engine run (`torchrun … _rank_peak.py ARGS`), then each
rank prints `PEAK <rank> <bytes>`: its whole process's peak resident set (VmHWM: imports, model, data, steps)."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import anygpu  # noqa: E402

anygpu.set_offline_defaults()

from anygpu.engines.fsdp import main  # noqa: E402


def peak_bytes() -> int:
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("/proc/self/status has no VmHWM")


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    finally:
        print(f"PEAK {os.environ.get('RANK', '0')} {peak_bytes()}", flush=True)

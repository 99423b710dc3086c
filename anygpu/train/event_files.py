"""TensorBoard event files trimmed on resume, as metrics.jsonl is: events of steps past the resumed
step are dropped (they will be redone), so the curves never show two branches."""
from __future__ import annotations

import os
from pathlib import Path


def trim_after(log_dir: str | Path, step: int) -> int:
    """Rewrite every events file under `log_dir` keeping only events with step <= `step`; returns how many were dropped."""
    try:
        from tensorboard.backend.event_processing.event_file_loader import RawEventFileLoader
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.summary.writer.record_writer import RecordWriter
    except ImportError:  # no tensorboard, no event files
        return 0
    dropped = 0
    for path in sorted(Path(log_dir).rglob("events.out.tfevents.*")) if Path(log_dir).is_dir() else []:
        records = list(RawEventFileLoader(str(path)).Load())
        keep = [r for r in records if Event.FromString(r).step <= step]
        if len(keep) == len(records):
            continue
        dropped += len(records) - len(keep)
        tmp = path.with_name(path.name + ".trim")
        with tmp.open("wb") as f:
            writer = RecordWriter(f)
            for r in keep:
                writer.write(r)
            writer.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    return dropped

"""File-system helpers that checkpoints, exports and LoRA share: atomic folder replace, fsync, JSON written durably."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any


def replace_dir(tmp: Path, final: Path) -> None:
    if final.exists():
        old = final.with_name(f".{final.name}.old")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)


def write_json(path: Path, data: dict[str, Any]) -> None:
    with path.open("w") as f:
        json.dump(data, f, indent=2, default=str)
        f.flush()
        os.fsync(f.fileno())


def free_bytes(path: Path) -> int:
    """Bytes free for this user on the device that holds `path`."""
    return shutil.disk_usage(path).free


def fsync_path(path: Path) -> None:
    """Flush a file's or a folder's entries to the disk (a folder: the names in it, e.g. after a rename)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)

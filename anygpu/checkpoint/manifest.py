"""Verified checkpoints: a manifest written last into each checkpoint (step, world size, engine, package
version, every file with its size and, where affordable, its sha256), checked before a resume.

Also the start-up repair of a checkpoint replaced half-way (`.checkpoint-N.old` left by a crash between
the two renames of `fs.replace_dir`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

from anygpu.runtime import fs

logger = logging.getLogger(__name__)

MANIFEST = "manifest.json"
# Files up to this size get a checksum (hashing runs at ~1 GB/s on one core); larger ones a size check.
HASH_LIMIT_BYTES = int(float(os.environ.get("ANYGPU_MANIFEST_HASH_MB", "256")) * 2**20)


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def write(folder: Path, step: int, world_size: int, engine: str) -> None:
    """fsync every file of `folder` and its sub-folders, then write the manifest (the last file)."""
    from anygpu import __version__

    files: dict[str, dict[str, Any]] = {}
    for path in sorted(p for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST):
        fs.fsync_path(path)  # Trainer's and torch.save's files are not synced by their writers
        size = path.stat().st_size
        entry: dict[str, Any] = {"size": size}
        if size <= HASH_LIMIT_BYTES:
            entry["sha256"] = sha256(path)
        files[path.relative_to(folder).as_posix()] = entry
    for sub in sorted({p.parent for p in folder.rglob("*")} | {folder}):
        fs.fsync_path(sub)
    data = {"step": step, "world_size": world_size, "engine": engine, "anygpu_version": __version__, "files": files}
    with (folder / MANIFEST).open("w") as f:
        json.dump(data, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def read(folder: Path) -> dict[str, Any] | None:
    try:
        return json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError):
        return None


def problem(folder: Path, checksums: bool = True) -> str | None:
    """What is wrong with the checkpoint `folder` (naming the file), or None when it is complete and intact."""
    if not folder.is_dir():
        return f"{folder}: no such folder"
    if not (folder / MANIFEST).exists():
        return f"{folder / MANIFEST} is missing (an incomplete checkpoint, or one written before manifests)"
    data = read(folder)
    if data is None or not isinstance(data.get("files"), dict):
        return f"{folder / MANIFEST} is unreadable (damaged)"
    for rel, entry in data["files"].items():
        path = folder / rel
        if not path.is_file():
            return f"{path} is missing"
        size = path.stat().st_size
        if size != entry["size"]:
            return f"{path} has {size} bytes, the manifest says {entry['size']} (truncated or damaged)"
        if checksums and "sha256" in entry and sha256(path) != entry["sha256"]:
            return f"{path} does not match its checksum in the manifest (damaged)"
    return None


def engine_of(folder: Path) -> str | None:
    """'fsdp' or 'hf': which engine wrote the checkpoint (from the manifest, else from its files)."""
    data = read(folder)
    if data and data.get("engine"):
        return data["engine"]
    if (folder / "anygpu_state.json").exists():
        return "hf"
    if (folder / ".metadata").exists():
        return "fsdp"
    return None


def recover_half_replaced(root: Path) -> list[str]:
    """Repair what a crash between the two renames of `replace_dir` left: `.NAME.old` beside (or instead of)
    NAME. The new NAME, when present, wins; otherwise the old one is put back. Returns what it did."""
    done = []
    for old in sorted(root.glob(".*.old")) if root.is_dir() else []:
        final = root / old.name[1 : -len(".old")]
        if final.exists():  # the second rename (tmp -> final) is atomic: a final folder is the complete new one
            shutil.rmtree(old, ignore_errors=True)
            done.append(f"removed {old.name} (left by an interrupted replace; {final.name} is complete)")
        else:
            os.replace(old, final)
            done.append(f"restored {final.name} from {old.name} (its replacement was interrupted)")
    return done

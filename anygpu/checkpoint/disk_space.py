"""A full disk while saving: how many bytes a checkpoint needs, the free-space check before writing, and
the one error that says which folder, how many bytes and what is still intact."""

from __future__ import annotations

import errno
from pathlib import Path
from typing import Iterator

from anygpu.checkpoint import manifest
from anygpu.errors import SaveError
from anygpu.runtime import fs

FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
# What writers that drop the errno say: torch.save's C++ writer, safetensors' Rust one (io error 28).
FULL_WORDS = ("No space left on device", "Disk quota exceeded", "StorageFull", "os error 28")


def size_of(ckpt: Path) -> int | None:
    """A complete checkpoint's bytes, from its manifest (None without a readable one)."""
    data = manifest.read(ckpt)
    if not data or not isinstance(data.get("files"), dict):
        return None
    return sum(int(f.get("size", 0)) for f in data["files"].values()) + (ckpt / manifest.MANIFEST).stat().st_size


def needed_bytes(newest: Path | None, estimate: int | None) -> int | None:
    """What the next checkpoint needs: the newest complete one's size (the same model and optimizer), else
    the caller's estimate from the state it holds, else unknown."""
    known = size_of(newest) if newest is not None else None
    return known if known is not None else estimate


def shortfall(root: Path, final: Path, needed: int | None) -> str | None:
    """The error message when the device of `root` has less room than `needed`, else None (also when unknown)."""
    if not needed:
        return None
    free = fs.free_bytes(root)
    if free >= needed:
        return None
    return (
        f"no space left on the device of {root}: {final.name} needs about {needed:,} bytes and {free:,} are free; "
        "nothing was written. Free space (or lower --save_total_limit) and resume with --resume_from_checkpoint latest."
    )


def _chain(exc: BaseException) -> Iterator[BaseException]:
    """The exception, its causes and contexts, and what torch.distributed.checkpoint gathered from each rank."""
    seen, todo = set(), [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        todo += [e.__cause__, e.__context__]
        failures = getattr(e, "failures", None)  # CheckpointException: {rank: (exception, traceback)}
        if isinstance(failures, dict):
            todo += [f[0] if isinstance(f, tuple) else f for f in failures.values()]


def disk_full_cause(exc: BaseException) -> BaseException | None:
    """The exception in `exc`'s chain that says the device is full, or None."""
    for e in _chain(exc):
        if isinstance(e, OSError) and e.errno in FULL_ERRNOS:
            return e
        if any(w in str(e).split("\n", 1)[0] for w in FULL_WORDS):
            return e
    return None


def full_disk_error(
    root: Path, final: Path, needed: int | None, cause: BaseException | str, intact: str | None
) -> SaveError:
    """The one error for a save that ran out of space: folder, bytes needed and free, what is still intact."""
    need = f"about {needed:,} bytes" if needed else "a size not known before its first save"
    first_line = str(cause).strip().splitlines()[0] if str(cause).strip() else type(cause).__name__
    return SaveError(
        f"no space left on the device of {root} while writing {final.name} (it needs {need}, "
        f"{fs.free_bytes(root):,} bytes are free; {first_line}): the partial folder was removed and "
        f"{intact or 'no earlier checkpoint'} is intact; free space (or lower --save_total_limit) and resume with "
        "--resume_from_checkpoint latest."
    )

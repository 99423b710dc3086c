"""Where a source's raw text is: a file, a folder (searched recursively) or a glob, expanded into files in one
fixed order, each with its format, compression and identity (size, mtime), and cut into parts that can be
prepared in parallel.

A part is a byte range of an uncompressed line-based file (.txt, .jsonl) or of a parquet file's row groups:
part k holds the documents (or row groups) that *start* in [k·PART_BYTES, (k+1)·PART_BYTES), so how a file is
cut depends on the file alone, and its preparer finds its own first document (`readers`). Compressed files,
.csv (quoted fields may span lines) and .json are one part each."""

from __future__ import annotations

import glob
import os
from dataclasses import dataclass
from pathlib import Path

from anygpu.errors import UsageError

BUILDERS = {".txt": "text", ".text": "text", ".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}
COMPRESSIONS = {".gz": "gzip", ".zst": "zstd", ".zstd": "zstd", ".bz2": "bz2"}  # pyarrow's codec names
PART_BYTES = 256 << 20  # fixed (it shapes the prepared data's cache keys): ~25 s of one core's tokenising
SUFFIXES = ", ".join([*BUILDERS, *(f"{s} + {c}" for s, c in ((".jsonl", ".gz"), (".txt", ".zst")))])


@dataclass(frozen=True)
class DataFile:
    path: str  # absolute
    size: int
    mtime_ns: int
    builder: str  # text, json, csv, parquet
    compression: str | None  # gzip, zstd, bz2 or None
    part_bytes: int = PART_BYTES  # the byte range of each part (fixed; smaller in tests)

    @property
    def splittable(self) -> bool:
        """Cut into parts: a seekable file whose documents can be found from any offset."""
        if self.compression is not None:
            return False
        return self.builder == "parquet" or self.builder == "text" or self.path.lower().endswith(".jsonl")

    @property
    def num_parts(self) -> int:
        return max(1, -(-self.size // self.part_bytes)) if self.splittable else 1

    def part_range(self, part: int) -> tuple[int, float]:
        """[start, end) of the bytes where part `part`'s documents start (the whole file when it is not split)."""
        if not self.splittable:
            return 0, float("inf")
        return part * self.part_bytes, (part + 1) * self.part_bytes

    def identity(self) -> list:
        """What says the file changed (path, size, mtime): an edited file is prepared again, the others are not."""
        return [self.path, self.size, self.mtime_ns, self.part_bytes]


def kind(path: str) -> tuple[str, str | None] | None:
    """(builder, compression) from the name (`corpus.jsonl.zst` → json, zstd), or None for another kind of file."""
    lower = path.lower()
    compression = next((c for s, c in COMPRESSIONS.items() if lower.endswith(s)), None)
    if compression is not None:
        lower = lower[: lower.rfind(".")]
    builder = BUILDERS.get(os.path.splitext(lower)[1])
    if builder is None or (builder == "parquet" and compression is not None):
        return None  # parquet compresses inside the file
    return builder, compression


def data_file(path: str, part_bytes: int = PART_BYTES) -> DataFile:
    builder, compression = kind(path)  # type: ignore[misc]  # callers pass known kinds only
    st = os.stat(path)
    return DataFile(os.path.abspath(path), st.st_size, st.st_mtime_ns, builder, compression, part_bytes)


def _walk(folder: str) -> list[str]:
    """Every file under `folder`, links to folders followed once each (a link back up does not loop)."""
    found, seen = [], set()
    for dirpath, dirnames, filenames in os.walk(folder, followlinks=True):
        real = os.path.realpath(dirpath)
        if real in seen:
            dirnames[:] = []
            continue
        seen.add(real)
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        found += [os.path.join(dirpath, f) for f in sorted(filenames) if not f.startswith(".")]
    return found


def expand(pattern: str, option: str) -> list[DataFile]:
    """The files `pattern` names, sorted by path: a file, every known file under a folder, or a glob's matches.
    Files of other kinds under a folder or a glob are left out; none at all is refused."""
    if os.path.isdir(pattern):
        candidates, given = _walk(pattern), "folder"
    elif os.path.isfile(pattern):
        if kind(pattern) is None:
            raise UsageError(f"{option} {pattern}: unknown format; use one of {SUFFIXES} (gzip/zstd compressed too).")
        return [data_file(pattern)]
    else:
        matches = sorted(glob.glob(pattern, recursive=True))
        candidates, given = [p for m in matches for p in (_walk(m) if os.path.isdir(m) else [m])], "glob"
    files = sorted({os.path.abspath(p) for p in candidates if kind(p) is not None})
    if not files:
        raise UsageError(
            f"{option} {pattern}: the {given} holds no text file it can read ({len(candidates)} other file(s)); give "
            f".txt, .jsonl, .json, .csv or .parquet files (.gz/.zst compressed too)."
        )
    return [data_file(p) for p in files]


def total_bytes(files: list[DataFile]) -> int:
    return sum(f.size for f in files)


def display(path: str) -> str:
    """A file's path as the user would write it: relative to here when below here."""
    try:
        return str(Path(path).relative_to(Path.cwd()))
    except ValueError:
        return path

"""Hostile input files refused with one line that names the file and what to do, before any worker
crashes on them deep inside `datasets` or the tokenizer: empty or whitespace-only files, binary junk,
invalid UTF-8, a text column that holds no text. Rows whose text is null are skipped and counted."""

from __future__ import annotations

import codecs
import glob
import logging
from pathlib import Path
from typing import Callable, TypeVar

from anygpu.errors import UsageError

logger = logging.getLogger(__name__)
T = TypeVar("T")
CHUNK = 1 << 20
SKIP = " (or --skip_bad_rows true: such files of a folder or glob are left out and counted)"


def files_of(pattern: str) -> list[Path]:
    return [Path(p) for p in sorted(glob.glob(pattern))] or [Path(pattern)]


def check_file(path: Path, builder: str, option: str) -> None:
    """Cheap checks before loading: emptiness, binary content, whitespace only (stops at the first text)."""
    size = path.stat().st_size
    if size == 0:
        raise UsageError(f"{option} {path} is empty: give a file that holds training text{SKIP}.")
    with path.open("rb") as f:
        head = f.read(CHUNK)
        if builder == "parquet":
            if not head.startswith(b"PAR1"):
                raise UsageError(
                    f"{option} {path} is not a parquet file (no PAR1 header): give a .parquet file or rename it."
                )
            return
        if (nul := head.find(b"\0")) >= 0:
            raise UsageError(
                f"{option} {path} looks binary (a NUL byte at offset {nul}): give UTF-8 "
                "text (.txt, .jsonl, .csv) or a .parquet file."
            )
        chunk = head
        while chunk:
            if chunk.strip():
                return
            chunk = f.read(CHUNK)
    raise UsageError(f"{option} {path} holds only whitespace: give a file that holds training text{SKIP}.")


def first_utf8_error(path: Path) -> str | None:
    """Where `path` stops being UTF-8 ('byte 0xe9 at offset 12, line 1'), or None."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset, line = 0, 1
    with path.open("rb") as f:
        while chunk := f.read(CHUNK):
            try:
                decoder.decode(chunk)
            except UnicodeDecodeError as e:
                bad = offset + e.start
                line += chunk[: e.start].count(b"\n")
                return f"byte 0x{chunk[e.start]:02x} at offset {bad}, line {line}"
            offset += len(chunk)
            line += chunk.count(b"\n")
    return None


def load_checked(
    pattern: str | list[str], builder: str, option: str, load: Callable[[], T], given: str | None = None
) -> T:
    """`load()` the files of `pattern` (a glob, or the files themselves) after the cheap checks; a failure to parse
    them is a one-line refusal (`given`: what the user wrote, for it)."""
    paths = [Path(p) for p in pattern] if isinstance(pattern, list) else files_of(pattern)
    pattern = given or (pattern if isinstance(pattern, str) else str(paths[0]))
    for path in paths:
        check_file(path, builder, option)
    try:
        return load()
    except Exception as e:  # datasets wraps the parser's error (UnicodeDecodeError, ArrowInvalid, JSONDecodeError…)
        from datasets.exceptions import DatasetGenerationError

        if not isinstance(e, (DatasetGenerationError, UnicodeDecodeError, ValueError)) or isinstance(e, UsageError):
            raise
        for path in paths if builder != "parquet" else []:
            if where := first_utf8_error(path):
                raise UsageError(
                    f"{option} {path} is not valid UTF-8 ({where}): convert it, e.g. "
                    f"iconv -f latin1 -t utf-8 {path} > {path.with_suffix('.utf8' + path.suffix)}."
                ) from e
        cause = e.__cause__ or e
        raise UsageError(
            f"{option} {pattern} cannot be read as {builder}: {type(cause).__name__}: "
            f"{str(cause).splitlines()[0] if str(cause) else ''}".rstrip(": ")
            + "."
        ) from e


def check_text_column(ds, column: str, source: str, split: str) -> None:
    """The text column must hold strings; null rows are skipped (and counted), an empty split is refused."""
    feature = ds.features.get(column)
    dtype = getattr(feature, "dtype", type(feature).__name__)
    if dtype not in ("string", "large_string"):
        raise UsageError(
            f"--text_column {column!r} of {source} ({split}) holds {dtype} values, not text: name the "
            "column that holds the text, or convert its values to strings."
        )
    if len(ds) == 0:
        raise UsageError(f"{source} ({split}) has no rows: give a file that holds training text.")
    nulls = ds.data.column(column).null_count
    if nulls == len(ds):
        raise UsageError(f"--text_column {column!r} of {source} ({split}) is null in every row: no training text.")
    if nulls:
        logger.warning("%s (%s): skipping %d of %d rows whose %r is null", source, split, nulls, len(ds), column)

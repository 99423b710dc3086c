"""The documents of one part of a raw-text file, streamed (never the whole file in memory): .txt lines or
paragraphs, JSON lines or a JSON array, CSV rows, parquet row groups; gzip, zstd or bz2 compressed.

A row that cannot be read (corrupt JSON, a value that is not text, invalid UTF-8) is refused in one line that
names the file and the line, or, with --skip_bad_rows, dropped and counted; so is an empty or binary file.
Null values are skipped and counted, as before."""

from __future__ import annotations

import csv
import functools
import io
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Iterator

from anygpu.data import checks
from anygpu.data.files import DataFile, display
from anygpu.errors import UsageError

ARROW_TYPES = {int: "int64", float: "double", bool: "bool", list: "list", dict: "struct"}
SNIFF_BYTES = 16 << 20  # --txt_sample_by auto looks for a blank line this far into each file
BOM = b"\xef\xbb\xbf"  # a UTF-8 byte-order mark some editors write first: not part of the text


@dataclass
class ReadStats:
    documents: int = 0
    null_rows: int = 0
    bad_rows: int = 0
    bad_files: int = 0
    first_bad: str = ""  # where the first dropped row or file was, for the log

    def add(self, other: ReadStats) -> None:
        self.documents += other.documents
        self.null_rows += other.null_rows
        self.bad_rows += other.bad_rows
        self.bad_files += other.bad_files
        self.first_bad = self.first_bad or other.first_bad


@dataclass(frozen=True)
class Reading:
    """What to read from a file and how bad rows are handled."""

    option: str  # the argument that named the file, for the messages (--train_file, or a mixture's source)
    text_column: str
    sample_by: str  # .txt: auto, line, paragraph, document
    skip_bad_rows: bool

    def bad(self, stats: ReadStats, f: DataFile, at: int | str, what: str, advice: str = "") -> None:
        """A row that cannot be read (`at`: its byte offset, or a description): refused, or dropped and counted."""
        where = where_in(f, at)
        if not self.skip_bad_rows:
            raise UsageError(
                f"{self.option} {display(f.path)} {where}: {what}: {advice or 'fix or remove it'}, or pass "
                "--skip_bad_rows true to drop such rows and count them."
            )
        stats.bad_rows += 1
        stats.first_bad = stats.first_bad or f"{display(f.path)} {where} ({what})"


def where_in(f: DataFile, at: int | str) -> str:
    """'line N' for a byte offset of an uncompressed file (counted only when a message needs it)."""
    if isinstance(at, str):
        return at
    return f"line {line_number(f, at)}" if f.compression is None else f"at byte {at} of its decompressed text"


class _NativeRaw(io.RawIOBase):
    """pyarrow's decompressing stream as a raw file, so io.BufferedReader can read lines from it quickly."""

    def __init__(self, stream) -> None:
        self.stream = stream

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        data = self.stream.read(len(buffer))
        buffer[: len(data)] = data
        return len(data)


def open_binary(f: DataFile) -> BinaryIO:
    """The file's bytes, decompressed as they are read (gzip and bz2 by the standard library, zstd by pyarrow)."""
    if f.compression is None:
        return open(f.path, "rb")
    if f.compression in ("gzip", "bz2"):
        import bz2
        import gzip

        return (gzip if f.compression == "gzip" else bz2).open(f.path, "rb")
    import pyarrow as pa

    # small reads: what precedes a corrupt block still comes through (--skip_bad_rows keeps it)
    return io.BufferedReader(_NativeRaw(pa.input_stream(f.path, compression=f.compression)), 1 << 16)


def line_number(f: DataFile, offset: int) -> int:
    """The 1-based line at byte `offset` of an uncompressed file (counted only when a message needs it)."""
    count, done = 1, 0
    with open(f.path, "rb") as fh:
        while done < offset:
            chunk = fh.read(min(1 << 24, offset - done))
            if not chunk:
                break
            count += chunk.count(b"\n")
            done += len(chunk)
    return count


@functools.lru_cache(maxsize=64)
def resolve_sample_by(f: DataFile, choice: str) -> str:
    """--txt_sample_by auto: paragraphs when the file has a blank line (in its first 16 MB), else lines (looked at once
    per file and process: a file's pieces would each read those 16 MB again)."""
    if choice != "auto":
        return choice
    with open_binary(f) as fh:
        head = fh.read(SNIFF_BYTES)
    return "paragraph" if re.search(rb"\n[ \t\r]*\n", head.strip()) else "line"


def _first_line_start(fh: BinaryIO, start: int) -> int:
    """The first offset ≥ `start` where a line begins (0, or just after a newline)."""
    if start == 0:
        return 0
    fh.seek(start - 1)
    fh.readline()
    return fh.tell()


def _line_before_is_blank(fh: BinaryIO, at: int) -> bool:
    """Whether the line that ends just before offset `at` (a line start) is blank; the file start counts as blank."""
    if at == 0:
        return True
    end, text = at, b""
    while end > 0:
        begin = max(0, end - 4096)
        fh.seek(begin)
        text = fh.read(end - begin) + text
        cut = text.rfind(b"\n", 0, len(text) - 1)
        if cut >= 0:
            return not text[cut + 1 :].strip()
        end = begin
    return not text.strip()


def lines(fh: BinaryIO, f: DataFile, part: int) -> Iterator[tuple[int, bytes]]:
    """(offset, line) of the lines of part `part` that start in its byte range (all of them, unsplit files)."""
    start, end = f.part_range(part)
    offset = _first_line_start(fh, start) if f.compression is None else 0
    for line in fh:
        if offset >= end:
            return
        yield offset, line.removeprefix(BOM) if offset == 0 else line
        offset += len(line)


def _decoded(reading: Reading, stats: ReadStats, f: DataFile, offset: int, raw: bytes) -> str | None:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        where = where_in(f, offset + e.start)
        if not reading.skip_bad_rows:
            raise UsageError(
                f"{reading.option} {display(f.path)} is not valid UTF-8 (byte 0x{raw[e.start]:02x} at offset "
                f"{offset + e.start}, {where}): convert it, e.g. iconv -f latin1 -t utf-8, or pass "
                "--skip_bad_rows true to drop such rows and count them."
            ) from None
        reading.bad(stats, f, where, "not valid UTF-8")
        return None


def txt_documents(reading: Reading, f: DataFile, part: int, stats: ReadStats) -> Iterator[str]:
    mode = resolve_sample_by(f, reading.sample_by)
    with open_binary(f) as fh:
        if mode == "document":
            raw = fh.read().removeprefix(BOM)
            text = _decoded(reading, stats, f, 0, raw)
            if text is not None and text.strip():
                yield text
            return
        if mode == "line":
            for offset, raw in lines(fh, f, part):
                text = _decoded(reading, stats, f, offset, raw)
                if text is not None and text.strip():
                    yield text.rstrip("\r\n")
            return
        yield from _paragraphs(reading, fh, f, part, stats)


def _paragraphs(reading: Reading, fh: BinaryIO, f: DataFile, part: int, stats: ReadStats) -> Iterator[str]:
    """Blank-line separated paragraphs that start in the part (a paragraph may run on past its end)."""
    start, end = f.part_range(part)
    first, prev_blank = 0, True
    if f.compression is None:  # a compressed file is one part, read from its start
        first = _first_line_start(fh, start)
        prev_blank = _line_before_is_blank(fh, first)
        fh.seek(first)
    offset, current, begun = first, [], None
    for line in fh:
        raw = line.removeprefix(BOM) if offset == 0 else line
        blank = not raw.strip()
        if not blank and prev_blank and not current:
            if offset >= end:
                return
            begun = offset
        if not blank and (current or begun is not None):
            current.append(raw)
        elif blank and current:
            text = _decoded(reading, stats, f, begun, b"".join(current))
            if text is not None:
                yield text.rstrip("\r\n")
            current, begun = [], None
        prev_blank, offset = blank, offset + len(line)
    if current:
        text = _decoded(reading, stats, f, begun, b"".join(current))
        if text is not None:
            yield text.rstrip("\r\n")


def _value(reading: Reading, stats: ReadStats, f: DataFile, where: int | str, row: object) -> str | None:
    """The text of one parsed row, or None (null: counted; not text: refused or dropped)."""
    if not isinstance(row, dict):
        reading.bad(stats, f, where, f"a {type(row).__name__}, not an object with a {reading.text_column!r} key")
        return None
    value = row.get(reading.text_column)
    if value is None:
        stats.null_rows += 1
        return None
    if not isinstance(value, str):
        kind = ARROW_TYPES.get(type(value), type(value).__name__)
        reading.bad(
            stats,
            f,
            where,
            f"--text_column {reading.text_column!r} holds {kind} values, not text",
            "name the column that holds the text, or convert its values to strings",
        )
        return None
    return value


def _is_json_array(f: DataFile) -> bool:
    with open_binary(f) as fh:
        return fh.read(4096).removeprefix(BOM).lstrip().startswith(b"[")


def json_documents(reading: Reading, f: DataFile, part: int, stats: ReadStats) -> Iterator[str]:
    if _is_json_array(f):  # read whole, by part 0 alone
        if part == 0:
            with open_binary(f) as fh:
                rows = json.loads(fh.read().removeprefix(BOM))
            yield from _texts(reading, stats, f, ((f"item {i}", row) for i, row in enumerate(rows)), True)
        return
    yield from _texts(reading, stats, f, _json_lines(reading, stats, f, part), part == 0)


def _json_lines(reading: Reading, stats: ReadStats, f: DataFile, part: int) -> Iterator[tuple[int, object]]:
    with open_binary(f) as fh:
        for offset, raw in lines(fh, f, part):
            if not raw.strip():
                continue
            try:
                yield offset, json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                reading.bad(stats, f, offset, f"not JSON ({type(e).__name__}: {str(e).splitlines()[0]})")


def _texts(reading: Reading, stats: ReadStats, f: DataFile, rows, whole_file: bool) -> Iterator[str]:
    """The texts of parsed rows. A file (its first part) whose rows all lack the text column's key is refused as a
    parquet or CSV file without the column is (rows without it among rows with it are null rows, as in datasets)."""
    keys, has_column = None, False
    for where, row in rows:
        if isinstance(row, dict) and reading.text_column not in row:
            keys = keys or list(row)
        elif isinstance(row, dict):
            has_column = True
        if (text := _value(reading, stats, f, where, row)) is not None:
            yield text
    if whole_file and keys is not None and not has_column:
        raise UsageError(missing_column(reading, f, keys))


def csv_documents(reading: Reading, f: DataFile, stats: ReadStats) -> Iterator[str]:
    csv.field_size_limit(sys.maxsize)
    with open_binary(f) as fh:
        rows = csv.reader(io.TextIOWrapper(fh, encoding="utf-8-sig", newline=""))
        try:
            header = next(rows, [])
            column = _column_index(reading, f, header)
            for row in rows:
                if column >= len(row) or row[column] == "":
                    stats.null_rows += 1
                elif row[column].strip():
                    yield row[column]
        except (UnicodeDecodeError, csv.Error) as e:  # the reader cannot go on past it: the rest of the file is dropped
            what = "not valid UTF-8" if isinstance(e, UnicodeDecodeError) else f"not CSV ({e})"
            reading.bad(stats, f, f"line {rows.line_num + 1}", what + "; the rest of the file is dropped")


def _column_index(reading: Reading, f: DataFile, header: list[str]) -> int:
    if reading.text_column not in header:
        raise UsageError(missing_column(reading, f, header))
    return header.index(reading.text_column)


def missing_column(reading: Reading, f: DataFile, columns: list[str]) -> str:
    return (
        f"{reading.option} {display(f.path)}: --text_column {reading.text_column!r} is not one of its columns "
        f"{columns}: name the text column (text_column), or give files that have it."
    )


def parquet_documents(reading: Reading, f: DataFile, part: int, stats: ReadStats) -> Iterator[str]:
    import pyarrow.parquet as pq

    pf = pq.ParquetFile(f.path)
    if reading.text_column not in pf.schema_arrow.names:
        raise UsageError(missing_column(reading, f, pf.schema_arrow.names))
    kind = pf.schema_arrow.field(reading.text_column).type
    if not _is_text(kind):
        reading.bad(
            stats,
            f,
            "(its schema)",
            f"--text_column {reading.text_column!r} holds {kind} values, not text",
            "name the column that holds the text, or convert its values to strings",
        )
        return
    for batch in pf.iter_batches(row_groups=row_groups(pf, f, part), columns=[reading.text_column]):
        column = batch.column(0)
        stats.null_rows += column.null_count
        yield from (t for t in column.to_pylist() if t is not None and t.strip())


def _is_text(kind) -> bool:
    """An Arrow string type, dictionary-encoded or not."""
    import pyarrow as pa

    if pa.types.is_dictionary(kind):
        kind = kind.value_type
    return pa.types.is_string(kind) or pa.types.is_large_string(kind) or str(kind) == "string_view"


def row_groups(pf, f: DataFile, part: int) -> list[int]:
    """The row groups whose data starts in part `part`'s byte range."""
    meta, found = pf.metadata, []
    for i in range(meta.num_row_groups):
        col = meta.row_group(i).column(0)
        start = col.dictionary_page_offset if col.has_dictionary_page else col.data_page_offset
        low, high = f.part_range(part)
        if low <= start < high:
            found.append(i)
    return found


def documents(reading: Reading, f: DataFile, part: int, stats: ReadStats) -> Iterator[str]:
    """The non-empty documents of part `part` of `f`, in file order; counts what was skipped in `stats`."""
    if f.compression is None:  # every part (its first MB): a bad file's later parts must not read it as lines
        try:
            checks.check_file(Path(f.path), f.builder, reading.option)
        except UsageError:
            if not reading.skip_bad_rows:
                raise
            if part == 0:  # counted once
                stats.bad_files += 1
                stats.first_bad = stats.first_bad or f"{display(f.path)} (empty, whitespace or not text)"
            return
    read = {
        "text": lambda: txt_documents(reading, f, part, stats),
        "json": lambda: json_documents(reading, f, part, stats),
        "csv": lambda: csv_documents(reading, f, stats),
        "parquet": lambda: parquet_documents(reading, f, part, stats),
    }[f.builder]
    try:
        for text in read():
            stats.documents += 1
            yield text
    except (OSError, EOFError) as e:  # a truncated or corrupt compressed stream, a vanished file
        if not reading.skip_bad_rows:
            raise UsageError(
                f"{reading.option} {display(f.path)} cannot be read past document {stats.documents}: "
                f"{type(e).__name__}: {e}; repair or remove the file, or pass --skip_bad_rows true to keep what "
                "was read and count the file."
            ) from e
        stats.bad_files += 1
        stats.first_bad = stats.first_bad or f"{display(f.path)} ({type(e).__name__})"


def first_columns(f: DataFile, text_column: str) -> list[str]:
    """The columns of the file's first row (a .txt file has one: the text), for format detection and checks."""
    if f.builder == "text":
        return [text_column]
    if f.builder == "parquet":
        import pyarrow.parquet as pq

        return pq.ParquetFile(f.path).schema_arrow.names
    with open_binary(f) as fh:
        if f.builder == "csv":
            return next(csv.reader(io.TextIOWrapper(fh, encoding="utf-8-sig", errors="replace", newline="")), [])
        head = fh.read(1 << 20).removeprefix(BOM).decode("utf-8", errors="replace").lstrip()
    try:
        row, _ = json.JSONDecoder().raw_decode(head[1:].lstrip() if head.startswith("[") else head)
    except json.JSONDecodeError:
        return []
    return list(row) if isinstance(row, dict) else []

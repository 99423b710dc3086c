"""The raw-text corpus of a run: `--train_file` (a file, a folder or a glob) or the sources of
`--dataset_mixture`, each expanded into its files and cut into units of preparation (`token_units`).

Planning reads only the file system (names, sizes, mtimes) and the first row of each source's first file, so it
is cheap at any corpus size and runs twice: in the up-front checks (bad input refused before any work) and
when the data is prepared. Prompt-completion and chat files, `--dataset_name` and the embedded corpus keep the
`datasets` path (`sources`)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from anygpu.config.args import DataArguments
from anygpu.config.mixture import parse_mixture
from anygpu.data import checks
from anygpu.data import files as files_lib
from anygpu.data.files import DataFile
from anygpu.data.formats import TEXT, detect_format
from anygpu.data.readers import Reading, ReadStats, documents, first_columns
from anygpu.data.token_units import SHARE_SCALE, Unit, to_validation
from anygpu.errors import UsageError

TOKENIZER_SAMPLE_BYTES = 64 << 20  # a tokenizer trained on the spot learns from this much text (weighted by source)
SINGLE = "train"  # the name of the one source of --train_file


@dataclass(frozen=True)
class Source:
    name: str
    weight: float | None  # share of the samples drawn (a mixture's); None: the only source
    files: tuple[DataFile, ...]
    validation_files: tuple[DataFile, ...]  # its own validation text; none: a share of its documents is held out
    reading: Reading
    validation_reading: Reading


@dataclass(frozen=True)
class CorpusPlan:
    sources: tuple[Source, ...]
    mixture: bool
    validation_share: int  # of SHARE_SCALE: the documents held out where a source has no validation files

    def units(self) -> list[Unit]:
        """Every unit of preparation, in stream order: source by source, file by file, part by part."""
        out = []
        for s in self.sources:
            share = 0 if s.validation_files else self.validation_share
            out += [Unit(s.name, f, p, s.reading, share) for f in s.files for p in range(_parts(f, s.reading))]
            out += [
                Unit(s.name, f, p, s.validation_reading, SHARE_SCALE)
                for f in s.validation_files
                for p in range(_parts(f, s.validation_reading))
            ]
        return out

    def fingerprint(self) -> str:
        """The corpus's identity for the resume check and the ranks' agreement: every file's identity, the
        weights, names and reading options."""
        described = [
            [s.name, s.weight, [f.identity() for f in s.files], [f.identity() for f in s.validation_files]]
            + [s.reading.text_column, s.reading.sample_by, s.reading.skip_bad_rows]
            for s in self.sources
        ]
        return hashlib.sha256(json.dumps([described, self.mixture, self.validation_share]).encode()).hexdigest()

    @property
    def num_files(self) -> int:
        return sum(len(s.files) + len(s.validation_files) for s in self.sources)

    @property
    def num_bytes(self) -> int:
        return sum(files_lib.total_bytes([*s.files, *s.validation_files]) for s in self.sources)


def _parts(f: DataFile, reading: Reading) -> int:
    return 1 if f.builder == "text" and reading.sample_by == "document" else f.num_parts


def _source(name, weight, path, validation, column, args: DataArguments, option: str, val_option: str) -> Source:
    reading = Reading(option, column, args.txt_sample_by, args.skip_bad_rows)
    return Source(
        name,
        weight,
        tuple(files_lib.expand(path, option)),
        tuple(files_lib.expand(validation, val_option)) if validation else (),
        reading,
        Reading(val_option, column, args.txt_sample_by, args.skip_bad_rows),
    )


def plan_corpus(args: DataArguments) -> CorpusPlan | None:
    """The corpus of raw-text files or a mixture; None for data the `datasets` path prepares (a hub or saved
    data set, the embedded corpus, prompt-completion or chat files). Refuses bad sources in one line."""
    share = round(args.validation_split_percentage * SHARE_SCALE / 100)
    mixture = parse_mixture(args.dataset_mixture, args.text_column)
    if mixture:
        sources = []
        for spec in mixture:
            option = f"--dataset_mixture source {spec.name!r}"
            src = _source(
                spec.name, spec.weight, spec.path, spec.validation_path, spec.text_column, args, option,
                f"{option} validation_path",
            )  # fmt: skip
            _check_text(src, raw_text_only=True)
            sources.append(src)
        return CorpusPlan(tuple(sources), True, share)
    if not args.train_file or args.dataset_name:
        return None
    src = _source(SINGLE, None, args.train_file, args.validation_file, args.text_column, args, "--train_file",
                  "--validation_file")  # fmt: skip
    if not _check_text(src, raw_text_only=False):
        return None
    return CorpusPlan((src,), False, share)


def _first_readable(src: Source) -> DataFile:
    """The source's first file that passes the cheap checks (empty, binary, not parquet); with --skip_bad_rows
    the bad ones before it are passed over (and counted when prepared)."""
    for f in src.files:
        try:
            if f.compression is None:
                checks.check_file(Path(f.path), f.builder, src.reading.option)
            return f
        except UsageError:
            if not src.reading.skip_bad_rows or f is src.files[-1]:
                raise
    return src.files[0]


def _check_text(src: Source, raw_text_only: bool) -> bool:
    """Whether the source is raw text (its first file's columns); a mixture's source must be, and must have its
    text column."""
    first = _first_readable(src)
    where = f"{src.reading.option} {files_lib.display(first.path)}"
    columns = first_columns(first, src.reading.text_column)
    fmt = detect_format(columns, src.reading.text_column, where) if columns else TEXT
    if fmt != TEXT and raw_text_only:
        raise UsageError(
            f"{where} holds {fmt.replace('_', '-')} rows: a mixture's sources are raw text (--text_column "
            f"{src.reading.text_column!r}, or text_column per source); train on such rows with --train_file."
        )
    for f in src.validation_files[:1]:
        detect_format(first_columns(f, src.reading.text_column), src.reading.text_column, f"{src.reading.option}")
    return fmt == TEXT


def _sample_files(plan: CorpusPlan, budget: int) -> list[tuple[Source, float, list[DataFile]]]:
    """Each source's first files, by size, up to its weight's share of `budget` bytes (what a tokenizer trained on
    the spot reads): (source, its byte budget, its files)."""
    total = sum(s.weight for s in plan.sources) if plan.mixture else 1.0
    chosen = []
    for source in plan.sources:
        share = budget * (source.weight / total if plan.mixture else 1.0)
        picked, left = [], share
        for f in source.files:
            if left <= 0:
                break
            picked.append(f)
            left -= f.size
        chosen.append((source, share, picked))
    return chosen


def _source_texts(source: Source, files: list[DataFile], share: int) -> Iterator[str]:
    for f in files:
        for part in range(_parts(f, source.reading)):
            yield from (t for t in documents(source.reading, f, part, ReadStats()) if not to_validation(t, share))


def sample_texts(plan: CorpusPlan, budget: int = TOKENIZER_SAMPLE_BYTES) -> Iterator[str]:
    """Training text for a tokenizer trained on the spot: each source's first documents, in file order, up to its
    weight's share of `budget` bytes (held-out documents left out), from `_sample_files` alone."""
    for source, left, picked in _sample_files(plan, budget):
        for text in _source_texts(source, picked, 0 if source.validation_files else plan.validation_share):
            if left <= 0:
                break
            left -= len(text)
            yield text


def sample_identity(plan: CorpusPlan, budget: int = TOKENIZER_SAMPLE_BYTES) -> str:
    """A key for the tokenizer trained on `sample_texts`: the identities of the files it reads, so editing a file
    past them retrains nothing (and re-prepares no other unit)."""
    described = [
        [source.name, source.reading.text_column, source.reading.sample_by, [f.identity() for f in picked]]
        for source, _, picked in _sample_files(plan, budget)
    ]
    return hashlib.sha256(json.dumps([described, plan.validation_share, budget]).encode()).hexdigest()

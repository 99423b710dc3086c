"""One unit of preparation: a part of a raw-text file, tokenised into two token streams (its training and its
validation documents, each followed by EOS), written to the cache under a key of its own.

The key covers the file's identity (path, size, mtime), the part, the tokenizer and the reading options: an
edited file is prepared again and every other unit is found done. A unit's `.json` is written last, after its
token files are complete and renamed into place, so its presence means the unit is done: an interrupted
preparation resumes at the units without one. The streams do not depend on the block size: blocks are cut
when the data is read (`token_rows`). A unit may be tokenised in pieces (byte ranges of its part) by several
processes and joined: the same bytes as one process writes.

    <cache>/prepared/<tokenizer>/units/<key>.json             what the unit holds (tokens, documents, skipped rows)
    <cache>/prepared/<tokenizer>/units/<key>.train.bin        token ids (uint16, or uint32 past 65,536 tokens)
    <cache>/prepared/<tokenizer>/units/<key>.validation.bin
    <cache>/prepared/<tokenizer>/corpora/<key of its units>.json   every unit of a corpus, once all are done
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import pickle
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from anygpu.data.files import DataFile
from anygpu.data.readers import Reading, ReadStats, documents
from anygpu.runtime import faults

PREP_VERSION = "1"
SPLITS = ("train", "validation")
SHARE_SCALE = 10_000  # a document goes to validation when a hash of its text, mod this, is below the share
BATCH_DOCUMENTS, BATCH_BYTES = 1000, 4 << 20  # documents tokenised per call
STALE_TEMP_S = 3600  # a temporary file untouched this long was left by a killed preparer
_prepared_here = [0]  # units this process has prepared (the fault injection counts them)


@dataclass(frozen=True)
class Unit:
    source: str  # the source's name
    file: DataFile
    part: int
    reading: Reading
    validation_share: int  # of SHARE_SCALE: 0 none, SHARE_SCALE every document (a validation file)

    @property
    def input_bytes(self) -> int:
        """The file bytes this unit reads (for progress and the disk estimate)."""
        if self.file.num_parts == 1:
            return self.file.size
        start, end = self.file.part_range(self.part)
        return int(max(0, min(end, self.file.size) - start))

    def key(self, tokenizer_id: str) -> str:
        parts = [PREP_VERSION, tokenizer_id, self.file.identity(), self.part, self.validation_share]
        r = self.reading
        parts += [r.text_column, r.sample_by, r.skip_bad_rows]
        return hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:24]


def units_folder(cache_dir: str, tokenizer_id: str) -> Path:
    return Path(cache_dir) / "prepared" / tokenizer_id[:16] / "units"


def token_dtype(tokenizer) -> np.dtype:
    """The smallest unsigned type that holds every token id: half the disk of int32 for vocabularies ≤ 65,536."""
    return np.dtype(np.uint16) if len(tokenizer) <= 1 << 16 else np.dtype(np.uint32)


PROBES = ["plain words", " a leading space", "Ünïcödé ñ 中文 🙂", "tabs\tand\nnew lines\n\n", "<|endoftext|> in text"]


class Encoder:
    """Token ids of texts without special tokens, as `tokenizer(texts, add_special_tokens=False)` gives them: its
    `tokenizers` backend alone where it gives the same ids on `sample` (faster, and a worker process then loads
    no transformers), else the tokenizer itself. Picklable: what worker processes receive."""

    def __init__(self, tokenizer, sample: list[str]) -> None:
        self.eos, self.dtype = tokenizer.eos_token_id, token_dtype(tokenizer)
        self.backend, self.tokenizer = None, tokenizer
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is not None:
            from tokenizers import Tokenizer

            own = Tokenizer.from_str(backend.to_str())
            own.no_truncation()
            own.no_padding()
            texts = [*PROBES, *sample]
            if self._backend_ids(own, texts) == tokenizer(texts, add_special_tokens=False)["input_ids"]:
                self.backend, self.tokenizer = own, None

    @staticmethod
    def _backend_ids(backend, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in backend.encode_batch(texts, add_special_tokens=False)]

    def __call__(self, texts: list[str]) -> list[list[int]]:
        if self.backend is not None:
            return self._backend_ids(self.backend, texts)
        return self.tokenizer(texts, add_special_tokens=False, return_attention_mask=False)["input_ids"]


def is_done(folder: Path, key: str) -> bool:
    return (folder / f"{key}.json").exists()


def read_meta(folder: Path, key: str) -> dict[str, Any]:
    return json.loads((folder / f"{key}.json").read_text())


def _index_path(folder: Path, keys: list[str]) -> Path:
    digest = hashlib.sha256("\n".join(keys).encode()).hexdigest()[:24]
    return folder.parent / "corpora" / f"{digest}.json"


def write_index(folder: Path, keys: list[str], metas: list[dict[str, Any]]) -> None:
    """Every unit of a corpus done, in one file: a start after preparation reads it instead of one file per part."""
    path = _index_path(folder, keys)
    path.parent.mkdir(parents=True, exist_ok=True)
    _write_json(path, {"keys": keys, "metas": metas})


def read_index(folder: Path, keys: list[str]) -> list[dict[str, Any]] | None:
    """The metas of units `keys` from their corpus's index, when it was written (all of them done), else None."""
    path = _index_path(folder, keys)
    if not path.exists():
        return None
    data = json.loads(path.read_text())
    return data["metas"] if data.get("keys") == keys else None


def to_validation(text: str, share: int) -> bool:
    """Whether a document is held out: a hash of its text (not its place), so a duplicate goes the same way."""
    if share <= 0 or share >= SHARE_SCALE:
        return share >= SHARE_SCALE
    digest = hashlib.blake2b(text.encode("utf-8", errors="replace"), digest_size=8).digest()
    return int.from_bytes(digest, "little") % SHARE_SCALE < share


def _batches(unit: Unit, stats: ReadStats):
    """The unit's documents in batches of about BATCH_DOCUMENTS or BATCH_BYTES."""
    batch, size = [], 0
    for text in documents(unit.reading, unit.file, unit.part, stats):
        batch.append(text)
        size += len(text)
        if len(batch) >= BATCH_DOCUMENTS or size >= BATCH_BYTES:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def _write_streams(unit: Unit, encoder: Encoder, outs: dict, stats: ReadStats) -> dict[str, int]:
    """Tokenise the unit's documents into the open files `outs` (split → file); the tokens written per split."""
    eos, dtype, counts = encoder.eos, encoder.dtype, dict.fromkeys(SPLITS, 0)
    for batch in _batches(unit, stats):
        ids = encoder(batch)
        held = [to_validation(t, unit.validation_share) for t in batch]
        for split, want in zip(SPLITS, (False, True)):
            chosen = [x for x, h in zip(ids, held) if h == want]
            if chosen:
                flat = np.fromiter(itertools.chain.from_iterable((*x, eos) for x in chosen), dtype=dtype)
                outs[split].write(flat.tobytes())
                counts[split] += len(flat)
    return counts


def pieces(unit: Unit, piece_bytes: int) -> list[Unit]:
    """The unit cut into pieces of at most `piece_bytes` that processes tokenise apart: byte ranges of its part, in
    order, each holding the documents that start in it (as a part does), so the pieces' streams one after the other
    are the unit's. The unit alone where it is not cut: a compressed, .csv, .json or parquet file (row groups, not
    bytes), a whole-document .txt, a part not larger than `piece_bytes`."""
    f = unit.file
    if not f.splittable or f.builder == "parquet" or unit.reading.sample_by == "document":
        return [unit]
    # the pieces tile the part exactly: their count divides its bytes (256 MiB: a power of two), pieces ≤ piece_bytes
    count = next(d for d in range(max(1, f.part_bytes // piece_bytes), f.part_bytes + 1) if f.part_bytes % d == 0)
    cut = replace(f, part_bytes=f.part_bytes // count)
    first = unit.part * count
    end = min(first + count, -(-f.size // cut.part_bytes))  # the file's last part may end before its range does
    found = [Unit(unit.source, cut, j, unit.reading, unit.validation_share) for j in range(first, end)]
    return found if len(found) > 1 else [unit]


Tokenised = tuple[dict[str, str], dict[str, int], ReadStats, float]  # temporary files, tokens per split, stats, seconds


def _tokenise(unit: Unit, encoder: Encoder, folder: Path, key: str) -> Tokenised:
    """The streams of unit (or piece) `unit` of unit `key`, in temporary files of `folder`."""
    start, stats = time.perf_counter(), ReadStats()
    folder.mkdir(parents=True, exist_ok=True)
    temps = {split: _temporary(folder, key, split) for split in SPLITS}
    try:
        with open(temps["train"], "wb") as train, open(temps["validation"], "wb") as validation:
            counts = _write_streams(unit, encoder, {"train": train, "validation": validation}, stats)
    except BaseException:
        _remove(temps.values())
        raise
    return temps, counts, stats, time.perf_counter() - start


def _publish(unit: Unit, dtype: np.dtype, folder: Path, key: str, done: Tokenised) -> dict[str, Any]:
    """Unit `key`'s token files renamed into place, its .json written last."""
    temps, counts, stats, seconds = done
    _prepared_here[0] += 1
    faults.at("prepare_unit", _prepared_here[0])
    for split in SPLITS:
        os.replace(temps[split], folder / f"{key}.{split}.bin")
    meta = {
        "version": PREP_VERSION,
        "source": unit.source,
        "file": unit.file.path,
        "part": unit.part,
        "input_bytes": unit.input_bytes,
        "dtype": dtype.name,
        "tokens": counts,
        **asdict(stats),
        "seconds": round(seconds, 3),
    }
    _write_json(folder / f"{key}.json", meta)
    return meta


def prepare_unit(unit: Unit, encoder: Encoder, folder: Path, key: str) -> dict[str, Any]:
    """Tokenise one unit into `folder` (atomically: its files are renamed into place, its .json last)."""
    done = _tokenise(unit, encoder, folder, key)
    try:
        return _publish(unit, encoder.dtype, folder, key, done)
    finally:
        _remove(done[0].values())


def join_pieces(unit: Unit, dtype: np.dtype, folder: Path, key: str, parts: list[Tokenised]) -> dict[str, Any]:
    """Unit `key` from its pieces (`work_piece`'s results, in order): their files concatenated, their counts and stats
    added (the first bad row is the first piece's that has one), then published as `prepare_unit` does."""
    temps, stats = {split: _temporary(folder, key, split) for split in SPLITS}, ReadStats()
    try:
        for split in SPLITS:
            with open(temps[split], "wb") as out:
                for piece_temps, *_ in parts:
                    with open(piece_temps[split], "rb") as piece:
                        shutil.copyfileobj(piece, out, 16 << 20)
        for _, _, piece_stats, _ in parts:
            stats.add(piece_stats)
        counts = {split: sum(p[1][split] for p in parts) for split in SPLITS}
        return _publish(unit, dtype, folder, key, (temps, counts, stats, sum(p[3] for p in parts)))
    finally:
        _remove(temps.values())
        remove_pieces(parts)


def remove_pieces(parts: list[Tokenised]) -> None:
    """The temporary files of pieces (once joined, or when their unit will not be)."""
    _remove(path for p in parts for path in p[0].values())


def _temporary(folder: Path, key: str, split: str) -> str:
    fd, path = tempfile.mkstemp(dir=folder, prefix=f".{key}.{split}.", suffix=".tmp")
    os.close(fd)  # opened again by name: a worker prepares thousands of pieces
    return path


def _remove(paths) -> None:
    for path in paths:
        if os.path.exists(path):
            os.unlink(path)


def _write_json(path: Path, data: dict) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump(data, f)
    os.replace(tmp, path)


def remove_stale_temps(folder: Path, older_than_s: float = STALE_TEMP_S) -> int:
    """Temporary files a killed preparer left (untouched for an hour: a live one writes all the time)."""
    removed, now = 0, time.time()
    for path in folder.glob(".*.tmp") if folder.is_dir() else []:
        try:
            if now - path.stat().st_mtime > older_than_s:
                path.unlink()
                removed += 1
        except FileNotFoundError:
            pass
    return removed


_WORKER_ENCODER: list[Encoder] = []


def write_encoder(encoder: Encoder, folder: Path) -> str:
    """The encoder pickled into a temporary file of `folder`, for the worker processes (`init_worker`)."""
    folder.mkdir(parents=True, exist_ok=True)
    path = _temporary(folder, "encoder", "pickle")
    with open(path, "wb") as f:
        pickle.dump(encoder, f)
    return path


def init_worker(encoder_file: str) -> None:
    """A worker process of a rank's preparation (spawned: this module imports no torch nor transformers). The encoder
    comes in a file: in the spawn's pipe (its vocabulary fills it), the rank would wait for each process to start and
    read it before starting the next."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # one core per process
    with open(encoder_file, "rb") as f:
        _WORKER_ENCODER[:] = [pickle.load(f)]


def work(unit: Unit, folder: Path, key: str) -> dict[str, Any]:
    return prepare_unit(unit, _WORKER_ENCODER[0], folder, key)


def work_piece(piece: Unit, folder: Path, key: str) -> Tokenised:
    """A piece of unit `key`, tokenised into temporary files that this rank's process joins (`join_pieces`)."""
    return _tokenise(piece, _WORKER_ENCODER[0], folder, key)

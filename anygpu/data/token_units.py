"""One unit of preparation: a part of a raw-text file, tokenised into two token streams (its training and its
validation documents, each followed by EOS), written to the cache under a key of its own.

The key covers the file's identity (path, size, mtime), the part, the tokenizer and the reading options: an
edited file is prepared again and every other unit is found done. A unit's `.json` is written last, after its
token files are complete and renamed into place, so its presence means the unit is done: an interrupted
preparation resumes at the units without one. The streams do not depend on the block size: blocks are cut
when the data is read (`token_rows`).

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
import tempfile
import time
from dataclasses import asdict, dataclass
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


def prepare_unit(unit: Unit, encoder: Encoder, folder: Path, key: str) -> dict[str, Any]:
    """Tokenise one unit into `folder` (atomically: its files are renamed into place, its .json last)."""
    start, stats = time.perf_counter(), ReadStats()
    folder.mkdir(parents=True, exist_ok=True)
    temps = {split: tempfile.mkstemp(dir=folder, prefix=f".{key}.{split}.", suffix=".tmp")[1] for split in SPLITS}
    try:
        with open(temps["train"], "wb") as train, open(temps["validation"], "wb") as validation:
            counts = _write_streams(unit, encoder, {"train": train, "validation": validation}, stats)
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
            "dtype": encoder.dtype.name,
            "tokens": counts,
            **asdict(stats),
            "seconds": round(time.perf_counter() - start, 3),
        }
        _write_json(folder / f"{key}.json", meta)
        return meta
    finally:
        for path in temps.values():
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


def init_worker(encoder: Encoder) -> None:
    """A worker process of a rank's preparation (spawned: this module imports no torch nor transformers)."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # one core per process
    _WORKER_ENCODER[:] = [encoder]


def work(unit: Unit, folder: Path, key: str) -> dict[str, Any]:
    return prepare_unit(unit, _WORKER_ENCODER[0], folder, key)

"""Tokenised text → packed blocks of `block_size` tokens, cached on disk per corpus × tokenizer × block size,
and the batches read from them."""

from __future__ import annotations

import hashlib
import itertools
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow.compute as pc
from datasets import Dataset, DatasetDict, Features, Sequence, Value, load_from_disk

from anygpu.data.tokenizer import tokenizer_key
from anygpu.errors import UsageError

logger = logging.getLogger(__name__)

PACKING_VERSION = "2"  # 2: blocks per chunk of text bytes (1: per 2000 texts), made in parallel, stored as int32
# Text joined and cut into blocks together: about 2048 blocks' worth of bytes (~4 bytes a token), so the
# partial block dropped at the end of each chunk costs ~0.1% of the tokens, whatever the block size.
BYTES_PER_BLOCK_IN_CHUNK = 2048
MAX_CHUNK_BYTES = 32 << 20  # bounds a worker's memory at long block sizes (> 16k tokens: fewer blocks per chunk)
BLOCK_FEATURES = Features({"input_ids": Sequence(Value("int32"))})


def pack(
    raw: DatasetDict,
    tokenizer,
    block_size: int,
    text_column: str,
    corpus_fingerprint: str,
    cache_dir: str,
    num_proc: int | None = None,
) -> DatasetDict:
    """Tokenise every text, join them with EOS, cut into blocks of `block_size` (cached on disk)."""
    key = hashlib.sha256(
        f"{PACKING_VERSION}|{corpus_fingerprint}|{tokenizer_key(tokenizer)}|{block_size}|{text_column}".encode()
    ).hexdigest()[:20]
    path = Path(cache_dir) / "packed" / key
    if (path / "dataset_dict.json").exists():
        logger.info("packed data from cache %s", path)
        return load_from_disk(str(path))
    packed = DatasetDict()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{key}."))
    try:
        for split, ds in raw.items():
            start = time.perf_counter()
            packed[split], procs = _pack_split(
                ds,
                tokenizer,
                block_size,
                text_column,
                num_proc,
                tmp / f"map-{split}.arrow",
                f"tokenise and pack {split} into {block_size}-token blocks",
            )
            if len(packed[split]) == 0:  # (an empty split would also break save_to_disk/load_from_disk)
                raise no_full_block(split, block_size)
            mb, seconds = ds.data.nbytes / 1e6, time.perf_counter() - start
            logger.info(
                "%s: %.1f MB of text tokenised and packed in %.1f s (%.1f MB/s, %d processes)",
                split,
                mb,
                seconds,
                mb / max(seconds, 1e-9),
                procs,
            )
        packed.save_to_disk(str(tmp / "dataset"))
        try:
            os.replace(tmp / "dataset", path)
        except OSError:  # another process of this node published the same key first
            pass
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return load_from_disk(str(path))


def no_full_block(split: str, block_size: int) -> UsageError:
    return UsageError(
        f"the {split} split has no full {block_size}-token block: lower --block_size or give more {split} text."
    )


def chunk_bounds(ds: Dataset, text_column: str, chunk_bytes: int) -> tuple[list[int], list[int]]:
    """Row ranges [start, end) of about `chunk_bytes` of non-empty text each: text i joins chunk
    floor(bytes before it / chunk_bytes), so the chunks follow from the corpus alone."""
    lengths = [
        pc.fill_null(pc.binary_length(t[text_column]), 0).to_numpy(zero_copy_only=False)
        for t in ds.with_format("arrow").iter(batch_size=100_000)
    ]
    sizes = np.concatenate(lengths) if lengths else np.zeros(0, dtype=np.int64)
    rows = np.flatnonzero(sizes > 0)
    if len(rows) == 0:
        return [], []
    chunk = (np.cumsum(sizes[rows]) - sizes[rows]) // chunk_bytes
    first = np.flatnonzero(np.diff(chunk, prepend=-1))
    last = np.append(first[1:] - 1, len(rows) - 1)
    return rows[first].tolist(), (rows[last] + 1).tolist()


def _pack_split(
    ds: Dataset, tokenizer, block_size: int, text_column: str, num_proc: int | None, cache_file: Path, desc: str
) -> tuple[Dataset, int]:
    """One split, tokenised and packed chunk by chunk, chunks spread over `num_proc` processes.

    A block never spans two chunks (as HF's run_clm groups per map batch), and the chunks are fixed by the
    corpus and the block size alone, so the blocks do not depend on the number of processes. Each process streams its blocks
    to an Arrow file: the corpus is never held in memory.
    """
    eos = tokenizer.eos_token_id
    starts, ends = chunk_bounds(ds, text_column, min(BYTES_PER_BLOCK_IN_CHUNK * block_size, MAX_CHUNK_BYTES))
    chunks = Dataset.from_dict({"start": starts, "end": ends})

    def tokenize_and_pack(batch: dict) -> dict:
        blocks = []
        for first, last in zip(batch["start"], batch["end"]):
            texts = [t for t in ds[first:last][text_column] if t]
            ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
            # int32 numpy: ~9x less memory than Python ints for a chunk's tokens, and a faster Arrow write
            flat = np.fromiter(itertools.chain.from_iterable((*x, eos) for x in ids), dtype=np.int32)
            n = len(flat) // block_size
            blocks.append(flat[: n * block_size].reshape(n, block_size))
        return {"input_ids": np.concatenate(blocks) if blocks else np.zeros((0, block_size), dtype=np.int32)}

    procs = max(1, min(num_proc or 1, len(chunks)))
    out = chunks.map(
        tokenize_and_pack,
        batched=True,
        batch_size=1,
        remove_columns=["start", "end"],
        num_proc=procs if procs > 1 else None,
        features=BLOCK_FEATURES,
        cache_file_name=str(cache_file),
        desc=desc,
    )
    return out, procs

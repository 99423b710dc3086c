"""Tokenised text → packed blocks of `block_size` tokens, cached on disk per corpus × tokenizer × block size,
and the batches read from them."""
from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

from datasets import DatasetDict, load_from_disk

from anygpu.errors import UsageError

logger = logging.getLogger(__name__)

PACKING_VERSION = "1"


def _tokenizer_key(tokenizer) -> str:
    return hashlib.sha256(tokenizer.backend_tokenizer.to_str().encode()).hexdigest() if hasattr(tokenizer, "backend_tokenizer") else tokenizer.name_or_path


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
        f"{PACKING_VERSION}|{corpus_fingerprint}|{_tokenizer_key(tokenizer)}|{block_size}|{text_column}".encode()
    ).hexdigest()[:20]
    path = Path(cache_dir) / "packed" / key
    if (path / "dataset_dict.json").exists():
        logger.info("packed data from cache %s", path)
        return load_from_disk(str(path))
    eos = tokenizer.eos_token_id

    def tokenize(batch: dict) -> dict:
        ids = tokenizer([t for t in batch[text_column] if t], add_special_tokens=False)["input_ids"]
        return {"input_ids": [x + [eos] for x in ids]}

    def group(batch: dict) -> dict:
        flat = [t for ids in batch["input_ids"] for t in ids]
        n = len(flat) // block_size * block_size
        return {"input_ids": [flat[i : i + block_size] for i in range(0, n, block_size)]}

    packed = DatasetDict()
    for split, ds in raw.items():
        start, procs = time.perf_counter(), num_proc if num_proc and num_proc > 1 and len(ds) >= num_proc else None
        tok = ds.map(tokenize, batched=True, remove_columns=ds.column_names, num_proc=procs, desc=f"tokenise {split}")
        # Packing runs in one process: the blocks must not depend on how the texts were split among workers.
        packed[split] = tok.map(group, batched=True, batch_size=2000, desc=f"pack {split} into {block_size}-token blocks")
        if len(packed[split]) == 0:  # (an empty split would also break save_to_disk/load_from_disk)
            raise UsageError(f"the {split} split has no full {block_size}-token block: lower --block_size or give more "
                             f"{split} text.")
        mb, seconds = ds.data.nbytes / 1e6, time.perf_counter() - start
        logger.info("%s: %.1f MB of text tokenised and packed in %.1f s (%.1f MB/s, %d processes)",
                    split, mb, seconds, mb / max(seconds, 1e-9), procs or 1)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{key}."))
    packed.save_to_disk(str(tmp))
    try:
        os.replace(tmp, path)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
    return load_from_disk(str(path))


"""Training text → tokenised, packed blocks → one seeded global order.

Sources: a datasets hub id or saved folder, local txt/json/jsonl/csv/parquet files, or
(with no data arguments) the .py files of this Python's standard library. Tokenising
and packing run once per corpus × tokenizer × block size and are cached on disk.
"""
from __future__ import annotations

import hashlib
import logging
import os
import shutil
import sysconfig
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch
from datasets import Dataset, DatasetDict, load_dataset, load_from_disk

from anygpu.args import DataArguments
from anygpu.batch import BatchPlan

logger = logging.getLogger(__name__)

PACKING_VERSION = "1"
FILE_BUILDERS = {".txt": "text", ".text": "text", ".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}
STDLIB_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}


# ---------------------------------------------------------------- raw text
def stdlib_files() -> list[Path]:
    """The standard library's own .py files (test suites left out), in a fixed order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in STDLIB_SKIP_DIRS)
        found += [Path(dirpath) / f for f in sorted(filenames) if f.endswith(".py")]
    return found


def stdlib_corpus(validation_percentage: float, max_mb: float | None = None) -> DatasetDict:
    """The embedded default corpus, split by a hash of each file's path (the same on every machine)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    train, val, budget = [], [], (max_mb * 1e6 if max_mb else float("inf"))
    for path in stdlib_files():
        text = path.read_text(encoding="utf-8", errors="replace")
        budget -= len(text)
        if budget < 0:
            break
        rel = path.relative_to(root).as_posix()
        bucket = int(hashlib.sha1(rel.encode()).hexdigest(), 16) % 10000
        (val if bucket < validation_percentage * 100 else train).append(text)
    if not val:  # a tiny --max_corpus_mb can leave the hash split empty
        val.append(train.pop())
    return DatasetDict(train=Dataset.from_dict({"text": train}), validation=Dataset.from_dict({"text": val}))


def _load_files(path_or_glob: str, text_column: str) -> Dataset:
    suffix = Path(path_or_glob).suffix.lower()
    builder = FILE_BUILDERS.get(suffix)
    if builder is None:
        raise ValueError(f"file {path_or_glob}: unknown format {suffix!r}; use one of {', '.join(sorted(FILE_BUILDERS))}.")
    kwargs = {"sample_by": "paragraph"} if builder == "text" else {}
    ds = load_dataset(builder, data_files=path_or_glob, split="train", **kwargs)
    return ds.rename_column("text", text_column) if builder == "text" and text_column != "text" else ds


def load_raw_text(args: DataArguments, seed: int = 0) -> tuple[DatasetDict, bool]:
    """{'train','validation'} of raw texts, and whether it is the embedded default corpus."""
    if args.dataset_name:
        if Path(args.dataset_name).is_dir() and (Path(args.dataset_name) / "dataset_dict.json").exists():
            raw = load_from_disk(args.dataset_name)
        elif Path(args.dataset_name).is_dir() and (Path(args.dataset_name) / "dataset_info.json").exists():
            raw = DatasetDict(train=load_from_disk(args.dataset_name))
        else:
            raw = load_dataset(args.dataset_name, args.dataset_config_name)
        if not isinstance(raw, DatasetDict):
            raw = DatasetDict(train=raw)
        if "train" not in raw:
            raise ValueError(f"--dataset_name {args.dataset_name} has no 'train' split (splits: {list(raw)}).")
        if "validation" not in raw and "test" in raw:
            raw["validation"] = raw["test"]
    elif args.train_file:
        raw = DatasetDict(train=_load_files(args.train_file, args.text_column))
        if args.validation_file:
            raw["validation"] = _load_files(args.validation_file, args.text_column)
    else:
        return stdlib_corpus(args.validation_split_percentage, args.max_corpus_mb), True
    source = args.dataset_name or args.train_file
    for split, ds in raw.items():
        if args.text_column not in ds.column_names:
            raise ValueError(
                f"--text_column {args.text_column!r} is not a column of {source} ({split}): "
                f"its columns are {ds.column_names}."
            )
    raw = DatasetDict({k: raw[k] for k in ("train", "validation") if k in raw})
    if "validation" not in raw:
        # A fixed seed: the split must not move when --seed changes.
        parts = raw["train"].train_test_split(test_size=args.validation_split_percentage / 100, seed=0)
        raw = DatasetDict(train=parts["train"], validation=parts["test"])
    return raw, False


def fingerprint(raw: DatasetDict, text_column: str) -> str:
    """A content key for the corpus, for the tokenizer and packing caches."""
    h = hashlib.sha256()
    for split in ("train", "validation"):
        ds = raw[split]
        fp = getattr(ds, "_fingerprint", None)
        if ds.cache_files and fp:  # file-backed: datasets' own fingerprint covers the files
            h.update(f"{split}:{fp}".encode())
        else:
            for text in ds[text_column]:
                h.update(text.encode("utf-8", errors="replace"))
                h.update(b"\0")
    return h.hexdigest()


def iter_texts(ds: Dataset, text_column: str, batch: int = 1000) -> Iterator[list[str]]:
    for i in range(0, len(ds), batch):
        yield [t for t in ds[i : i + batch][text_column] if t]


# ---------------------------------------------------------------- packing
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
        tok = ds.map(tokenize, batched=True, remove_columns=ds.column_names, num_proc=num_proc, desc=f"tokenise {split}")
        packed[split] = tok.map(group, batched=True, batch_size=2000, num_proc=num_proc, desc=f"pack {split} into {block_size}-token blocks")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{key}."))
    packed.save_to_disk(str(tmp))
    try:
        os.replace(tmp, path)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
    return load_from_disk(str(path))


def collate(samples: list[dict]) -> dict[str, torch.Tensor]:
    ids = torch.tensor([s["input_ids"] for s in samples], dtype=torch.long)
    return {"input_ids": ids, "labels": ids.clone()}


def read_batch(dataset: Dataset, indices: list[int]) -> dict[str, torch.Tensor]:
    """Rows `indices` as a batch, in one Arrow read (row-by-row reads cost ~0.1 ms each)."""
    ids = torch.tensor(dataset[indices]["input_ids"], dtype=torch.long)
    return {"input_ids": ids, "labels": ids.clone()}


# ---------------------------------------------------------------- order
@dataclass(frozen=True)
class GlobalOrder:
    """One seeded permutation of the packed samples per epoch; global batch k is
    samples [kG, (k+1)G) of it, whatever the world size (a final partial batch is dropped)."""

    num_samples: int
    global_batch_size: int
    seed: int

    def __post_init__(self) -> None:
        if self.steps_per_epoch < 1:
            raise ValueError(
                f"the training set has {self.num_samples} packed samples, fewer than --global_batch_size "
                f"{self.global_batch_size}: lower --global_batch_size (≤ {self.num_samples}) or --block_size, or add data."
            )

    @property
    def steps_per_epoch(self) -> int:
        return self.num_samples // self.global_batch_size

    def permutation(self, epoch: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(self.num_samples, generator=g)

    def global_batch(self, step: int) -> list[int]:
        """Sample indices of optimizer step `step` (0-based, counted over all epochs)."""
        epoch, k = divmod(step, self.steps_per_epoch)
        G = self.global_batch_size
        return self.permutation(epoch)[k * G : (k + 1) * G].tolist()

    def micro_batches(self, step: int, plan: BatchPlan, rank: int) -> list[list[int]]:
        """Rank `rank`'s share of global batch `step`, cut into its accumulation micro-batches."""
        share = self.global_batch(step)[rank * plan.sequences_per_rank : (rank + 1) * plan.sequences_per_rank]
        m = plan.per_device_train_batch_size
        return [share[j * m : (j + 1) * m] for j in range(plan.gradient_accumulation_steps)]


class MicroBatchSampler(torch.utils.data.Sampler):
    """Yields this rank's micro-batches (lists of indices) for steps [start_step, end_step)."""

    def __init__(self, order: GlobalOrder, plan: BatchPlan, rank: int, start_step: int, end_step: int) -> None:
        self.order, self.plan, self.rank = order, plan, rank
        self.start_step, self.end_step = start_step, end_step

    def __iter__(self) -> Iterator[list[int]]:
        for step in range(self.start_step, self.end_step):
            yield from self.order.micro_batches(step, self.plan, self.rank)

    def __len__(self) -> int:
        return (self.end_step - self.start_step) * self.plan.gradient_accumulation_steps


def eval_shards(num_samples: int, world_size: int, rank: int, batch_size: int) -> list[list[int]]:
    """This rank's evaluation batches; every rank gets the same number (collectives), short ranks get []."""
    per_rank = -(-num_samples // world_size)
    mine = list(range(rank * per_rank, min(num_samples, (rank + 1) * per_rank)))
    num_batches = -(-per_rank // batch_size)
    return [mine[i * batch_size : (i + 1) * batch_size] for i in range(num_batches)]

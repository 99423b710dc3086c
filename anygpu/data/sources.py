"""Raw training text: a datasets hub id or saved folder, local txt/json/jsonl/csv/parquet files, or
(with no data arguments) the .py files of this Python's standard library."""

from __future__ import annotations

import glob
import hashlib
import os
import re
import sysconfig
from pathlib import Path
from typing import Callable, Iterable

from datasets import Dataset, DatasetDict, load_dataset, load_from_disk

from anygpu.config.args import DataArguments
from anygpu.data import checks, files
from anygpu.data.formats import TEXT, detect_format, row_key
from anygpu.errors import UsageError

STDLIB_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}


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
        if budget < 0 and len(train) + len(val) >= 2:  # at least a training and a validation file, however small
            break
        rel = path.relative_to(root).as_posix()
        bucket = int(hashlib.sha1(rel.encode()).hexdigest(), 16) % 10000
        (val if bucket < validation_percentage * 100 else train).append(text)
    if not val:  # a tiny --max_corpus_mb can leave the hash split empty
        val.append(train.pop())
    if not train:
        train.append(val.pop())
    return DatasetDict(train=Dataset.from_dict({"text": train}), validation=Dataset.from_dict({"text": val}))


def txt_sample_by(path_or_glob: str, choice: str) -> str:
    """What one document of a .txt file is; `auto`: paragraphs when the (first) file has a blank line, else lines."""
    if choice != "auto":
        return choice
    first = sorted(glob.glob(path_or_glob)) or [path_or_glob]
    with open(first[0], encoding="utf-8", errors="replace") as f:
        head = f.read(16 << 20)
    return "paragraph" if re.search(r"\n[ \t\r]*\n", head.strip()) else "line"


def _load_files(path_or_glob: str, text_column: str, option: str = "--train_file", sample_by: str = "auto") -> Dataset:
    """The rows of a file, a folder's files or a glob's (one format) through `datasets`: prompt-completion and
    chat files, and raw text in tests of this path (the engines prepare raw text with `corpus`)."""
    found = files.expand(path_or_glob, option)
    builders = sorted({f.builder for f in found})
    if len(builders) > 1:
        raise UsageError(
            f"{option} {path_or_glob} mixes formats ({', '.join(builders)}): give files of one format (one of "
            "them with --train_file, or raw text from several as a --dataset_mixture)."
        )
    builder, paths = builders[0], [f.path for f in found]
    kwargs = {"sample_by": txt_sample_by(paths[0], sample_by)} if builder == "text" else {}
    ds = checks.load_checked(
        paths, builder, option, lambda: load_dataset(builder, data_files=paths, split="train", **kwargs), path_or_glob
    )
    return ds.rename_column("text", text_column) if builder == "text" and text_column != "text" else ds


def load_given(args: DataArguments) -> DatasetDict:
    """The rows --dataset_name (a hub id or a saved folder; its 'test' split stands in for a missing 'validation')
    or --train_file / --validation_file name, as read: no format check, and a 'train' split not yet required (each
    caller refuses its absence in its own words). Both objectives' data paths read their sources here."""
    name = args.dataset_name
    if name:
        if Path(name).is_dir() and (Path(name) / "dataset_dict.json").exists():
            raw = load_from_disk(name)
        elif Path(name).is_dir() and (Path(name) / "dataset_info.json").exists():
            raw = DatasetDict(train=load_from_disk(name))
        else:
            raw = _load_dataset(name, args.dataset_config_name)
        raw = raw if isinstance(raw, DatasetDict) else DatasetDict(train=raw)
        if "validation" not in raw and "test" in raw:
            raw["validation"] = raw["test"]
        return raw
    raw = DatasetDict(train=_load_files(args.train_file, args.text_column, "--train_file", args.txt_sample_by))
    if args.validation_file:
        raw["validation"] = _load_files(args.validation_file, args.text_column, "--validation_file", args.txt_sample_by)
    return raw


def _load_dataset(name: str, config: str | None):
    """`load_dataset`, its refusals of the name or the config said in one line (datasets' own words, first line)."""
    from datasets.data_files import EmptyDatasetError
    from datasets.exceptions import DataFilesNotFoundError, DatasetNotFoundError

    try:
        return load_dataset(name, config)
    except ValueError as e:  # "Config name is missing" / "BuilderConfig 'de' not found. Available: [...]"
        if "onfig" not in str(e):
            raise
        said = " ".join(str(e).split())[:300]
        raise UsageError(
            f"--dataset_config_name {config} with --dataset_name {name}: {said} (--dataset_config_name)."
        ) from None
    except (FileNotFoundError, EmptyDatasetError, DataFilesNotFoundError, DatasetNotFoundError) as e:
        raise UsageError(
            f"--dataset_name {name}: no data set there ({type(e).__name__}: {str(e).splitlines()[0][:120]}). Give a "
            "folder written by Dataset.save_to_disk, a folder of data files (data/train-*.parquet), a cached hub id, "
            "or a file with --train_file."
        ) from None


def load_raw_text(args: DataArguments, seed: int = 0) -> tuple[DatasetDict, bool]:
    """{'train','validation'} of raw data (only 'train' when there are too few documents to split: the
    validation rows are then carved after tokenising), and whether it is the embedded default corpus."""
    if not args.dataset_name and not args.train_file:
        return stdlib_corpus(args.validation_split_percentage, args.max_corpus_mb), True
    raw = load_given(args)
    if "train" not in raw:
        raise UsageError(f"--dataset_name {args.dataset_name} has no 'train' split (splits: {list(raw)}).")
    source = args.dataset_name or args.train_file
    formats = {
        split: detect_format(ds.column_names, args.text_column, f"{source} ({split})") for split, ds in raw.items()
    }
    if len(set(formats.values())) > 1:
        raise UsageError(f"{source}: the splits hold different formats ({formats}): give the same columns in each.")
    for split, ds in raw.items():
        if formats[split] == TEXT:
            checks.check_text_column(ds, args.text_column, source, split)
    raw = DatasetDict({k: raw[k] for k in ("train", "validation") if k in raw})
    if "validation" not in raw and len(raw["train"]) * args.validation_split_percentage / 100 >= 1:
        # A fixed seed: the split must not move when --seed changes.
        parts = raw["train"].train_test_split(test_size=args.validation_split_percentage / 100, seed=0)
        raw = DatasetDict(train=parts["train"], validation=parts["test"])
    # Too few documents for a share of them to be the validation set: prepare() carves it from the rows.
    return raw, False


def data_format(raw: DatasetDict, text_column: str) -> str:
    return detect_format(raw["train"].column_names, text_column, "the training data")


def fingerprint(raw: DatasetDict, text_column: str) -> str:
    """A content key for the corpus, for the tokenizer and packing caches."""
    fmt = data_format(raw, text_column)
    if fmt == TEXT:
        return content_key(raw, lambda ds: (text.encode("utf-8", errors="replace") for text in ds[text_column]))
    return content_key(raw, lambda ds: row_key(ds, fmt, text_column))


def content_key(raw: DatasetDict, rows: Callable[[Dataset], Iterable[bytes]]) -> str:
    """A content key of the train and validation splits: datasets' own fingerprint for a file-backed split (it
    covers the files), else the hash of each row's bytes as `rows` gives them."""
    h = hashlib.sha256()
    for split in ("train", "validation"):
        if split not in raw:
            h.update(f"{split}:none".encode())
            continue
        ds = raw[split]
        fp = getattr(ds, "_fingerprint", None)
        if ds.cache_files and fp:
            h.update(f"{split}:{fp}".encode())
            continue
        for row in rows(ds):
            h.update(row)
            h.update(b"\0")
    return h.hexdigest()

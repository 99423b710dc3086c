"""Prompt-completion and chat data → training rows (packed or one sample each), cached on disk per corpus ×
tokenizer × chat template × options, with the counts the banner reports."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

from datasets import Dataset, DatasetDict, load_from_disk

from anygpu.config.args import DataArguments
from anygpu.data import chat_template
from anygpu.data.collate import Collator, pack_samples
from anygpu.data.formats import MESSAGES, PROMPT_COMPLETION, TEXT, EncodeOptions, EncodeStats, encode
from anygpu.data.packing import pack
from anygpu.data.tokenizer import tokenizer_key
from anygpu.errors import UsageError

logger = logging.getLogger(__name__)

# 2: packed rows break ties as TRL's bfd does (oldest row first); 3: prompt + completion as TRL tokenises it
SAMPLES_VERSION = "3"
STATS_FILE = "anygpu_stats.json"


def build_rows(
    raw: DatasetDict,
    tokenizer,
    opts: EncodeOptions,
    packed: bool,
    corpus_fingerprint: str,
    cache_dir: str,
    num_proc: int | None = None,
    names: dict[str, str] | None = None,
) -> tuple[DatasetDict, dict[str, EncodeStats]]:
    """Rows of every split (columns input_ids, labels, and position_ids when packed) and per-split counts; a split
    left empty is refused, naming its source (`names`: split → what the user gave)."""
    key = hashlib.sha256(
        f"{SAMPLES_VERSION}|{corpus_fingerprint}|{tokenizer_key(tokenizer)}|{opts.key()}|{packed}".encode()
    ).hexdigest()[:20]
    path = Path(cache_dir) / "samples" / key
    if (path / STATS_FILE).exists():
        logger.info("encoded samples from cache %s", path)
        stats = {k: EncodeStats(**v) for k, v in json.loads((path / STATS_FILE).read_text()).items()}
        return load_from_disk(str(path)), stats
    rows, stats = encode(raw, tokenizer, opts, num_proc)
    for split, ds in rows.items():
        if len(ds) == 0:  # before the cache: an empty split saved there would fail every retry in datasets
            source = (names or {}).get(split)
            raise UsageError(
                f"the {split} data{f' ({source})' if source else ''} has no sample with a target token within "
                f"--block_size {opts.max_length} ({stats[split].describe()}): raise --block_size, shorten the "
                "prompts, or use --truncation_mode keep_end."
            )
    if packed:
        rows = DatasetDict({split: pack_samples(ds, opts.max_length) for split, ds in rows.items()})
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{key}."))
    rows.save_to_disk(str(tmp))
    (tmp / STATS_FILE).write_text(json.dumps({k: asdict(v) for k, v in stats.items()}))
    try:
        os.replace(tmp, path)
    except OSError:  # another node filled it first
        shutil.rmtree(tmp, ignore_errors=True)
    return load_from_disk(str(path)), stats


@dataclass
class TrainingRows:
    """The rows both engines train and evaluate on, how to batch them, and what the banner says about them."""

    rows: DatasetDict  # 'train' and 'validation'
    collator: Collator
    fmt: str
    packed: bool
    stats: dict[str, EncodeStats] = field(default_factory=dict)
    default_template: bool = False
    carved_validation: bool = False

    def describe(self) -> list[str]:
        kind = (
            "blocks"
            if self.fmt == TEXT
            else "packed rows (attention confined to each sample)"
            if self.packed
            else "rows (one sample each, padded per micro-batch)"
        )
        lines = [
            f"data: {len(self.rows['train'])} train / {len(self.rows['validation'])} eval {kind}"
            + (f", format {self.fmt}" if self.fmt != TEXT else "")
            + (
                " (validation carved from the training rows: too few documents to split)"
                if self.carved_validation
                else ""
            )
        ]
        for split, s in self.stats.items():
            lines.append(f"  {split}: {s.describe()}, {s.target_tokens} target tokens of {s.tokens}")
        if self.default_template:
            lines.append(
                "  chat template: the tokenizer has none; anygpu's default (ChatML layout, turns end with EOS)"
            )
        return lines


def carve_validation(train: Dataset, percentage: float) -> DatasetDict:
    """The last rows of the training set as validation (at least one), when the raw data had too few documents."""
    if len(train) < 2:
        raise UsageError(
            f"the training data makes {len(train)} row(s): too little to carve a validation split from; "
            "give --validation_file, more data, or a smaller --block_size."
        )
    num_val = min(len(train) - 1, max(1, round(len(train) * percentage / 100)))
    return DatasetDict(
        train=train.select(range(len(train) - num_val)),
        validation=train.select(range(len(train) - num_val, len(train))),
    )


def source_names(data_args: DataArguments) -> dict[str, str]:
    """split → the file or data set the user named for it (for messages)."""
    name = lambda path: Path(path).name  # noqa: E731
    train = name(data_args.train_file) if data_args.train_file else data_args.dataset_name
    validation = name(data_args.validation_file) if data_args.validation_file else data_args.dataset_name
    return {split: source for split, source in (("train", train), ("validation", validation)) if source}


def make_rows(
    raw: DatasetDict,
    fmt: str,
    tokenizer,
    block_size: int,
    data_args: DataArguments,
    packing: bool,
    corpus_fingerprint: str,
    num_proc: int | None = None,
) -> TrainingRows:
    """Tokenise (and pack) the raw data of any format into rows; carve a validation split when there is none."""
    default_template = False
    if fmt == MESSAGES or (fmt == PROMPT_COMPLETION and not isinstance(raw["train"][0]["prompt"], str)):
        default_template = chat_template.ensure_chat_template(tokenizer)
    if fmt == TEXT:
        rows = pack(
            raw, tokenizer, block_size, data_args.text_column, corpus_fingerprint, data_args.data_cache_dir, num_proc
        )
        stats, packing = {}, True
    else:
        opts = EncodeOptions(
            fmt, block_size, data_args.completion_only_loss, data_args.assistant_only_loss, data_args.truncation_mode
        )
        names = source_names(data_args)
        rows, stats = build_rows(
            raw, tokenizer, opts, packing, corpus_fingerprint, data_args.data_cache_dir, num_proc, names
        )
    carved = "validation" not in rows
    if carved:
        rows = carve_validation(rows["train"], data_args.validation_split_percentage)
    return TrainingRows(
        rows, Collator(tokenizer.pad_token_id, packing and fmt != TEXT), fmt, packing, stats, default_template, carved
    )

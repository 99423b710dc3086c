"""A prepared corpus as the engines read it: each source's training and validation rows (memory-mapped
blocks), the data set and global order they train on (one source: `GlobalOrder`; a mixture: `MixtureOrder`
over the sources one after the other), the per-source evaluation sets, and the banner's lines."""

from __future__ import annotations

from dataclasses import dataclass, field

from anygpu.config.mixture import exact_weight
from anygpu.data.corpus import CorpusPlan
from anygpu.data.mixture_order import MixtureOrder
from anygpu.data.order import GlobalOrder, eval_subset
from anygpu.data.packing import no_full_block
from anygpu.data.samples import carve_validation
from anygpu.data.shared_prep import PreparedUnits
from anygpu.data.token_rows import Concatenation, Rows, TokenBlocks
from anygpu.data.token_units import SPLITS


@dataclass
class CorpusRows:
    train: dict[str, Rows]  # source → its training rows
    validation: dict[str, Rows]  # source → its validation rows (all of them)
    carved: list[str] = field(default_factory=list)  # sources whose validation rows were carved from training's


def source_rows(prepared: PreparedUnits, plan: CorpusPlan, block_size: int, percentage: float) -> CorpusRows:
    """Each source's rows: its units' streams in order, cut into blocks; a source whose held-out documents make
    no full block gets the last of its training rows as validation (the banner says so)."""
    out = CorpusRows({}, {})
    for source in plan.sources:
        units = [i for i, u in enumerate(prepared.units) if u.source == source.name]
        rows = {
            split: TokenBlocks(
                [prepared.files(i, split) for i in units],
                [prepared.metas[i]["tokens"][split] for i in units],
                prepared.dtype.name,
                block_size,
            )
            for split in SPLITS
        }
        train, validation = rows["train"], rows["validation"]
        if not plan.mixture and len(train) == 0:
            raise no_full_block("train", block_size)
        if len(validation) == 0:
            if source.validation_files:
                raise no_full_block("validation", block_size)
            if len(train) > 0 or not plan.mixture:
                carved = carve_validation(train, percentage)
                train, validation = carved["train"], carved["validation"]
                out.carved.append(source.name)
        out.train[source.name], out.validation[source.name] = train, validation
    return out


def limit_train(rows: CorpusRows, max_samples: int | None) -> None:
    """--max_train_samples: the first N rows of each source."""
    if max_samples:
        for name, train in rows.train.items():
            rows.train[name] = train.select(range(min(max_samples, len(train))))


def eval_sets(rows: CorpusRows, max_samples: int | None) -> dict[str, Rows]:
    """Each source's evaluation rows: a seeded uniform sample of --max_eval_samples of them (all when fewer)."""
    return {
        name: val.select(eval_subset(len(val), max_samples)) if max_samples and 0 < max_samples < len(val) else val
        for name, val in rows.validation.items()
        if len(val)
    }


def training_order(rows: CorpusRows, plan: CorpusPlan, global_batch_size: int, seed: int):
    """(the training data set, its order): a mixture's sources one after the other under `MixtureOrder`."""
    if not plan.mixture:
        (train,) = rows.train.values()
        return train, GlobalOrder(len(train), global_batch_size, seed)
    names = tuple(s.name for s in plan.sources)
    sizes = tuple(len(rows.train[n]) for n in names)
    weights = tuple(exact_weight(s.weight) for s in plan.sources)
    return Concatenation([rows.train[n] for n in names]), MixtureOrder(sizes, weights, names, global_batch_size, seed)


def describe(rows: CorpusRows, prepared: PreparedUnits, plan: CorpusPlan) -> list[str]:
    """The banner's lines: each source's files and rows, the prepared data's disk, rows skipped."""
    lines = []
    for s in plan.sources:
        stats = prepared.stats(s.name)
        label = f"{s.name}: weight {s.weight:g}," if plan.mixture else "--train_file:"
        lines.append(
            f"  {label} {len(s.files)} file(s), {stats.documents} documents, {len(rows.train[s.name])} "
            f"train / {len(rows.validation[s.name])} eval blocks"
            + (" (eval carved from its training blocks)" if s.name in rows.carved else "")
            + (f", {stats.null_rows} null rows skipped" if stats.null_rows else "")
            + (
                f", {stats.bad_rows} bad rows and {stats.bad_files} bad files dropped (first: {stats.first_bad})"
                if stats.bad_rows or stats.bad_files
                else ""
            )
        )
    lines.append(
        f"  prepared data: {prepared.disk_bytes / 1e9:.3f} GB on disk ({prepared.dtype.name} tokens) in "
        f"{prepared.folder.parent}: {prepared.summary}"
    )
    return lines

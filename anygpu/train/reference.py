"""The reference model's sequence log-probs (`--objective dpo`): precomputed once and cached, or a frozen model.

Precomputed (`--precompute_ref_log_probs`, the default): before training, every rank computes the log-probs of its
share of the pairs of each split (the evaluation's sharding: every rank the same number of forwards, so a sharded
reference gathers its parameters collectively), the shares are summed over the ranks (each pair computed once), and
the table is written to `<data cache>/ref_logps/<key>.safetensors`, keyed by the reference (its config and weight
files: names, sizes, modification times), the prepared pairs (corpus, tokenizer, chat template, block size,
truncation), the rows used and the precision. A second run, a resume or a run on another number of GPUs finds the
file and never loads the reference: every rank checks, and one rank without it makes all of them compute. The table
becomes TRL's `ref_chosen_logps` / `ref_rejected_logps` columns of the pairs.

Otherwise the reference runs beside the policy at every micro-batch, under no_grad: a frozen copy (the engine shards
it like the policy), or with LoRA the policy itself with its adapter disabled.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import tempfile
import time
from pathlib import Path
from typing import Callable, ContextManager

import torch
from datasets import Dataset

from anygpu.data.collate import batch_to
from anygpu.data.order import eval_shards
from anygpu.data.pair_batches import REF_COLUMNS
from anygpu.model import hub_weights, lora, sequence_log_probs
from anygpu.runtime import context_parallel, distributed
from anygpu.runtime.context_parallel import CPGroup
from anygpu.runtime.distributed import DistInfo

logger = logging.getLogger(__name__)
REF_VERSION = "1"
RefForward = Callable[..., torch.Tensor]  # a batch (and under CP the rank's part, the group) → its sequences' (2m,)


def identity(path: str) -> str:
    """What identifies a model's weights without reading them: its config and its weight files' names, sizes and
    modification times (an edited or replaced file changes the key; a copy elsewhere is computed again)."""
    files = hub_weights.weight_files(path)
    config = files[0].parent / "config.json"
    parts = [config.read_text() if config.exists() else ""]
    parts += [f"{f.name}:{f.stat().st_size}:{f.stat().st_mtime_ns}" for f in files]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:20]


def cache_file(cache_dir: str, pairs_key: str, reference: str, precision: str, selection: str) -> Path:
    key = hashlib.sha256(f"{REF_VERSION}|{pairs_key}|{reference}|{precision}|{selection}".encode()).hexdigest()[:24]
    return Path(cache_dir) / "ref_logps" / f"{key}.safetensors"


def forward_of(model, call: Callable, disable_adapter: bool = False) -> RefForward:
    """The reference's log-probs of a batch from `model` (forward through `call`), under no_grad; `disable_adapter`:
    the PEFT model's base (`lora.adapters_off`). Under CP (`part`, `cp`: the policy's part of the rows, inside
    its `context_parallel.split`) from the same part: the policy itself is split already, a frozen copy is split
    for its forward."""

    def forward(
        batch: dict[str, torch.Tensor], part: dict[str, torch.Tensor] | None = None, cp: CPGroup = context_parallel.NONE
    ) -> torch.Tensor:
        off = lora.adapters_off(model) if disable_adapter else contextlib.nullcontext()
        own = cp.size > 1 and not context_parallel.is_split(model)
        was_training = model.training
        model.eval()  # the policy itself (the starting model, or LoRA's base): no checkpointing, no training-only paths
        try:
            with (
                torch.no_grad(),
                off,
                context_parallel.split(model, batch, cp) if own else contextlib.nullcontext(part) as mine,
            ):
                return sequence_log_probs.pair_sequence_log_probs(model, call, batch, mine, cp)
        finally:
            model.train(was_training)

    return forward


def compute(dataset: Dataset, collator, forward: RefForward, info: DistInfo, batch_size: int) -> torch.Tensor:
    """(pairs, 2) fp64: the reference's chosen and rejected log-probs of every pair, on every rank."""
    table = torch.zeros(len(dataset), 2, dtype=torch.float64, device=info.device)
    for idx in eval_shards(len(dataset), info.world_size, info.rank, batch_size):
        batch = batch_to(collator.read(dataset, idx or [0]), info.device)
        seq = forward(batch).double()
        if idx:
            table[idx] = torch.stack(seq.chunk(2), dim=1)
    return distributed.all_reduce_sum(table).cpu()


def _write(path: Path, tables: dict[str, torch.Tensor]) -> None:
    from safetensors.torch import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    os.close(fd)
    save_file({k: v.contiguous() for k, v in tables.items()}, tmp, metadata={"columns": json.dumps(REF_COLUMNS)})
    os.replace(tmp, path)


def _read(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path))


def with_columns(dataset: Dataset, table: torch.Tensor) -> Dataset:
    """The pairs with TRL's `ref_chosen_logps` and `ref_rejected_logps` columns."""
    for name, column in zip(REF_COLUMNS, table.t()):
        dataset = dataset.add_column(name, column.numpy())
    return dataset


def precompute_or_read(
    splits: dict[str, Dataset],
    collator,
    reference: Callable[[], ContextManager[RefForward]],
    info: DistInfo,
    batch_size: int,
    path: Path,
) -> tuple[dict[str, Dataset], str]:
    """The splits with the reference's log-probs (read from `path`, or computed by the forward `reference()` yields
    and written there), and the banner line saying which."""
    missing = distributed.any_ranks([not path.exists()], info.device)[0]
    if not missing:
        tables = _read(path)
        line = f"reference: log-probs of {sum(len(t) for t in tables.values())} pairs read from the cache at {path}"
    else:
        start = time.monotonic()
        if info.is_main:
            pairs = sum(len(ds) for ds in splits.values())
            logger.info(
                "reference: computing the log-probs of %d pairs on %d ranks (no table at %s)",
                pairs,
                info.world_size,
                path,
            )
        with reference() as forward:
            tables = {split: compute(ds, collator, forward, info, batch_size) for split, ds in splits.items()}
        if info.is_local_main:  # every node's cache (a shared one: the same bytes, replaced atomically)
            _write(path, tables)
        distributed.barrier()
        line = (
            f"reference: log-probs of {sum(len(t) for t in tables.values())} pairs computed in "
            f"{time.monotonic() - start:.1f} s on {info.world_size} rank{'s' * (info.world_size > 1)}, cached at {path}"
        )
    return {split: with_columns(ds, tables[split]) for split, ds in splits.items()}, line

"""Rows and batches of variable-length samples: packed (several samples per row) or padded (one per row).

Packed rows hold whole samples, placed by best-fit decreasing (TRL's "bfd"), with `position_ids` that
restart at 0 for each sample. A batch of packed rows is passed without an attention mask: transformers
then confines attention to each sample from the position ids (a block-diagonal causal mask for sdpa and
eager, varlen kernels for flash attention, for which each micro-batch is flattened into one row at the
model: `modeling.flatten_packed_rows`). Padded rows get an attention mask instead. Either way labels
are -100 on padding, and the loss normalisation counts `labels[:, 1:] != -100` (the model shifts labels).

Kept ours rather than TRL's or transformers' (`benchmarks/packing_vs_trl.py`, trl 1.16.0, 2 shared CPU cores):
- `trl.data_utils.pack_dataset(strategy="bfd")` gives the very same rows when run over the whole data set in
  one batch (`map_kwargs={"batch_size": None}`; same ties), but in length order inside a row, with
  `seq_lengths` instead of `position_ids`; as TRL calls it (`Dataset.map` batches of 1000 samples) the rows
  are packed per 1000 samples (0.3% padding instead of 0.03% at m=4) and would depend on `num_proc`.
  Not faster: TRL's bfd 1.68 s (in one batch 1.97 s) vs ours 1.21 s on 20k samples at capacity 1024,
  18.5 s (23.4 s) vs 12.3 s on 200k; at 2048 0.74-1.13x ours' time, 0.94-1.44x with the position ids made
  (noisy: shared cores). Adopting it would add a dependency for no gain.
- `transformers.DataCollatorWithFlattening` (padding-free: one 1×L row per micro-batch) has no padding and
  equal losses (to 1e-8) whatever the micro-batch size m, but its rows are the micro-batch's samples, so
  their length L, and the L×L mask sdpa/eager build, grow with m (m times the m·capacity² mask elements of
  our rows at the same tokens); at our 0.01-0.03% padding it saves nothing, and it collates no faster:
  4.3 ms vs our Collator's 3.9 ms per micro-batch of the same tokens (4 rows of 1024).
"""

from __future__ import annotations

import ast
import bisect
import functools
import hashlib
import importlib
import inspect
from collections import deque
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import torch
from datasets import Dataset
from datasets.table import InMemoryTable

from anygpu.config import attention
from anygpu.data.formats import IGNORE


def best_fit_decreasing(lengths: list[int], capacity: int) -> list[list[int]]:
    """Sample indices per row: longest first (ties: data-set order), each into the fullest row it still fits in
    (ties: the row that got that much room first). The same rows as TRL's `pack_dataset(strategy="bfd")` run
    over the whole data set in one batch."""
    rows: list[list[int]] = []
    free: dict[int, deque[int]] = {}  # free capacity → rows with that much room, oldest first
    keys: list[int] = []  # the capacities in `free`, sorted
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        n = lengths[i]
        k = bisect.bisect_left(keys, n)
        if k < len(keys):
            room = keys[k]
            row = free[room].popleft()
            if not free[room]:
                del free[room]
                keys.pop(k)
        else:
            room, row = capacity, len(rows)
            rows.append([])
        rows[row].append(i)
        left = room - n
        if left > 0:
            if left not in free:
                bisect.insort(keys, left)
                free[left] = deque()
            free[left].append(row)
    return rows


def pack_samples(ds: Dataset, capacity: int) -> Dataset:
    """Encoded samples (input_ids, labels) → packed rows (input_ids, labels, position_ids) of ≤ capacity tokens.

    Whole samples only (`encode` has already cut each to ≤ capacity), data-set order inside a row; the rows
    depend only on the data and the capacity. The rows are cut from the Arrow buffers with one numpy gather
    (reading sample by sample cost ~0.3 ms each with datasets ≥ 4, whose `ds["input_ids"]` is a lazy column).
    """
    table = ds.select_columns(["input_ids", "labels"]).with_format("arrow")[:]
    ids, labels = (table[c].combine_chunks() for c in ("input_ids", "labels"))
    starts, label_starts = (c.offsets.to_numpy().astype(np.int64) for c in (ids, labels))  # into .values
    lengths = starts[1:] - starts[:-1]
    if not np.array_equal(lengths, label_starts[1:] - label_starts[:-1]):
        raise ValueError("pack_samples: input_ids and labels differ in length")
    rows = [sorted(members) for members in best_fit_decreasing(lengths.tolist(), capacity)]
    order = np.fromiter((i for members in rows for i in members), dtype=np.int64, count=len(lengths))
    taken = lengths[order]
    new_starts = np.cumsum(taken) - taken
    positions = np.arange(int(taken.sum()), dtype=np.int64) - np.repeat(new_starts, taken)
    row_offsets = np.zeros(len(rows) + 1, dtype=np.int64)
    row_offsets[1:] = np.cumsum(np.add.reduceat(taken, np.cumsum([0] + [len(m) for m in rows[:-1]]))) if rows else []

    def regroup(values: pa.Array) -> pa.Array:  # the input's list type (its offsets hold every token already)
        return type(ids).from_arrays(pa.array(row_offsets, type=ids.offsets.type), values)

    def gather(col: pa.Array, col_starts: np.ndarray) -> pa.Array:  # the packed tokens, in row order
        return pa.array(col.values.to_numpy(zero_copy_only=False)[np.repeat(col_starts[:-1][order], taken) + positions])

    packed = pa.table(
        {
            "input_ids": regroup(gather(ids, starts)),
            "labels": regroup(gather(labels, label_starts)),
            "position_ids": regroup(pa.array(positions)),
        }
    )
    # the fingerprint from the input's and the capacity: hashing the packed table itself costs seconds
    fingerprint = hashlib.sha256(f"pack_samples|{ds._fingerprint}|{capacity}".encode()).hexdigest()[:16]
    return Dataset(InMemoryTable(packed), fingerprint=fingerprint)


def packing_supported(model_type: str, attn_implementation: str) -> bool:
    """Whether the model's attention honours packed samples given only position ids: flash attention's or torch's
    varlen path, or transformers' masking utilities (which detect restarting position ids) in the model's code."""
    if attn_implementation == attention.VARLEN:
        return uses_attention_interface(model_type)  # else the family's own attention would ignore the offsets
    if attn_implementation in attention.OFFSETS:
        return True
    module = family_module(model_type)
    return module is not None and hasattr(module, "create_causal_mask") and masks_see_positions(model_type)


MASK_BUILDERS = ("create_causal_mask", "create_sliding_window_causal_mask", "create_chunked_causal_mask")


@functools.lru_cache(maxsize=None)
def masks_see_positions(model_type: str) -> bool:
    """Whether every causal mask the family's code builds is given the position ids, by keyword or in the dict it
    spreads (`create_causal_mask(**mask_kwargs)`): transformers finds packed samples from them; OPT, BLOOM, Falcon,
    MPT, BioGPT and gpt-oss build theirs without, and attention would run across the samples of a packed row."""
    tree = ast.parse(inspect.getsource(family_module(model_type)))
    for function in ast.walk(tree):
        if isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
            spread = _keys_of_dicts(function)
            for node in ast.walk(function):
                if _mask_call(node) and not _gives_positions(node, spread):
                    return False
    return True


def _mask_call(node: ast.AST) -> bool:
    if not isinstance(node, ast.Call):
        return False
    return (node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", None)) in MASK_BUILDERS


def _keys_of_dicts(function: ast.AST) -> dict[str, set]:
    """name → the string keys a function puts in that name's dict (`x = {...}`, `x["k"] = ...`, `x = y.copy()`)."""
    keys: dict[str, set] = {}
    copies: list[tuple[str, str]] = []
    for node in ast.walk(function):
        if not isinstance(node, ast.Assign):
            continue
        for target in node.targets:
            if isinstance(target, ast.Name) and isinstance(node.value, ast.Dict):
                named = {k.value for k in node.value.keys if isinstance(k, ast.Constant)}
                keys.setdefault(target.id, set()).update(named)
            elif isinstance(target, ast.Name) and _copy_of(node.value):
                copies.append((target.id, _copy_of(node.value)))
            elif isinstance(target, ast.Subscript) and isinstance(target.value, ast.Name):
                if isinstance(target.slice, ast.Constant):
                    keys.setdefault(target.value.id, set()).add(target.slice.value)
    for copy, source in copies:
        keys.setdefault(copy, set()).update(keys.get(source, set()))
    return keys


def _copy_of(value: ast.AST) -> str | None:
    """`y` of `y.copy()` or `dict(y)`, else None."""
    if not isinstance(value, ast.Call):
        return None
    func, args = value.func, value.args
    if isinstance(func, ast.Attribute) and func.attr == "copy" and isinstance(func.value, ast.Name):
        return func.value.id
    if isinstance(func, ast.Name) and func.id == "dict" and len(args) == 1 and isinstance(args[0], ast.Name):
        return args[0].id
    return None


def _gives_positions(call: ast.Call, spread: dict[str, set]) -> bool:
    """The call passes position_ids by keyword, or spreads a dict that holds them, or passes on its caller's **kwargs."""
    for keyword in call.keywords:
        if keyword.arg == "position_ids":
            return True
        if keyword.arg is None:
            name = keyword.value.id if isinstance(keyword.value, ast.Name) else None
            if name not in spread or "position_ids" in spread[name]:
                return True
    return False


def uses_attention_interface(model_type: str) -> bool:
    """Whether the family's attention calls transformers' attention interface (where a registered kernel, ours,
    takes over), as transformers itself judges it (`_can_set_attn_implementation`)."""
    module = family_module(model_type)
    return module is not None and hasattr(module, "ALL_ATTENTION_FUNCTIONS")


def family_module(model_type: str):
    """transformers' modeling module of a causal-LM family, or None (not one, or not importable)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return None
    from transformers.models.auto.configuration_auto import model_type_to_module_name

    name = model_type_to_module_name(model_type)  # gemma3_text: gemma3's module
    try:
        return importlib.import_module(f"transformers.models.{name}.modeling_{name}")
    except ImportError:
        return None


VARLEN_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")


def varlen_kwargs(position_ids: torch.Tensor) -> dict[str, torch.Tensor | int]:
    """Flash attention's variable-length arguments for packed rows flattened into one row (`modeling.flattened`):
    the cumulative sample boundaries and the longest sample, computed on the CPU from the positions (each sample,
    and the padding after the last, starts at position 0). transformers' flash attention reads them instead of
    deriving them from the positions in every layer, and again in checkpointing's recomputation (each a host sync)."""
    flat = position_ids.reshape(-1)
    starts = torch.nonzero(flat == 0).reshape(-1)
    bounds = torch.cat([starts, torch.tensor([flat.numel()])]).to(torch.int32)
    longest = int((bounds[1:] - bounds[:-1]).max())
    return {"cu_seq_lens_q": bounds, "cu_seq_lens_k": bounds, "max_length_q": longest, "max_length_k": longest}


def batch_to(batch: dict, device: torch.device, non_blocking: bool = False) -> dict:
    """A batch on `device` (its ints, flash attention's max lengths, stay as they are)."""
    return {k: v.to(device, non_blocking=non_blocking) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


@dataclass(frozen=True)
class Collator:
    """Rows → a batch of tensors. Raw-text blocks (no `labels` column) are full: labels = input_ids.
    `varlen`: packed rows also carry flash attention's sample boundaries (`varlen_kwargs`)."""

    pad_token_id: int
    packed: bool = False
    varlen: bool = False

    def __call__(self, rows: list[dict]) -> dict[str, torch.Tensor]:
        return self.collate({k: [r[k] for r in rows] for k in rows[0]})

    def read(self, dataset: Dataset, indices: list[int]) -> dict[str, torch.Tensor]:
        """Rows `indices` as a batch, in one Arrow read (row-by-row reads cost ~0.1 ms each)."""
        return self.collate(dataset[indices])

    def collate(self, columns: dict[str, list]) -> dict[str, torch.Tensor]:
        if "labels" not in columns:  # full blocks: lists of ids, or rows of memory-mapped token files
            ids = torch.as_tensor(np.asarray(columns["input_ids"], dtype=np.int64))
            return {"input_ids": ids, "labels": ids.clone()}
        lengths = [len(x) for x in columns["input_ids"]]
        width = max(lengths)
        ids = torch.full((len(lengths), width), self.pad_token_id, dtype=torch.long)
        labels = torch.full((len(lengths), width), IGNORE, dtype=torch.long)
        for r, (x, y) in enumerate(zip(columns["input_ids"], columns["labels"])):
            ids[r, : len(x)] = torch.tensor(x, dtype=torch.long)
            labels[r, : len(y)] = torch.tensor(y, dtype=torch.long)
        batch = {"input_ids": ids, "labels": labels}
        if self.packed:
            # Padding becomes one more "sample" (positions from 0) that nothing attends across and nothing trains on.
            pos = torch.arange(width, dtype=torch.long).repeat(len(lengths), 1)
            for r, p in enumerate(columns["position_ids"]):
                pos[r, : len(p)] = torch.tensor(p, dtype=torch.long)
                pos[r, len(p) :] -= len(p)
            batch["position_ids"] = pos
            if self.varlen:
                batch.update(varlen_kwargs(pos))
        elif min(lengths) < width:  # rows of one length need no mask: causal attention is the same without it
            batch["attention_mask"] = (torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]).long()
        return batch

    def count(self, batch: dict[str, torch.Tensor]) -> int:
        """What the global batch's loss is normalised by: its target tokens (`count_targets`)."""
        return count_targets(batch)


def step_count(collator, batches: list[dict[str, torch.Tensor]]) -> torch.Tensor:
    """The collator's count (`Collator.count`, `PairCollator.count`) of a step's micro-batches, summed: a 0-d int64
    tensor (target tokens) or a vector ([pairs, chosen tokens])."""
    return torch.tensor([collator.count(b) for b in batches], dtype=torch.long).sum(0)


def count_targets(batch: dict[str, torch.Tensor]) -> int:
    """Tokens the loss is taken on: labels are shifted inside the model, so position 0 is never a target."""
    return int((batch["labels"][:, 1:] != IGNORE).sum())


def row_lengths(dataset: Dataset) -> np.ndarray:
    """Tokens in each row, from the Arrow list lengths (no row is decoded)."""
    import pyarrow.compute as pc

    column = dataset.select_columns(["input_ids"]).with_format("arrow")[:]["input_ids"]
    return pc.list_value_length(column).to_numpy(zero_copy_only=False).astype(np.int64)


def real_tokens(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """(rows, width) 1 on each row's sample tokens, 0 on the padding that fills it to the batch's width.

    Padded rows carry it as their attention mask. In a packed row the padding is the last run of positions
    from 0 (`Collator.collate`) and the only one without a target: `formats.encode_split` drops samples
    without one. Raw-text blocks are full.
    """
    if "attention_mask" in batch:
        return batch["attention_mask"]
    ids = batch["input_ids"]
    if "position_ids" not in batch:
        return torch.ones_like(ids)
    at = torch.arange(ids.shape[1], device=ids.device)
    last_start = torch.where(batch["position_ids"] == 0, at, 0).amax(dim=1, keepdim=True)
    tail = at >= last_start
    tail_trains = ((batch["labels"] != IGNORE) & tail).any(dim=1, keepdim=True)
    return (~tail | tail_trains).long()

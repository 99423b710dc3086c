"""Rows and batches of variable-length samples: packed (several samples per row) or padded (one per row).

Packed rows hold whole samples, placed by best-fit decreasing (TRL's "bfd"), with `position_ids` that
restart at 0 for each sample. A batch of packed rows is passed without an attention mask: transformers
then confines attention to each sample from the position ids (a block-diagonal causal mask for sdpa and
eager, varlen kernels for flash attention). Padded rows get an attention mask instead. Either way labels
are -100 on padding, and the loss normalisation counts `labels[:, 1:] != -100` (the model shifts labels).
"""
from __future__ import annotations

import bisect
import importlib
from dataclasses import dataclass

import torch
from datasets import Dataset

from anygpu.data.formats import IGNORE


def best_fit_decreasing(lengths: list[int], capacity: int) -> list[list[int]]:
    """Sample indices per row: longest first, each into the fullest row it still fits in."""
    rows: list[list[int]] = []
    free: dict[int, list[int]] = {}  # free capacity → rows with that much room
    keys: list[int] = []  # the capacities in `free`, sorted
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        n = lengths[i]
        k = bisect.bisect_left(keys, n)
        if k < len(keys):
            room = keys[k]
            row = free[room].pop()
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
                free[left] = []
            free[left].append(row)
    return rows


def pack_samples(ds: Dataset, capacity: int) -> Dataset:
    """Encoded samples (input_ids, labels) → packed rows (input_ids, labels, position_ids) of ≤ capacity tokens."""
    ids, labels = ds["input_ids"], ds["labels"]
    out = {"input_ids": [], "labels": [], "position_ids": []}
    for members in best_fit_decreasing([len(x) for x in ids], capacity):
        members.sort()  # data-set order inside a row
        out["input_ids"].append([t for i in members for t in ids[i]])
        out["labels"].append([t for i in members for t in labels[i]])
        out["position_ids"].append([p for i in members for p in range(len(ids[i]))])
    return Dataset.from_dict(out)


def packing_supported(model_type: str, attn_implementation: str) -> bool:
    """Whether the model's attention honours packed samples given only position ids: flash attention's varlen
    path, or transformers' masking utilities (which detect restarting position ids) in the model's code."""
    if attn_implementation.startswith("flash_attention"):
        return True
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return False
    try:
        module = importlib.import_module(f"transformers.models.{model_type.replace('-', '_')}.modeling_{model_type.replace('-', '_')}")
    except ImportError:
        return False
    return hasattr(module, "create_causal_mask")


@dataclass(frozen=True)
class Collator:
    """Rows → a batch of tensors. Raw-text blocks (no `labels` column) are full: labels = input_ids."""

    pad_token_id: int
    packed: bool = False

    def __call__(self, rows: list[dict]) -> dict[str, torch.Tensor]:
        return self.collate({k: [r[k] for r in rows] for k in rows[0]})

    def read(self, dataset: Dataset, indices: list[int]) -> dict[str, torch.Tensor]:
        """Rows `indices` as a batch, in one Arrow read (row-by-row reads cost ~0.1 ms each)."""
        return self.collate(dataset[indices])

    def collate(self, columns: dict[str, list]) -> dict[str, torch.Tensor]:
        if "labels" not in columns:
            ids = torch.tensor(columns["input_ids"], dtype=torch.long)
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
                pos[r, len(p):] -= len(p)
            batch["position_ids"] = pos
        else:
            batch["attention_mask"] = (torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]).long()
        return batch


def count_targets(batch: dict[str, torch.Tensor]) -> int:
    """Tokens the loss is taken on: labels are shifted inside the model, so position 0 is never a target."""
    return int((batch["labels"][:, 1:] != IGNORE).sum())

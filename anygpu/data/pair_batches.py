"""Preference pairs → batches: the m chosen sequences, then the m rejected ones (TRL's concatenated layout), in one
forward.

Each sequence is `prompt_ids + chosen_ids` (or `+ rejected_ids`), cut to `--block_size` as TRL's collator cuts it
(keep_start: the first tokens; keep_end: the last). Its completion tokens are the labels (-100 elsewhere, and on
its first token, which no token of its own predicts). `segment` says which sequence each position belongs to (0 … m-1
chosen, m … 2m-1 rejected, -1 on padding), so the objective sums each sequence's log-probs from the flat per-token
ones. Padded: one sequence per row, an attention mask. Packed (where the model's attention honours sample
boundaries, as for SFT): the 2m sequences placed into rows of `--block_size` tokens by best-fit decreasing, with
position ids that restart at 0 for each sequence and no attention mask (`collate.Collator` for the same layout).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from datasets import Dataset

from anygpu.data.collate import best_fit_decreasing, varlen_kwargs
from anygpu.data.formats import IGNORE

REF_COLUMNS = ("ref_chosen_logps", "ref_rejected_logps")  # TRL's names for the precomputed reference log-probs
# the labels are passed on their own; flash attention's sample boundaries with packed rows (`collate.varlen_kwargs`)
MODEL_KEYS = (
    "input_ids",
    "attention_mask",
    "position_ids",
    "cu_seq_lens_q",
    "cu_seq_lens_k",
    "max_length_q",
    "max_length_k",
)


def cut(ids: list[int], mask: list[int], max_length: int, truncation_mode: str) -> tuple[list[int], list[int]]:
    """A sequence and its completion mask cut to `max_length` (TRL's `DataCollatorForPreference`)."""
    if len(ids) <= max_length:
        return ids, mask
    if truncation_mode == "keep_end":
        return ids[-max_length:], mask[-max_length:]
    return ids[:max_length], mask[:max_length]


@dataclass(frozen=True)
class PairCollator:
    """`varlen`: packed rows also carry flash attention's sequence boundaries, as `collate.Collator`'s."""

    pad_token_id: int
    max_length: int
    truncation_mode: str = "keep_start"
    packed: bool = False
    varlen: bool = False

    def __call__(self, rows: list[dict]) -> dict[str, torch.Tensor]:
        return self.collate({k: [r[k] for r in rows] for k in rows[0]})

    def read(self, dataset: Dataset, indices: list[int]) -> dict[str, torch.Tensor]:
        """Pairs `indices` as a batch, in one Arrow read."""
        return self.collate(dataset[indices])

    def sequences(self, columns: dict[str, list]) -> list[tuple[list[int], list[int]]]:
        """(ids, labels) of the chosen sequences, then the rejected ones."""
        out = []
        for side in ("chosen_ids", "rejected_ids"):
            for prompt, completion in zip(columns["prompt_ids"], columns[side]):
                mask = [0] * len(prompt) + [1] * len(completion)
                ids, mask = cut(list(prompt) + list(completion), mask, self.max_length, self.truncation_mode)
                labels = [t if keep else IGNORE for t, keep in zip(ids, mask)]
                out.append((ids, [IGNORE, *labels[1:]], sum(mask)))
        return out

    def collate(self, columns: dict[str, list]) -> dict[str, torch.Tensor]:
        seqs = self.sequences(columns)
        batch = self._packed(seqs) if self.packed else self._padded(seqs)
        batch["completion_tokens"] = torch.tensor([n for _, _, n in seqs], dtype=torch.long)
        if REF_COLUMNS[0] in columns:
            batch["ref_logps"] = torch.tensor(columns[REF_COLUMNS[0]] + columns[REF_COLUMNS[1]], dtype=torch.float64)
        return batch

    def _padded(self, seqs: list) -> dict[str, torch.Tensor]:
        width = max(len(ids) for ids, _, _ in seqs)
        ids = torch.full((len(seqs), width), self.pad_token_id, dtype=torch.long)
        labels = torch.full((len(seqs), width), IGNORE, dtype=torch.long)
        segment = torch.full((len(seqs), width), -1, dtype=torch.long)
        for r, (x, y, _) in enumerate(seqs):
            ids[r, : len(x)], labels[r, : len(y)], segment[r, : len(x)] = torch.tensor(x), torch.tensor(y), r
        mask = (segment >= 0).long()
        return {"input_ids": ids, "attention_mask": mask, "labels": labels, "segment": segment}

    def _packed(self, seqs: list) -> dict[str, torch.Tensor]:
        rows = [sorted(r) for r in best_fit_decreasing([len(ids) for ids, _, _ in seqs], self.max_length)]
        width = max(sum(len(seqs[k][0]) for k in row) for row in rows)
        ids = torch.full((len(rows), width), self.pad_token_id, dtype=torch.long)
        labels = torch.full((len(rows), width), IGNORE, dtype=torch.long)
        segment = torch.full((len(rows), width), -1, dtype=torch.long)
        position = torch.zeros((len(rows), width), dtype=torch.long)
        for r, row in enumerate(rows):
            at = 0
            for k in row:
                x, y, _ = seqs[k]
                ids[r, at : at + len(x)], labels[r, at : at + len(y)] = torch.tensor(x), torch.tensor(y)
                segment[r, at : at + len(x)], position[r, at : at + len(x)] = k, torch.arange(len(x))
                at += len(x)
            position[r, at:] = torch.arange(width - at)  # the padding: one more sequence, trained on by nothing
        batch = {"input_ids": ids, "position_ids": position, "labels": labels, "segment": segment}
        return {**batch, **varlen_kwargs(position)} if self.varlen else batch

    def count(self, batch: dict[str, torch.Tensor]) -> list[int]:
        """[pairs, chosen tokens scored]: what the global batch's loss is normalised by (the pair terms by the pairs,
        the sft term by the chosen completions' tokens)."""
        pairs = batch["completion_tokens"].numel() // 2
        chosen = (batch["labels"] != IGNORE) & (batch["segment"] >= 0) & (batch["segment"] < pairs)
        return [pairs, int(chosen.sum())]


def model_inputs(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The inputs of a pair batch the model's forward takes (not the labels)."""
    return {k: batch[k] for k in MODEL_KEYS if k in batch}

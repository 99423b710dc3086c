"""Prepared token streams read as rows by index, memory-mapped: a rank holds the offsets of the units (one
number per file part) and the pages it reads, whatever the corpus's size.

A source's stream is its units' streams one after the other, in file order; row i is tokens
[i·block_size, (i+1)·block_size) of it (a row may span units: documents are joined across files as within
one), and the last partial row is left out. The rows answer as the engines' data sets do: `len`, `ds[i]`,
`ds[[i, j]]` (one batch of rows), `ds.select(indices)`, column `input_ids`."""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path
from typing import Any, Sequence

import numpy as np

OPEN_MAPS = 256  # memory maps kept open per process (each holds a file descriptor)


class Rows:
    """Random access to rows of token ids: subclasses give `__len__` and `_rows`."""

    column_names = ["input_ids"]
    block_size: int

    def __len__(self) -> int:
        raise NotImplementedError

    def _rows(self, indices: np.ndarray) -> np.ndarray:
        """Rows `indices` (already checked) as one (n, block_size) int64 array."""
        raise NotImplementedError

    def rows(self, indices: Sequence[int]) -> np.ndarray:
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        if len(idx) and (idx.min() < 0 or idx.max() >= len(self)):
            raise IndexError(f"row index out of range [0, {len(self)})")
        return self._rows(idx) if len(idx) else np.zeros((0, self.block_size), dtype=np.int64)

    def __getitem__(self, key: Any) -> Any:
        if isinstance(key, str):  # a whole column (small data sets, tests)
            if key != "input_ids":
                raise KeyError(key)
            return self.rows(range(len(self))).tolist()
        if isinstance(key, slice):
            return {"input_ids": self.rows(range(*key.indices(len(self))))}
        if isinstance(key, (int, np.integer)):
            return {"input_ids": self.rows([int(key) % len(self) if key < 0 else int(key)])[0]}
        return {"input_ids": self.rows(key)}  # a list of indices: one batch

    def __getitems__(self, keys: Sequence[int]) -> list[dict[str, np.ndarray]]:
        """The DataLoader's batched read: rows as the collator takes them."""
        return [{"input_ids": r} for r in self.rows(keys)]

    def __iter__(self):
        for i in range(len(self)):
            yield self[i]

    def select(self, indices: Sequence[int] | range) -> Rows:
        return Selection(self, indices)


class TokenBlocks(Rows):
    """Rows cut from a sequence of token files (memory-mapped when first read)."""

    def __init__(self, files: Sequence[str | Path], counts: Sequence[int], dtype: str, block_size: int) -> None:
        kept = [(str(f), int(n)) for f, n in zip(files, counts) if n > 0]
        self.files = [f for f, _ in kept]
        self.offsets = np.concatenate([[0], np.cumsum([n for _, n in kept], dtype=np.int64)])
        self.dtype, self.block_size = np.dtype(dtype), block_size
        self.num_tokens = int(self.offsets[-1])
        self._maps: OrderedDict[int, np.memmap] = OrderedDict()

    def __len__(self) -> int:
        return self.num_tokens // self.block_size

    def __getstate__(self) -> dict:  # a loader worker opens its own maps
        return {**self.__dict__, "_maps": OrderedDict()}

    def _map(self, unit: int) -> np.memmap:
        found = self._maps.get(unit)
        if found is None:
            found = np.memmap(self.files[unit], dtype=self.dtype, mode="r")
            self._maps[unit] = found
            if len(self._maps) > OPEN_MAPS:
                self._maps.popitem(last=False)
        else:
            self._maps.move_to_end(unit)
        return found

    def _rows(self, indices: np.ndarray) -> np.ndarray:
        out = np.empty((len(indices), self.block_size), dtype=np.int64)
        for r, i in enumerate(indices):
            start, filled = int(i) * self.block_size, 0
            unit = int(np.searchsorted(self.offsets, start, side="right")) - 1
            while filled < self.block_size:  # a row may run on into the next units
                at = start + filled - int(self.offsets[unit])
                take = min(self.block_size - filled, int(self.offsets[unit + 1] - self.offsets[unit]) - at)
                out[r, filled : filled + take] = self._map(unit)[at : at + take]
                filled, unit = filled + take, unit + 1
        return out


class Selection(Rows):
    """Some rows of another, in the order given (a range is kept as a range: no index array)."""

    def __init__(self, base: Rows, indices: Sequence[int] | range) -> None:
        self.base, self.block_size = base, base.block_size
        self.indices = indices if isinstance(indices, range) else np.asarray(indices, dtype=np.int64)

    def __len__(self) -> int:
        return len(self.indices)

    def _rows(self, indices: np.ndarray) -> np.ndarray:
        if isinstance(self.indices, range):
            mapped = self.indices.start + indices * self.indices.step
        else:
            mapped = self.indices[indices]
        return self.base.rows(mapped)


class Concatenation(Rows):
    """Several row sets one after the other (the sources of a mixture): row offsets per part."""

    def __init__(self, parts: Sequence[Rows]) -> None:
        self.parts = list(parts)
        self.block_size = self.parts[0].block_size
        self.offsets = np.concatenate([[0], np.cumsum([len(p) for p in self.parts], dtype=np.int64)])

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def part_of(self, indices: np.ndarray) -> np.ndarray:
        """Which part each row index falls in."""
        return np.searchsorted(self.offsets, indices, side="right") - 1

    def _rows(self, indices: np.ndarray) -> np.ndarray:
        out = np.empty((len(indices), self.block_size), dtype=np.int64)
        which = self.part_of(indices)
        for p in np.unique(which):
            mask = which == p
            out[mask] = self.parts[p].rows(indices[mask] - self.offsets[p])
        return out

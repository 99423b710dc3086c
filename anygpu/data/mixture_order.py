"""The global order of a mixture: which source, and which of its rows, each global sample index draws: a pure
function of the seed and the index, so global batch k is the same samples on any world size and after any
resume, as with `GlobalOrder`.

Sample indices are cut into windows of K. Window w holds exactly C_s(w+1) − C_s(w) samples of source s, where
C_s(n) = ⌊w_s·K·n⌋ (exact fractions of the weights; the heaviest source takes what rounding leaves), so after
n whole windows every source has had its share to within one sample, and within a window the sources'
positions are a seeded permutation. Source s's j-th draw is row π_{s,e}(j mod N_s) of its epoch e = j // N_s:
a source that runs out starts a new epoch in a new order. The permutations are Feistel networks evaluated
per index, so neither memory nor time per step grows with the corpus (no permutation array of N rows).

Samples are whole `block_size` rows of packed text, so shares of samples are also shares of tokens."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Sequence

import numpy as np

from anygpu.config.batch import BatchPlan
from anygpu.data.order import check_enough_samples, rank_micro_batches
from anygpu.errors import UsageError

WINDOW = 8192  # samples per window (at least the sources squared: every window gives the heaviest one a sample)
ROUNDS = 6
MASK64 = (1 << 64) - 1


def _key(*parts: object) -> int:
    return int.from_bytes(hashlib.blake2b(repr(parts).encode(), digest_size=8).digest(), "little")


def _mix(x: np.ndarray, key: int) -> np.ndarray:
    """A 64-bit integer hash (splitmix64's finaliser) of `x` under `key`."""
    with np.errstate(over="ignore"):
        z = x + np.uint64(key)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def permute(indices: np.ndarray, n: int, key: int) -> np.ndarray:
    """π(indices) for a seeded permutation π of [0, n): a balanced Feistel network on the smallest even number of
    bits that holds n, walked again while it lands past n (fewer than 4 times on average)."""
    bits = max(2, (n - 1).bit_length())
    bits += bits % 2
    half, mask = bits // 2, np.uint64((1 << (bits // 2)) - 1)
    keys = [_key(key, r) for r in range(ROUNDS)]
    out = np.asarray(indices, dtype=np.uint64).copy()
    todo = np.ones(len(out), dtype=bool)
    while todo.any():
        x = out[todo]
        left, right = x >> np.uint64(half), x & mask
        for k in keys:
            left, right = right, left ^ (_mix(right, k) & mask)
        out[todo] = (left << np.uint64(half)) | right
        todo = out >= np.uint64(n)
    return out.astype(np.int64)


@dataclass(frozen=True)
class MixtureOrder:
    """The order of a mixture of sources with `sizes` rows (source s's rows are [offset_s, offset_s + N_s) of the
    concatenated data set) and `weights`; the interface of `GlobalOrder`."""

    sizes: tuple[int, ...]
    weights: tuple[Fraction, ...]
    names: tuple[str, ...]
    global_batch_size: int
    seed: int
    window: int = WINDOW
    _windows: dict = field(default_factory=dict, init=False, repr=False, compare=False)  # the last windows used

    def __post_init__(self) -> None:
        for name, n, w in zip(self.names, self.sizes, self.weights):
            if w > 0 and n == 0:
                raise UsageError(
                    f"--dataset_mixture source {name!r} has weight {float(w):g} but no full block of training text: "
                    "give it more text, a lower --block_size, or weight 0."
                )
        total = sum(self.weights)
        object.__setattr__(self, "weights", tuple(w / total for w in self.weights))
        object.__setattr__(self, "window", max(self.window, len(self.sizes) ** 2))
        check_enough_samples(self.num_samples, self.global_batch_size)

    @property
    def num_samples(self) -> int:
        """The samples of the sources it draws from (a weight-0 source, evaluated only, adds none to an epoch)."""
        return sum(n for n, w in zip(self.sizes, self.weights) if w > 0)

    @property
    def steps_per_epoch(self) -> int:
        """Steps per pass over as many samples as the sources hold together (each source has its own epochs)."""
        return self.num_samples // self.global_batch_size

    @property
    def heaviest(self) -> int:
        return max(range(len(self.weights)), key=lambda s: (self.weights[s], -s))

    def drawn_before_window(self, w: int) -> np.ndarray:
        """C_s(w): samples each source has given in windows [0, w)."""
        counts = np.array([(wt.numerator * self.window * w) // wt.denominator for wt in self.weights], dtype=np.int64)
        counts[self.heaviest] = 0
        counts[self.heaviest] = self.window * w - counts.sum()
        return counts

    def _window(self, w: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(C_s(w), the source of each position of window w, its draw number within the window): the source's
        quota of slots, placed by a seeded permutation; a source's draws numbered in position order."""
        cached = self._windows.get(w)
        if cached is not None:
            return cached
        before, after = self.drawn_before_window(w), self.drawn_before_window(w + 1)
        starts = np.concatenate([[0], np.cumsum(after - before)])
        slots = permute(np.arange(self.window), self.window, _key(self.seed, "window", w))
        source = np.searchsorted(starts, slots, side="right") - 1
        rank = np.empty(self.window, dtype=np.int64)
        for s in range(len(self.sizes)):
            at = np.flatnonzero(source == s)
            rank[at] = np.arange(len(at))
        if len(self._windows) >= 4:  # a step touches one or two windows
            self._windows.clear()
        self._windows[w] = (before, source, rank)
        return before, source, rank

    def draws(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(source, its draw number j) of each global sample position."""
        sources = np.empty(len(positions), dtype=np.int64)
        draws = np.empty(len(positions), dtype=np.int64)
        for w in np.unique(positions // self.window):
            mask = positions // self.window == w
            before, source, rank = self._window(int(w))
            at = positions[mask] % self.window
            sources[mask], draws[mask] = source[at], before[source[at]] + rank[at]
        return sources, draws

    def sample_indices(self, positions: Sequence[int]) -> list[int]:
        """Data set indices (in the concatenation of the sources) of global sample positions."""
        sources, draws = self.draws(np.asarray(positions, dtype=np.int64))
        offsets = np.concatenate([[0], np.cumsum(self.sizes)])
        out = np.empty(len(sources), dtype=np.int64)
        for s in np.unique(sources):
            n, mask = self.sizes[s], sources == s
            for e in np.unique(draws[mask] // n):
                sel = mask & (draws // n == e)
                out[sel] = offsets[s] + permute(draws[sel] % n, n, _key(self.seed, "source", int(s), int(e)))
        return out.tolist()

    def global_batch(self, step: int) -> list[int]:
        """Sample indices of optimizer step `step` (0-based): positions [kG, (k+1)G) of the mixture."""
        G = self.global_batch_size
        return self.sample_indices(range(step * G, (step + 1) * G))

    def micro_batches(self, step: int, plan: BatchPlan, rank: int) -> list[list[int]]:
        """Rank `rank`'s share of global batch `step` in micro-batches (only its own positions are looked up)."""
        first = step * self.global_batch_size + rank * plan.sequences_per_rank
        share = self.sample_indices(range(first, first + plan.sequences_per_rank))
        return rank_micro_batches(share, plan, 0)  # the share is rank 0's of a batch of just it

    def drawn(self, steps: int) -> dict[str, int]:
        """Samples drawn from each source in the first `steps` optimizer steps (what `samples/<name>` logs)."""
        n = steps * self.global_batch_size
        w, p = divmod(n, self.window)
        before, source, _ = self._window(w)
        within = np.bincount(source[:p], minlength=len(self.sizes))
        return {name: int(c) for name, c in zip(self.names, before + within)}

    def epochs_begun(self, step: int) -> list[tuple[str, int]]:
        """The sources that ran out during optimizer step `step` (1-based) and the epoch of theirs it began."""
        was, now = self.drawn(step - 1), self.drawn(step)
        out = []
        for name, n in zip(self.names, self.sizes):
            epoch = max(1, -(-was[name] // n)) if n else 0  # the first epoch (0-based) whose first draw is ≥ was
            while n and epoch * n < now[name]:
                out.append((name, epoch + 1))
                epoch += 1
        return out

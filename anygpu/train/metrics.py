"""Loss, tokens/s (real tokens: padding left out), padding, MFU and memory → console, metrics.jsonl, the --report_to trackers, loss.png.

Only the main rank writes; both engines log through `MetricsWriter` so the files have
the same keys whichever engine made them.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np
import torch
from datasets import Dataset
from transformers import PretrainedConfig

from anygpu.config.batch import BatchPlan
from anygpu.data.collate import best_fit_decreasing, row_lengths
from anygpu.data.order import GlobalOrder
from anygpu.data.preference import sequence_lengths
from anygpu.train import trackers

logger = logging.getLogger(__name__)


def flops_per_token(config: PretrainedConfig, num_trainable: int, seq_len: int, num_frozen: int = 0) -> float:
    """Training FLOPs per token: 6N for the trainable matmul weights (forward, gradient to the input, gradient to
    the weight), 4N for frozen ones (no weight gradient: LoRA's base), plus 12·L·H·T for attention. N counts the
    weights a token is multiplied by (`modeling.matmul_parameters`: the output projection, tied or not)."""
    layers = config.num_hidden_layers
    hidden = config.hidden_size
    return 6 * num_trainable + 4 * num_frozen + 12 * layers * hidden * seq_len


@dataclass(frozen=True)
class Flops:
    """A run's training FLOPs: `per_token` for the matmul weights (`flops_per_token` without attention) plus
    `per_token_squared` × Σ s² for attention, s each sample's length. A packed row of 4k-token samples at a
    128k block does the attention work of its samples, not of one 128k sequence (counted whole, MFU read ~5×
    too high there)."""

    per_token: float
    per_token_squared: float

    def of(self, tokens: int, squares: int) -> float:
        return self.per_token * tokens + self.per_token_squared * squares

    def at(self, seq_len: int) -> float:
        """Per token, for sequences of `seq_len` tokens each (`flops_per_token`)."""
        return self.per_token + self.per_token_squared * seq_len


def training_flops(config: PretrainedConfig, num_trainable: int, num_frozen: int = 0) -> Flops:
    """`flops_per_token`'s two parts (see there)."""
    return Flops(6 * num_trainable + 4 * num_frozen, 12 * config.num_hidden_layers * config.hidden_size)


def mfu(
    tokens_per_second: float, flops_per_tok: float, peak_flops_per_device: float | None, world_size: int
) -> float | None:
    if not peak_flops_per_device:
        return None
    return tokens_per_second * flops_per_tok / (peak_flops_per_device * world_size)


def sample_squares(dataset: Dataset, block_size: int, chunk_rows: int = 8192) -> np.ndarray | None:
    """Σ s² over each row's samples (s: a sample's tokens; attention's work), or None for raw-text blocks (one
    sample of `block_size` each). Packed rows' samples start where their position ids restart at 0; a padded
    row is one sample. Read a chunk of rows at a time: the positions of a large corpus never sit in memory whole."""
    if "labels" not in dataset.column_names:
        return None
    if "position_ids" not in dataset.column_names:
        return row_lengths(dataset) ** 2
    column = dataset.select_columns(["position_ids"]).with_format("arrow")
    out = np.zeros(len(dataset), dtype=np.int64)
    for first in range(0, len(dataset), chunk_rows):
        rows = column[first : first + chunk_rows]["position_ids"].combine_chunks()
        values = rows.values.to_numpy(zero_copy_only=False)
        offsets = rows.offsets.to_numpy().astype(np.int64)
        starts = np.flatnonzero(values == 0)
        lengths = np.diff(np.append(starts, len(values)))
        row_of = np.searchsorted(offsets, starts, side="right") - 1
        out[first : first + len(rows)] = np.bincount(row_of, weights=lengths**2, minlength=len(rows)).astype(np.int64)
    return out


class StepTokens:
    """Each optimizer step's real tokens (padding left out) and computed tokens (rows as padded in their
    micro-batches), from the rows' lengths and the batch split: no device work, the same in both engines.
    Raw-text blocks are full rows; chat and prompt-completion rows are padded to the longest of their micro-batch."""

    def __init__(self, dataset: Dataset, order: GlobalOrder, block_size: int, collator=None) -> None:
        self.pairs = "chosen_ids" in dataset.column_names  # preference pairs: two sequences each
        # raw-text blocks have no labels column and no padding
        self.padded = "labels" in dataset.column_names or self.pairs
        if self.pairs:
            self.lengths = sequence_lengths(dataset, block_size)
            self.squared = (self.lengths**2).sum(axis=1)  # Σ s² per pair: its two sequences
        else:
            self.lengths = row_lengths(dataset) if self.padded else None
            self.squared = sample_squares(dataset, block_size)  # Σ s² per row (attention's work), None for blocks
        self.order, self.block_size = order, block_size
        self.packed = bool(getattr(collator, "packed", False))

    def squares(self, step: int, plan: BatchPlan) -> int:
        """Σ s² over the samples of optimizer step `step` (0-based), all ranks: its attention work."""
        if self.squared is None:
            return plan.global_batch_size * self.block_size**2
        return int(self.squared[self.order.global_batch(step)].sum())

    def count(self, step: int, plan: BatchPlan) -> tuple[int, int]:
        """(real, computed) tokens of optimizer step `step` (0-based) over all ranks."""
        if self.lengths is None:
            n = plan.global_batch_size * self.block_size
            return n, n
        real = computed = 0
        for rank in range(plan.world_size):
            for micro in self.order.micro_batches(step, plan, rank):
                lengths = self.lengths[micro].reshape(-1)  # a pair's two sequences are rows of their own
                real += int(lengths.sum())
                computed += self._computed(lengths)
        return real, computed

    def _computed(self, lengths: np.ndarray) -> int:
        """The tokens a micro-batch's rows hold, padding included: its rows padded to the longest, or (packed pairs)
        the rows best-fit decreasing fills, padded to the fullest."""
        if not (self.pairs and self.packed):
            return len(lengths) * int(lengths.max())
        rows = best_fit_decreasing(lengths.tolist(), self.block_size)
        return len(rows) * max(int(lengths[row].sum()) for row in rows)


class ThroughputWindow:
    """Training time and tokens between two logged steps, less the pauses (evaluation, checkpoints) inside
    it: tokens/s counts training only, and the steps around a pause are not dropped from the window."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.start, self.paused, self.steps = time.perf_counter(), 0.0, 0
        self.tokens = self.computed = self.squares = 0

    def add(self, real: int, computed: int, squares: int = 0) -> None:
        """One step's real (non-pad) and computed (padded) tokens, and Σ s² over its samples."""
        self.steps += 1
        self.tokens += real
        self.computed += computed
        self.squares += squares

    def pause(self, seconds: float) -> None:
        self.paused += seconds

    def seconds(self) -> float:
        return max(time.perf_counter() - self.start - self.paused, 1e-9)

    def tokens_per_second(self) -> float:
        """Real tokens per second: padding is not work the user asked for."""
        return self.tokens / self.seconds()

    def flops_per_second(self, flops: Flops) -> float:
        """The training FLOPs of the window's samples per second (attention over each sample's own length)."""
        return flops.of(self.tokens, self.squares) / self.seconds()

    def padding_fraction(self) -> float:
        return 1.0 - self.tokens / self.computed if self.computed else 0.0

    def record(self, padded: bool) -> dict[str, float]:
        """tokens_per_second, and padding_fraction where rows are padded, for metrics.jsonl."""
        tps = self.tokens_per_second()
        return {"tokens_per_second": tps, **({"padding_fraction": self.padding_fraction()} if padded else {})}


@contextlib.contextmanager
def paused(window: ThroughputWindow) -> Iterator[None]:
    """Leave the time spent inside out of `window`."""
    start = time.perf_counter()
    try:
        yield
    finally:
        window.pause(time.perf_counter() - start)


def since_process_start() -> tuple[float, float]:
    """(wall seconds since this process started, CPU seconds it has used): the start-up cost to the first step."""
    cpu = time.process_time()
    try:
        start_ticks = int(open("/proc/self/stat").read().rsplit(")", 1)[1].split()[19])
        uptime = float(open("/proc/uptime").read().split()[0])
        return uptime - start_ticks / os.sysconf("SC_CLK_TCK"), cpu
    except (OSError, ValueError, IndexError):
        return float("nan"), cpu


def max_memory_gb(device: torch.device) -> float | None:
    """The peak allocated memory in GiB (2**30 bytes; metrics.jsonl's key `max_memory_allocated_gb` keeps its name)."""
    if device.type != "cuda":
        return None
    return torch.cuda.max_memory_allocated(device) / 2**30


def format_line(rec: dict[str, Any], max_steps: int) -> str:
    parts = [f"step {rec['step']}/{max_steps}"]
    if "loss" in rec:
        parts += [
            f"loss {rec['loss']:.4f}",
            f"lr {rec['learning_rate']:.2e}",
            f"grad_norm {rec['grad_norm']:.3f}",
            f"{rec['tokens_per_second']:,.0f} tok/s",
        ]
    if rec.get("padding_fraction") is not None:
        parts.append(f"padding {100 * rec['padding_fraction']:.1f}%")
    if rec.get("mfu") is not None:
        parts.append(f"mfu {100 * rec['mfu']:.1f}%")
    if rec.get("max_memory_allocated_gb") is not None:
        parts.append(f"mem {rec['max_memory_allocated_gb']:.1f} GiB")  # the key says gb: a file contract
    for prefix in ("", "eval_"):  # --objective dpo: the reward margin and accuracy (TRL's names)
        if f"{prefix}rewards/margins" in rec:
            parts += [f"{prefix}margins {rec[f'{prefix}rewards/margins']:.4f}"]
            parts += [f"{prefix}accuracy {rec[f'{prefix}rewards/accuracies']:.2f}"]
        if f"{prefix}reward" in rec:  # --objective grpo: the mean reward, and the completions' length (TRL's names)
            parts.append(f"{prefix}reward {rec[f'{prefix}reward']:.4f}")
            parts.append(f"{prefix}length {rec[f'{prefix}completions/mean_length']:.1f}")
        if prefix == "" and "eval_loss" in rec:
            parts.append(f"eval_loss {rec['eval_loss']:.4f}")
            parts += [f"ppl {rec['perplexity']:.2f}"] if "perplexity" in rec else []
    return " | ".join(parts)


def perplexity(loss: float) -> float:
    return math.exp(min(loss, 50.0))


class MetricsWriter:
    """Appends one JSON object per record to <output_dir>/metrics.jsonl and sends its scalars to the --report_to trackers."""

    def __init__(
        self, output_dir: str, enabled: bool, report_to: Sequence[str] = (), resume_step: int | None = None
    ) -> None:
        """`report_to`: names from `trackers.resolve`; `resume_step`: the step resumed from, whose later records are dropped."""
        self.enabled = enabled
        self.path = Path(output_dir) / "metrics.jsonl"
        if enabled and resume_step is not None:
            self._truncate_after(resume_step)
        self.trackers = trackers.Trackers(list(report_to), output_dir, resume_step) if enabled and report_to else None

    def _truncate_after(self, step: int) -> None:
        """Drop records of steps past the resumed one (they will be redone); TensorBoard's purge_step does the same there."""
        if not self.path.exists():
            return
        keep = [
            line for line in self.path.read_text().splitlines() if line.strip() and json.loads(line)["step"] <= step
        ]
        self.path.write_text("".join(line + "\n" for line in keep))

    def write(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        if self.trackers is not None:
            self.trackers.log(record)

    def close(self, failed: bool = False) -> None:
        """Finish the trackers (`failed`: the run ends with an error); a second call does nothing."""
        if self.trackers is not None:
            self.trackers.close(failed)
            self.trackers = None


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def plot_losses(output_dir: str) -> Path | None:
    """loss.png: training loss per step and eval loss per evaluation."""
    path = Path(output_dir) / "metrics.jsonl"
    if not path.exists():
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(path)
    train = [(r["step"], r["loss"]) for r in records if "loss" in r]
    evals = [(r["step"], r["eval_loss"]) for r in records if "eval_loss" in r]
    fig, ax = plt.subplots(figsize=(7, 4))
    if train:
        ax.plot(*zip(*train), label="train loss")
    if evals:
        ax.plot(*zip(*evals), "o-", label="eval loss")
    ax.set_xlabel("optimizer step")
    preference = any("rewards/margins" in r for r in records)  # --objective dpo: a loss per pair, not per token
    ax.set_ylabel("preference loss (per pair)" if preference else "cross-entropy (nats/token)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    out = Path(output_dir) / "loss.png"
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out

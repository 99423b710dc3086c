"""Loss, tokens/s, MFU and memory → console, metrics.jsonl, TensorBoard, loss.png.

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
from pathlib import Path
from typing import Any, Iterator

import torch
from transformers import PretrainedConfig

logger = logging.getLogger(__name__)


def flops_per_token(config: PretrainedConfig, num_params_no_embedding: int, seq_len: int) -> float:
    """Training FLOPs per token: 6N for the matmuls (forward + backward) plus 12·L·H·T for attention."""
    layers = config.num_hidden_layers
    hidden = config.hidden_size
    return 6 * num_params_no_embedding + 12 * layers * hidden * seq_len


def mfu(tokens_per_second: float, flops_per_tok: float, peak_flops_per_device: float | None, world_size: int) -> float | None:
    if not peak_flops_per_device:
        return None
    return tokens_per_second * flops_per_tok / (peak_flops_per_device * world_size)


class ThroughputWindow:
    """Training time between two logged steps, less the pauses (evaluation, checkpoints) inside it:
    tokens/s counts training only, and the steps around a pause are not dropped from the window."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.start, self.paused, self.steps = time.perf_counter(), 0.0, 0

    def pause(self, seconds: float) -> None:
        self.paused += seconds

    def seconds(self) -> float:
        return max(time.perf_counter() - self.start - self.paused, 1e-9)

    def tokens_per_second(self, tokens_per_step: int) -> float:
        return tokens_per_step * self.steps / self.seconds()


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
    if device.type != "cuda":
        return None
    return torch.cuda.max_memory_allocated(device) / 2**30


def format_line(rec: dict[str, Any], max_steps: int) -> str:
    parts = [f"step {rec['step']}/{max_steps}"]
    if "loss" in rec:
        parts += [f"loss {rec['loss']:.4f}", f"lr {rec['learning_rate']:.2e}", f"grad_norm {rec['grad_norm']:.3f}",
                  f"{rec['tokens_per_second']:,.0f} tok/s"]
    if rec.get("mfu") is not None:
        parts.append(f"mfu {100 * rec['mfu']:.1f}%")
    if rec.get("max_memory_allocated_gb") is not None:
        parts.append(f"mem {rec['max_memory_allocated_gb']:.1f} GB")
    if "eval_loss" in rec:
        parts += [f"eval_loss {rec['eval_loss']:.4f}", f"ppl {rec['perplexity']:.2f}"]
    return " | ".join(parts)


def perplexity(loss: float) -> float:
    return math.exp(min(loss, 50.0))


class MetricsWriter:
    """Appends one JSON object per record to <output_dir>/metrics.jsonl and mirrors it to TensorBoard."""

    def __init__(self, output_dir: str, enabled: bool, tensorboard: bool) -> None:
        self.enabled = enabled
        self.path = Path(output_dir) / "metrics.jsonl"
        self.tb = None
        if enabled and tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(log_dir=str(Path(output_dir) / "runs"))

    def truncate_after(self, step: int) -> None:
        """On resume, drop records (and TensorBoard events) of steps past the checkpoint (they will be redone)."""
        if not self.enabled:
            return
        from anygpu.train.event_files import trim_after

        trim_after(self.path.parent / "runs", step)
        if not self.path.exists():
            return
        keep = [line for line in self.path.read_text().splitlines() if line.strip() and json.loads(line)["step"] <= step]
        self.path.write_text("".join(line + "\n" for line in keep))

    def write(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        if self.tb is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)) and value is not None:
                    self.tb.add_scalar(("eval/" if key in ("eval_loss", "perplexity") else "train/") + key, value, record["step"])
            self.tb.flush()

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
            self.tb = None


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
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    out = Path(output_dir) / "loss.png"
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out

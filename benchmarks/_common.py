"""Shared set-up of the benchmarks: one process, the engine's own data and model on this machine's device."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import anygpu  # noqa: E402

anygpu.set_offline_defaults()

from anygpu.config.args import parse_args  # noqa: E402
from anygpu.data.prepare import prepare  # noqa: E402
from anygpu.runtime import distributed  # noqa: E402


def setup(config_name: str, block_size: int, global_batch_size: int, extra: list[str] | None = None):
    """(model_args, data_args, train_args, info, prep) for the preset on 2 MB of the embedded corpus."""
    model_args, data_args, train_args = parse_args(
        [
            "--config_name",
            config_name,
            "--block_size",
            str(block_size),
            "--global_batch_size",
            str(global_batch_size),
            "--max_corpus_mb",
            "2",
            "--output_dir",
            "/tmp/anygpu-bench",
            "--report_to",
            "none",
            *(extra or []),
        ]
    )
    info = distributed.init_distributed()
    return model_args, data_args, train_args, info, prepare(model_args, data_args, train_args, info)

"""The run state a checkpoint holds beside the engine's own files, one schema for both engines: the step,
the global batch and the data order's size (which fix the position in the global order), the world and
mesh it was written on, and the strategy. The native engine keeps it in `trainer_state.json` (with the
scheduler), the HF engine in `anygpu_state.json` (beside Trainer's own `trainer_state.json`)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from anygpu.errors import UsageError
from anygpu.runtime.mesh import MeshShape

HF_STATE_FILE = "anygpu_state.json"  # the HF engine's, beside Trainer's own trainer_state.json


@dataclass(frozen=True)
class RunState:
    global_step: int  # optimizer steps done (1-based: the checkpoint's step)
    global_batch_size: int
    world_size: int  # processes it was written on (W = R·S·C; the data-parallel degree is W / C)
    seed: int
    num_train_samples: int
    total_steps: int
    dp_replicate: int | None = None  # native engine: the mesh (R × S) it was written on
    dp_shard: int | None = None
    cp: int | None = None  # native engine: context parallelism's C (1: none)
    strategy: str | None = None  # HF engine: the strategy family (ddp, fsdp, deepspeed, …)

    def to_json(self) -> dict[str, Any]:
        """The checkpoint's keys: the fields the engine has (None fields are not written)."""
        return {k: v for k, v in asdict(self).items() if v is not None}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RunState:
        names = cls.__dataclass_fields__
        return cls(**{k: v for k, v in data.items() if k in names})

    @classmethod
    def read(cls, checkpoint: Path, file: str) -> RunState | None:
        path = Path(checkpoint) / file
        return cls.from_json(json.loads(path.read_text())) if path.exists() else None

    @property
    def mesh(self) -> MeshShape:
        """The mesh (R × S × C) it was written on; a checkpoint from before HSDP has none: it was 1 × W × 1."""
        return MeshShape(self.dp_replicate or 1, self.dp_shard or self.world_size, self.cp or 1)

    def check_resumable(self, checkpoint: Path, global_batch_size: int) -> None:
        """Refuse a resume that would change the data order (another --global_batch_size)."""
        if self.global_batch_size != global_batch_size:
            raise UsageError(
                f"--resume_from_checkpoint {checkpoint}: trained with --global_batch_size {self.global_batch_size}; "
                f"resuming with {global_batch_size} would change the data order: pass --global_batch_size "
                f"{self.global_batch_size}."
            )

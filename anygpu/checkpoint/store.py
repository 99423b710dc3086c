"""Checkpoints: `checkpoint-<step>/` written under a temporary name and renamed when
complete; sharded model + optimizer through torch.distributed.checkpoint (reloadable on
any world size), plus scheduler, RNG, data position and arguments. The final export is
`anygpu.checkpoint.export`."""
from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import re
import shutil
import sys
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from anygpu.checkpoint import manifest
from anygpu.errors import SaveError, UsageError
from anygpu.runtime import distributed, faults, fs, progress

logger = logging.getLogger(__name__)

STATE_FILE = "trainer_state.json"
# Frozen parameters (a LoRA run's base) come from --model_name_or_path, not from the checkpoint.
STATE_DICT_OPTIONS = StateDictOptions(ignore_frozen_params=True)
CHECKPOINT_RE = re.compile(r"^checkpoint-(\d+)$")


def checkpoints(output_dir: str | Path) -> list[Path]:
    """Checkpoint folders, oldest first (temporary folders are never listed; damaged ones are: see `manifest`)."""
    root = Path(output_dir)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := CHECKPOINT_RE.match(p.name)) and p.is_dir()]
    return [p for _, p in sorted(found)]


def step_of(path: Path) -> int:
    return int(CHECKPOINT_RE.match(path.name).group(1))


def newest_intact(output_dir: str | Path) -> tuple[Path | None, list[str]]:
    """The newest checkpoint whose manifest checks out, and a warning for each newer one skipped."""
    skipped = []
    for ckpt in reversed(checkpoints(output_dir)):
        bad = manifest.problem(ckpt)
        if bad is None:
            return ckpt, skipped
        skipped.append(f"skipping {ckpt.name}: {bad}")
    return None, skipped


def resolve_resume(value: str | None, output_dir: str, warn: bool = True) -> Path | None:
    """The checkpoint to resume from: 'latest' or 'auto' (the newest intact one; auto: None when there is
    none), a path (refused naming the bad file when damaged), or after a torchrun restart the newest intact."""
    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
    if value in ("latest", "auto") or (not value and restarted):
        found, skipped = newest_intact(output_dir)
        if warn and int(os.environ.get("RANK", "0")) == 0:
            for line in skipped:
                print(f"warning: {line}", file=sys.stderr, flush=True)
        if found is not None or value != "latest":
            return found
        raise UsageError(f"--resume_from_checkpoint latest: no intact checkpoint in --output_dir {output_dir} "
                         "(use auto to start fresh when there is none).")
    if not value:
        return None
    path = Path(value)
    if not CHECKPOINT_RE.match(path.name) or not path.is_dir():
        raise UsageError(f"--resume_from_checkpoint {value}: not a checkpoint folder; use latest, auto or a "
                         "<output_dir>/checkpoint-<step> folder.")
    bad = manifest.problem(path)
    if bad is not None:
        raise UsageError(f"--resume_from_checkpoint {value}: {bad}; use latest to resume the newest intact checkpoint.")
    return path


def rotate(root: Path, keep: int | None, just_written: Path) -> None:
    """Keep-last-k: delete checkpoints older than `just_written` beyond the `keep` newest intact ones.
    Never the one just written, never a newer one, never the only loadable one."""
    if not keep:
        return
    found = checkpoints(root)
    intact = [c for c in found if c == just_written or manifest.problem(c, checksums=False) is None]
    keep_set = set(intact[-keep:]) | {just_written}
    for old in found:
        if old not in keep_set and step_of(old) < step_of(just_written):
            shutil.rmtree(old, ignore_errors=True)


def save(
    output_dir: str,
    step: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    trainer_state: dict[str, Any],
    save_total_limit: int | None,
    rank: int,
    extra_files: dict[str, dict[str, Any]] | None = None,
) -> Path:
    """Write checkpoint-<step> atomically on every rank's behalf; returns its path.

    Two steps: every rank writes its shards into `.checkpoint-<step>.tmp` (`write_shards`), then rank 0
    makes it a checkpoint (`finalize`). A full disk is a clear error and the previous checkpoint stays.
    """
    root = Path(output_dir)
    final = root / f"checkpoint-{step}"
    tmp = start(root, step, rank)
    with progress.protected(), _disk_errors(root, tmp, final, rank):
        write_shards(tmp, model, optimizer, rank)
        distributed.barrier()
        if rank == 0:
            state = {**trainer_state, "scheduler": scheduler.state_dict()}
            finalize(root, tmp, final, step, trainer_state.get("world_size", 1), "fsdp", save_total_limit,
                     {STATE_FILE: state, **(extra_files or {})})
    distributed.barrier()
    return final


def start(root: Path, step: int, rank: int) -> Path:
    """Rank 0 clears what a crash mid-save left and makes the temporary folder; every rank gets its path."""
    tmp = root / f".checkpoint-{step}.tmp"
    if rank == 0:
        for stale in root.glob(".checkpoint-*.tmp"):  # left by a crash mid-save
            shutil.rmtree(stale, ignore_errors=True)
        tmp.mkdir(parents=True)
    distributed.barrier()
    return tmp


def write_shards(tmp: Path, model: nn.Module, optimizer: torch.optim.Optimizer, rank: int) -> None:
    """This rank's part: its model and optimizer shards (DCP, collective) and its RNG state."""
    msd, osd = get_state_dict(model, optimizer, options=STATE_DICT_OPTIONS)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(tmp))
    save_rng(tmp, rank)
    faults.test_fault("save", int(tmp.name.split("-")[1].split(".")[0]))


def save_rng(tmp: Path, rank: int) -> None:
    """This rank's RNG states, beside the shards (a rank that did not exist at save time keeps its seed)."""
    (tmp / "rng").mkdir(exist_ok=True)
    torch.save(_rng_state(), tmp / "rng" / f"rank-{rank}.pt")


def finalize(root: Path, tmp: Path, final: Path, step: int, world_size: int, engine: str,
             save_total_limit: int | None, json_files: dict[str, dict[str, Any]]) -> None:
    """Rank 0, once every rank's files are in `tmp`: state files, manifest (last; fsyncs every file),
    atomic rename to `final`, rotation. Also the end of an asynchronous save."""
    for name, data in json_files.items():
        fs.write_json(tmp / name, data)
    manifest.write(tmp, step, world_size, engine)
    fs.fsync_path(tmp)
    fs.replace_dir(tmp, final)
    fs.fsync_path(root)
    rotate(root, save_total_limit, final)


@contextlib.contextmanager
def _disk_errors(root: Path, tmp: Path, final: Path, rank: int) -> Iterator[None]:
    """A full disk (or quota) while saving: remove the partial folder and say so; the previous checkpoint stays."""
    try:
        yield
    except OSError as e:
        if e.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        previous = [c.name for c in checkpoints(root) if c != final]
        raise SaveError(
            f"no space left on the device of {root} while writing {final.name} ({e}): the partial folder was removed"
            f" and {previous[-1] if previous else 'no earlier checkpoint'} is intact; free space (or lower "
            "--save_total_limit) and resume with --resume_from_checkpoint latest."
        ) from e


def load(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any, rank: int) -> dict[str, Any]:
    """Restore model, optimizer, scheduler and this rank's RNG; return the trainer state."""
    msd, osd = get_state_dict(model, optimizer, options=STATE_DICT_OPTIONS)
    state_dict = {"model": msd, "optim": osd}
    dcp.load(state_dict, checkpoint_id=str(path))
    set_state_dict(model, optimizer, model_state_dict=state_dict["model"], optim_state_dict=state_dict["optim"],
                   # strict=False: the frozen keys are absent by design; dcp.load above already failed on any other
                   options=StateDictOptions(ignore_frozen_params=True, strict=False))
    state = json.loads((path / STATE_FILE).read_text())
    scheduler.load_state_dict(state["scheduler"])
    rng_file = path / "rng" / f"rank-{rank}.pt"
    if rng_file.exists():  # a rank that did not exist at save time keeps its fresh seed
        _set_rng_state(torch.load(rng_file, weights_only=True))
    return state


def _rng_state() -> dict[str, torch.Tensor]:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


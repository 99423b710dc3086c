"""Checkpoints: `checkpoint-<step>/` written under a temporary name and renamed when
complete; sharded model + optimizer through torch.distributed.checkpoint (reloadable on
any world size), plus scheduler, RNG, data position and arguments. The final export is
`anygpu.checkpoint.export`. A full disk is one error and leaves nothing half-written (`disk_errors`,
`anygpu.checkpoint.disk_space`); a damaged checkpoint is moved aside, never deleted (`set_aside`)."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from anygpu.checkpoint import disk_space, manifest
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


ELASTIC_VARIABLE = "ANYGPU_ELASTIC"  # MIN:MAX; the launchers export it for an elastic node count


def restarted() -> bool:
    """Whether this start continues the run by itself (as `auto` does): the workers of a torchrun restart, or of
    an elastic job (ANYGPU_ELASTIC, which the launchers export for NNODES=MIN:MAX), where a membership change
    restarts the workers without counting a restart and a node that joins starts at restart count 0."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0 or bool(os.environ.get(ELASTIC_VARIABLE))


def resolve_resume(value: str | None, output_dir: str, warn: bool = True) -> Path | None:
    """The checkpoint to resume from: 'latest' or 'auto' (the newest intact one; auto: None when there is
    none), a path (refused naming the bad file when damaged), or after a torchrun restart (`restarted`) the
    newest intact."""
    if value in ("latest", "auto") or (not value and restarted()):
        found, skipped = newest_intact(output_dir)
        if warn and int(os.environ.get("RANK", "0")) == 0:
            for line in skipped:
                print(f"warning: {line}", file=sys.stderr, flush=True)
        if found is not None or value != "latest":
            return found
        damaged = f" ({', '.join(c.name for c in checkpoints(output_dir))} damaged)" if skipped else ""
        raise UsageError(
            f"--resume_from_checkpoint latest: no intact checkpoint in --output_dir {output_dir}{damaged} "
            "(use auto to start fresh when there is none)."
        )
    if not value:
        return None
    path = Path(value)
    if not CHECKPOINT_RE.match(path.name) or not path.is_dir():
        raise UsageError(
            f"--resume_from_checkpoint {value}: not a checkpoint folder; use latest, auto or a "
            "<output_dir>/checkpoint-<step> folder."
        )
    bad = manifest.problem(path)
    if bad is not None:
        raise UsageError(f"--resume_from_checkpoint {value}: {bad}; use latest to resume the newest intact checkpoint.")
    return path


def set_aside(root: Path, ckpts: list[Path], why: str) -> Path | None:
    """Move checkpoints to <output_dir>/abandoned/<time>/ (never deleted: a damaged one may still hold what a
    user wants to salvage) and say so; returns that folder."""
    if not ckpts:
        return None
    dest = root / "abandoned" / time.strftime("%Y%m%d-%H%M%S")
    dest.mkdir(parents=True, exist_ok=True)
    for c in ckpts:
        target = dest / c.name
        n = 1
        while target.exists():  # the same name set aside twice within a second
            target, n = dest / f"{c.name}.{n}", n + 1
        os.replace(c, target)
    print(f"warning: moved {', '.join(c.name for c in ckpts)} aside to {dest} ({why})", file=sys.stderr, flush=True)
    return dest


def rotate(root: Path, keep: int | None, just_written: Path) -> None:
    """Keep-last-k: delete intact checkpoints older than `just_written` beyond the `keep` newest intact ones,
    and move the damaged ones among them aside. Never the one just written, never a newer one, never the only
    loadable one."""
    if not keep:
        return
    found = checkpoints(root)
    intact = [c for c in found if c == just_written or manifest.problem(c, checksums=False) is None]
    keep_set = set(intact[-keep:]) | {just_written}
    old = [c for c in found if c not in keep_set and step_of(c) < step_of(just_written)]
    for c in old:
        if c in intact:
            shutil.rmtree(c, ignore_errors=True)
    set_aside(root, [c for c in old if c not in intact], "damaged, rotated out by --save_total_limit")


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
    watched: progress.Progress | None = None,
) -> Path:
    """Write checkpoint-<step> atomically on every rank's behalf; returns its path (`watched`: the run's
    progress, which the preemption watchdog reads: the save holds it off).

    Two steps: every rank writes its shards into `.checkpoint-<step>.tmp` (`write_shards`), then rank 0
    makes it a checkpoint (`finalize`). A full disk is a clear error and the previous checkpoint stays.
    """
    root = Path(output_dir)
    final = root / f"checkpoint-{step}"
    state_dict = sharded_state_dict(model, optimizer)
    needed = needed_bytes(root, state_dict, trainer_state.get("world_size", 1))
    tmp = start(root, step, rank, needed)
    with progress.protected(watched), disk_errors(root, tmp, final, rank, needed):
        write_shards(tmp, state_dict, rank)
        distributed.barrier()
        if rank == 0:
            state = {**trainer_state, "scheduler": scheduler.state_dict()}
            finalize(
                root,
                tmp,
                final,
                step,
                trainer_state.get("world_size", 1),
                "fsdp",
                save_total_limit,
                {STATE_FILE: state, **(extra_files or {})},
            )
    distributed.barrier()
    return final


def sharded_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """What DCP writes: this rank's model and optimizer shards (frozen parameters left out)."""
    msd, osd = get_state_dict(model, optimizer, options=STATE_DICT_OPTIONS)
    return {"model": msd, "optim": osd}


def needed_bytes(root: Path, state_dict: dict[str, Any], world_size: int) -> int:
    """The next checkpoint's size: the newest one's (from its manifest), else this rank's shards × the ranks."""
    found = checkpoints(root)
    return disk_space.needed_bytes(found[-1] if found else None, _tensor_bytes(state_dict) * world_size)


def _tensor_bytes(tree: Any) -> int:
    if isinstance(tree, dict):
        return sum(_tensor_bytes(v) for v in tree.values())
    if isinstance(tree, (list, tuple)):
        return sum(_tensor_bytes(v) for v in tree)
    if isinstance(tree, torch.Tensor):
        t = tree.to_local() if hasattr(tree, "to_local") else tree  # a DTensor: this rank's shard
        return t.numel() * t.element_size()
    return 0


def start(root: Path, step: int, rank: int, needed: int | None = None) -> Path:
    """Rank 0 clears what a crash mid-save left, checks the free space against `needed` bytes (when known) and
    makes the temporary folder; every rank gets its path, or the same SaveError when the space is short."""
    tmp = root / f".checkpoint-{step}.tmp"
    short = None
    if rank == 0:
        for stale in root.glob(".checkpoint-*.tmp"):  # left by a crash mid-save
            shutil.rmtree(stale, ignore_errors=True)
        short = disk_space.shortfall(root, root / f"checkpoint-{step}", needed)
        if short is None:
            tmp.mkdir(parents=True)
    short = distributed.broadcast_object(short)  # also the barrier: the folder exists for every rank
    if short is not None:
        raise SaveError(short, on_every_rank=True)
    return tmp


def write_shards(tmp: Path, state_dict: dict[str, Any], rank: int) -> None:
    """This rank's part: its model and optimizer shards (DCP, collective) and its RNG state."""
    dcp.save(state_dict, checkpoint_id=str(tmp))
    save_rng(tmp, rank)
    faults.at("save", int(tmp.name.split("-")[1].split(".")[0]))


def save_rng(tmp: Path, rank: int) -> None:
    """This rank's RNG states, beside the shards (a rank that did not exist at save time keeps its seed)."""
    (tmp / "rng").mkdir(exist_ok=True)
    torch.save(_rng_state(), tmp / "rng" / f"rank-{rank}.pt")


def finalize(
    root: Path,
    tmp: Path,
    final: Path,
    step: int,
    world_size: int,
    engine: str,
    save_total_limit: int | None,
    json_files: dict[str, dict[str, Any]],
) -> None:
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
def disk_errors(root: Path, tmp: Path, final: Path, rank: int, needed: int | None) -> Iterator[None]:
    """A full disk (or quota) while saving, however the writer reports it (an OSError, DCP's CheckpointException,
    torch.save's or safetensors' own errors): remove the partial folder and raise one SaveError naming the
    folder and the bytes needed; the previous checkpoints stay."""
    try:
        yield
    except SaveError:
        raise
    except (Exception, CheckpointException) as e:
        cause = disk_space.disk_full_cause(e)
        if cause is None and disk_space.shortfall(root, final, max(needed or 0, 1 << 20)) is None:
            raise  # not a full disk (one with under 1 MiB free counts, whatever its writer said)
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        intact = [c.name for c in checkpoints(root) if c != final]
        collective = isinstance(e, CheckpointException)  # DCP raises it on every rank alike
        error = disk_space.full_disk_error(root, final, needed, cause or e, intact[-1] if intact else None)
        raise SaveError(str(error), on_every_rank=collective) from e


def load(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any, rank: int) -> dict[str, Any]:
    """Restore model, optimizer, scheduler and this rank's RNG; return the trainer state."""
    msd, osd = get_state_dict(model, optimizer, options=STATE_DICT_OPTIONS)
    state_dict = {"model": msd, "optim": osd}
    dcp.load(state_dict, checkpoint_id=str(path))
    set_state_dict(
        model,
        optimizer,
        model_state_dict=state_dict["model"],
        optim_state_dict=state_dict["optim"],
        # strict=False: the frozen keys are absent by design; dcp.load above already failed on any other
        options=StateDictOptions(ignore_frozen_params=True, strict=False),
    )
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

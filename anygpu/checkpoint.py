"""Checkpoints: `checkpoint-<step>/` written under a temporary name and renamed when
complete; sharded model + optimizer through torch.distributed.checkpoint (reloadable on
any world size), plus scheduler, RNG, data position and arguments. Final export to
safetensors, gathering one tensor at a time."""
from __future__ import annotations

import json
import logging
import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from anygpu import distributed

logger = logging.getLogger(__name__)

STATE_FILE = "trainer_state.json"
# Frozen parameters (a LoRA run's base) come from --model_name_or_path, not from the checkpoint.
_OPTIONS = StateDictOptions(ignore_frozen_params=True)
CHECKPOINT_RE = re.compile(r"^checkpoint-(\d+)$")


def checkpoints(output_dir: str | Path) -> list[Path]:
    """Complete checkpoints, oldest first (temporary folders are never listed)."""
    root = Path(output_dir)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := CHECKPOINT_RE.match(p.name)) and (p / STATE_FILE).exists()]
    return [p for _, p in sorted(found)]


def resolve_resume(value: str | None, output_dir: str) -> Path | None:
    """The checkpoint to resume from: 'latest', a path, or (after a torchrun restart) the latest if any."""
    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
    if value is None or value == "":
        return checkpoints(output_dir)[-1] if restarted and checkpoints(output_dir) else None
    if value in ("latest", "auto"):
        found = checkpoints(output_dir)
        if found:
            return found[-1]
        if value == "auto":
            return None
        raise ValueError(f"--resume_from_checkpoint latest: no checkpoint in --output_dir {output_dir} (use auto to start fresh when none).")
    path = Path(value)
    if not (path / STATE_FILE).exists():
        raise ValueError(f"--resume_from_checkpoint {value}: not a complete checkpoint folder (no {STATE_FILE}); use latest or a checkpoint-<step> folder.")
    return path


def replace_dir(tmp: Path, final: Path) -> None:
    if final.exists():
        old = final.with_name(f".{final.name}.old")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)


def save(
    output_dir: str,
    step: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    trainer_state: dict[str, Any],
    save_total_limit: int | None,
    rank: int,
) -> Path:
    """Write checkpoint-<step> atomically on every rank's behalf; returns its path."""
    root = Path(output_dir)
    final = root / f"checkpoint-{step}"
    tmp = root / f".checkpoint-{step}.tmp"
    if rank == 0:
        for stale in root.glob(".checkpoint-*.tmp"):  # left by a crash mid-save
            shutil.rmtree(stale, ignore_errors=True)
        tmp.mkdir(parents=True)
    distributed.barrier()
    msd, osd = get_state_dict(model, optimizer, options=_OPTIONS)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(tmp))
    (tmp / "rng").mkdir(exist_ok=True)
    torch.save(_rng_state(), tmp / "rng" / f"rank-{rank}.pt")
    distributed.barrier()
    if rank == 0:
        state = {**trainer_state, "scheduler": scheduler.state_dict()}
        write_json(tmp / STATE_FILE, state)  # last file: its presence marks the checkpoint complete
        fsync_dir(tmp)
        replace_dir(tmp, final)
        fsync_dir(root)
        if save_total_limit:
            for old in checkpoints(root)[:-save_total_limit]:
                shutil.rmtree(old, ignore_errors=True)
    distributed.barrier()
    return final


def load(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any, rank: int) -> dict[str, Any]:
    """Restore model, optimizer, scheduler and this rank's RNG; return the trainer state."""
    msd, osd = get_state_dict(model, optimizer, options=_OPTIONS)
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


def write_json(path: Path, data: dict[str, Any]) -> None:
    with path.open("w") as f:
        json.dump(data, f, indent=2, default=str)
        f.flush()
        os.fsync(f.fileno())


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def export_safetensors(
    model: nn.Module, config: Any, tokenizer: Any, out_dir: str | Path, rank: int, max_shard_bytes: int = 4 * 2**30
) -> Path:
    """<out_dir> as Hugging Face safetensors + config + tokenizer.

    Each sharded parameter is all-gathered alone and written by rank 0 into shards of at most
    `max_shard_bytes`, so no process ever holds the whole model.
    """
    from safetensors.torch import save_file
    from torch.distributed.tensor import DTensor

    out = Path(out_dir)
    tmp = out.with_name(f".{out.name}.tmp")
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    shard: dict[str, torch.Tensor] = {}
    files: list[list[str]] = []
    total = 0

    def flush() -> None:
        nonlocal shard
        if shard and rank == 0:
            save_file(shard, str(tmp / f"part-{len(files):05d}.safetensors"), metadata={"format": "pt"})
            files.append(list(shard))
        shard = {}

    # named_parameters() lists a tied weight once, under its first name (the input embedding), as
    # HF stores it; state_dict() also lists the alias (lm_head.weight), which is skipped here.
    params = dict(model.named_parameters())
    buffers = dict(model.named_buffers())
    for name in model.state_dict().keys():
        tensor = params.get(name, buffers.get(name))
        if tensor is None:
            continue
        with torch.no_grad():
            full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
        if rank == 0:
            t = full.detach().to("cpu").contiguous()
            if sum(v.numel() * v.element_size() for v in shard.values()) + t.numel() * t.element_size() > max_shard_bytes:
                flush()
            shard[name] = t
            total += t.numel() * t.element_size()
        del full
    flush()
    if rank == 0:
        _name_shards(tmp, files, total)
        config.save_pretrained(str(tmp))
        if getattr(model, "generation_config", None) is not None:
            model.generation_config.save_pretrained(str(tmp))
        if tokenizer is not None:
            tokenizer.save_pretrained(str(tmp))
        replace_dir(tmp, out)
    distributed.barrier()
    return out


def _name_shards(folder: Path, files: list[list[str]], total_bytes: int) -> None:
    """HF names: model.safetensors, or model-0000i-of-0000n.safetensors plus an index."""
    n = len(files)
    if n == 1:
        os.replace(folder / "part-00000.safetensors", folder / "model.safetensors")
        return
    weight_map = {}
    for i, keys in enumerate(files):
        name = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        os.replace(folder / f"part-{i:05d}.safetensors", folder / name)
        weight_map.update({k: name for k in keys})
    write_json(folder / "model.safetensors.index.json", {"metadata": {"total_size": total_bytes}, "weight_map": weight_map})

"""Nothing lost, without training: verified checkpoints, repairs, rotation, rewinds, a used output_dir,
the output_dir lock, TensorBoard's purge on resume and a full disk. Checkpoint folders here are real folders
with a real manifest; the engines' own runs are in test_faults.py."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from anygpu.checkpoint import manifest, store
from anygpu.errors import SaveError, UsageError
from anygpu.reliability import run_guard


def fake_checkpoint(root: Path, step: int, payload: bytes = b"weights") -> Path:
    """checkpoint-<step> as finalize makes it: files, then the manifest, then the rename."""
    tmp = root / f".checkpoint-{step}.tmp"
    tmp.mkdir(parents=True)
    (tmp / "__0_0.distcp").write_bytes(payload * 100)
    store.finalize(
        root, tmp, root / f"checkpoint-{step}", step, 2, "fsdp", None, {store.STATE_FILE: {"global_step": step}}
    )
    return root / f"checkpoint-{step}"


def args(root: Path, **kw) -> SimpleNamespace:
    base = dict(output_dir=str(root), resume_from_checkpoint=None, overwrite_output_dir=False, allow_rewind=False)
    return SimpleNamespace(**{**base, **kw})


def names(root: Path) -> list[str]:
    return [c.name for c in store.checkpoints(root)]


# ---------------------------------------------------------------------- verified checkpoints
@pytest.mark.parametrize("damage", ["truncate", "flip", "delete", "no-manifest"])
def test_latest_skips_a_damaged_checkpoint_and_the_path_form_refuses_it(tmp_path, damage, capsys):
    good, bad = fake_checkpoint(tmp_path, 3), fake_checkpoint(tmp_path, 6)
    shard = bad / "__0_0.distcp"
    if damage == "truncate":
        shard.write_bytes(shard.read_bytes()[:-10])
    elif damage == "flip":
        data = bytearray(shard.read_bytes())
        data[17] ^= 0xFF
        shard.write_bytes(bytes(data))
    elif damage == "delete":
        shard.unlink()
    else:
        (bad / manifest.MANIFEST).unlink()
    assert store.resolve_resume("latest", str(tmp_path)) == good
    warning = capsys.readouterr().err
    assert "skipping checkpoint-6" in warning
    named = "manifest.json" if damage == "no-manifest" else "__0_0.distcp"
    assert named in warning
    with pytest.raises(UsageError, match=f"--resume_from_checkpoint {bad}: .*{named}.*use latest"):
        store.resolve_resume(str(bad), str(tmp_path))
    assert store.resolve_resume(str(good), str(tmp_path)) == good


def test_auto_starts_fresh_when_nothing_is_intact_and_latest_refuses(tmp_path):
    assert store.resolve_resume("auto", str(tmp_path)) is None
    with pytest.raises(UsageError, match="latest: no intact checkpoint.*use auto"):
        store.resolve_resume("latest", str(tmp_path))


def test_a_half_replaced_checkpoint_is_recovered_at_start_up(tmp_path):
    """A crash between the two renames of replace_dir: `.checkpoint-N.old` and no checkpoint-N."""
    ckpt = fake_checkpoint(tmp_path, 4)
    os.replace(ckpt, tmp_path / ".checkpoint-4.old")  # what the first rename leaves
    run_guard.claim_output_dir(args(tmp_path, resume_from_checkpoint="latest"), rank=0)
    assert names(tmp_path) == ["checkpoint-4"] and manifest.problem(tmp_path / "checkpoint-4") is None
    assert not list(tmp_path.glob(".*.old"))
    # the second rename happened too: the stale .old is removed, the new one kept
    (tmp_path / ".checkpoint-4.old").mkdir()
    run_guard.release_locks()
    run_guard.claim_output_dir(args(tmp_path, resume_from_checkpoint="latest"), rank=0)
    assert not list(tmp_path.glob(".*.old")) and names(tmp_path) == ["checkpoint-4"]
    run_guard.release_locks()


# ---------------------------------------------------------------------- rotation and rewinds
def test_rotation_never_deletes_the_checkpoint_just_written(tmp_path):
    """The defect: with 100/200/300 on disk, saving 110 with a limit of 2 deleted 100 and 110."""
    for step in (100, 200, 300):
        fake_checkpoint(tmp_path, step)
    tmp = tmp_path / ".checkpoint-110.tmp"
    tmp.mkdir()
    store.finalize(tmp_path, tmp, tmp_path / "checkpoint-110", 110, 1, "fsdp", 2, {"trainer_state.json": {}})
    assert "checkpoint-110" in names(tmp_path) and "checkpoint-300" in names(tmp_path)


def test_keep_last_k_keeps_the_only_loadable_checkpoint(tmp_path):
    fake_checkpoint(tmp_path, 2)
    for step in (4, 6):
        (fake_checkpoint(tmp_path, step) / manifest.MANIFEST).write_text("{")  # damaged
    fake_checkpoint(tmp_path, 8)
    store.rotate(tmp_path, 2, tmp_path / "checkpoint-8")
    assert names(tmp_path) == ["checkpoint-2", "checkpoint-8"]


def test_a_rewind_is_refused_naming_the_newer_checkpoints_and_the_option(tmp_path):
    for step in (100, 200, 300):
        fake_checkpoint(tmp_path, step)
    old = str(tmp_path / "checkpoint-100")
    with pytest.raises(
        UsageError, match=r"newer checkpoints exist \(checkpoint-200, checkpoint-300\).*--allow_rewind true"
    ):
        run_guard.claim_output_dir(args(tmp_path, resume_from_checkpoint=old), rank=0)
    run_guard.release_locks()
    run_guard.claim_output_dir(args(tmp_path, resume_from_checkpoint=old, allow_rewind=True), rank=0)
    run_guard.release_locks()
    assert names(tmp_path) == ["checkpoint-100"]
    assert sorted(p.name for p in (tmp_path / "abandoned").glob("*/checkpoint-*")) == [
        "checkpoint-200",
        "checkpoint-300",
    ]
    fake_checkpoint(tmp_path, 110)
    store.rotate(tmp_path, 2, tmp_path / "checkpoint-110")
    assert names(tmp_path) == ["checkpoint-100", "checkpoint-110"]
    assert store.resolve_resume("latest", str(tmp_path)).name == "checkpoint-110"


# ---------------------------------------------------------------------- a used output_dir and the lock
def test_resuming_another_runs_checkpoint_into_a_used_output_dir_is_refused(tmp_path):
    """A checkpoint of run x, resumed by path into run y's --output_dir: y's metrics and checkpoints would mix with
    x's continuation (latest and rotation then take them for one run). Refused as a fresh run there is; into an
    empty folder (a fork of x) it is fine, and --overwrite_output_dir clears y first."""
    other, mine, fresh = tmp_path / "x", tmp_path / "y", tmp_path / "z"
    target = fake_checkpoint(other, 2)
    fake_checkpoint(mine, 1)
    (mine / "metrics.jsonl").write_text('{"step": 1, "loss": 9.0}\n')
    with pytest.raises(UsageError, match=f"--output_dir {mine} already holds a run .*--overwrite_output_dir true"):
        run_guard.claim_output_dir(args(mine, resume_from_checkpoint=str(target)), rank=0)
    run_guard.release_locks()
    assert run_guard.claim_output_dir(args(fresh, resume_from_checkpoint=str(target)), rank=0).resume == target
    run_guard.release_locks()
    claim = run_guard.claim_output_dir(args(mine, resume_from_checkpoint=str(target), overwrite_output_dir=True), 0)
    run_guard.release_locks()
    assert claim.resume == target and not (mine / "metrics.jsonl").exists() and names(mine) == []


def test_a_fresh_run_into_a_used_output_dir_is_refused(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 9.0}\n')
    (tmp_path / "runs").mkdir()
    with pytest.raises(UsageError, match=f"--output_dir {tmp_path} already holds a run.*--overwrite_output_dir"):
        run_guard.claim_output_dir(args(tmp_path), rank=0)
    run_guard.release_locks()
    run_guard.claim_output_dir(args(tmp_path, overwrite_output_dir=True), rank=0)
    run_guard.release_locks()
    assert not (tmp_path / "metrics.jsonl").exists() and not (tmp_path / "runs").exists()
    run_guard.claim_output_dir(args(tmp_path), rank=0)  # an empty folder (or one with only a lock) is fine
    run_guard.release_locks()


def test_one_writer_per_output_dir(tmp_path, capsys):
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (tmp_path / run_guard.LOCK).write_text(json.dumps({"host": os.uname().nodename, "pid": sleeper.pid}))
        with pytest.raises(UsageError, match=f"in use by another run \\(process {sleeper.pid} on"):
            run_guard.claim_output_dir(args(tmp_path), rank=0)
    finally:
        sleeper.kill()
        sleeper.wait()
    run_guard.claim_output_dir(args(tmp_path), rank=0)  # the holder is gone: taken over with a warning
    assert f"taking over the lock {tmp_path / run_guard.LOCK} of process {sleeper.pid}" in capsys.readouterr().err
    assert json.loads((tmp_path / run_guard.LOCK).read_text())["pid"] == os.getpid()
    run_guard.release_locks()
    assert not (tmp_path / run_guard.LOCK).exists()


def test_a_killed_holder_not_yet_reaped_holds_no_lock(tmp_path, capsys):
    """A rank SIGKILLed with its launcher is a zombie until init reaps it (seconds in some containers), and a zombie
    still answers signal 0: the next run takes the lock over instead of calling the folder in use."""
    zombie = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.monotonic() + 30
    while Path(f"/proc/{zombie.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
        assert time.monotonic() < deadline, "the child never ended"
        time.sleep(0.01)  # ended, not reaped: Popen waits only when asked
    try:
        (tmp_path / run_guard.LOCK).write_text(json.dumps({"host": os.uname().nodename, "pid": zombie.pid}))
        run_guard.claim_output_dir(args(tmp_path), rank=0)
        assert f"of process {zombie.pid}" in capsys.readouterr().err
        run_guard.release_locks()
    finally:
        zombie.wait()


def test_tensorboard_events_past_the_resumed_step_are_dropped(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from anygpu.train.metrics import MetricsWriter

    w = MetricsWriter(str(tmp_path), True, ["tensorboard"])
    for step in range(1, 9):
        w.write({"step": step, "loss": 10.0 - step})
    w.close()
    w = MetricsWriter(str(tmp_path), True, ["tensorboard"], resume_step=5)  # resumed at 5: steps 6-8 are redone
    for step in (6, 7):
        w.write({"step": step, "loss": 100.0 + step})
    w.close()
    acc = EventAccumulator(str(tmp_path / "runs"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("train/loss")] == [
        (1, 9),
        (2, 8),
        (3, 7),
        (4, 6),
        (5, 5),
        (6, 106),
        (7, 107),
    ]
    assert [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [
        1,
        2,
        3,
        4,
        5,
        6,
        7,
    ]


# ---------------------------------------------------------------------- nothing left behind
def test_a_one_process_run_leaves_nothing_in_the_temp_folder(tmp_path):
    """Plain `python script.py` makes a one-rank group whose store is a file in the temp folder: hundreds of
    runs on a shared machine must not leave hundreds of folders there."""
    code = "from anygpu.runtime import distributed; print(distributed.init_distributed().world_size)"
    proc = subprocess.run(
        [sys.executable, "-c", code], env={**os.environ, "TMPDIR": str(tmp_path)}, capture_output=True, text=True
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "1", proc.stderr
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------------- a full disk
def test_a_full_disk_while_saving_is_a_clear_error_and_the_previous_checkpoint_stays(tmp_path, monkeypatch):
    import torch

    from anygpu.config.args import TrainArguments
    from anygpu.runtime import distributed
    from anygpu.train import optim

    distributed.init_distributed()  # a one-rank gloo group, as under plain python
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters())
    sched = optim.build_scheduler(opt, TrainArguments(report_to=[]), 10)
    first = store.save(str(tmp_path), 1, model, opt, sched, {"global_step": 1}, 2, 0)

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(store.dcp, "save", full)
    with pytest.raises(SaveError, match="no space left .* checkpoint-2 .* checkpoint-1 is intact; free space"):
        store.save(str(tmp_path), 2, model, opt, sched, {"global_step": 2}, 2, 0)
    assert names(tmp_path) == ["checkpoint-1"] and manifest.problem(first) is None
    assert not list(tmp_path.glob(".checkpoint-*"))


# ---------------------------------------------------------------------- auto: intact, damaged and mixed checkpoints
def damage(ckpt: Path) -> None:
    shard = ckpt / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:-10])


def claim(root: Path, **kw) -> run_guard.Claim | None:
    try:
        return run_guard.claim_output_dir(args(root, **kw), rank=0)
    finally:
        run_guard.release_locks()


def abandoned(root: Path) -> list[str]:
    return sorted(p.name for p in (root / "abandoned").glob("*/checkpoint-*"))


def test_auto_resumes_the_newest_of_intact_checkpoints(tmp_path):
    for step in (2, 4):
        fake_checkpoint(tmp_path, step)
    (tmp_path / "metrics.jsonl").write_text('{"step": 4, "loss": 1.0}\n')
    claim(tmp_path, resume_from_checkpoint="auto")
    assert names(tmp_path) == ["checkpoint-2", "checkpoint-4"] and (tmp_path / "metrics.jsonl").exists()
    assert store.resolve_resume("auto", str(tmp_path)).name == "checkpoint-4"


def test_auto_over_mixed_checkpoints_resumes_the_newest_intact_and_moves_the_damaged_aside(tmp_path, capsys):
    for step in (2, 4, 6):
        fake_checkpoint(tmp_path, step)
    damage(tmp_path / "checkpoint-6")
    claim(tmp_path, resume_from_checkpoint="auto")
    err = capsys.readouterr().err
    assert "skipping checkpoint-6" in err and "moved checkpoint-6 aside" in err
    assert names(tmp_path) == ["checkpoint-2", "checkpoint-4"] and abandoned(tmp_path) == ["checkpoint-6"]
    assert store.resolve_resume("auto", str(tmp_path)).name == "checkpoint-4"


@pytest.mark.parametrize("how", ["auto", "torchelastic restart"])
def test_auto_with_only_damaged_checkpoints_stops_naming_them_and_deletes_nothing(tmp_path, how, monkeypatch):
    """The defect: auto (or a restarted worker) found no intact checkpoint, deleted every one and trained from 0."""
    for step in (2, 4):
        damage(fake_checkpoint(tmp_path, step))
    (tmp_path / "metrics.jsonl").write_text('{"step": 4, "loss": 1.0}\n')
    resume = "auto"
    if how != "auto":
        monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
        resume = None
    with pytest.raises(
        UsageError, match=r"no intact checkpoint.*checkpoint-2.*checkpoint-4.*--overwrite_output_dir true"
    ):
        claim(tmp_path, resume_from_checkpoint=resume)
    assert names(tmp_path) == ["checkpoint-2", "checkpoint-4"] and (tmp_path / "metrics.jsonl").exists()


def test_overwrite_moves_damaged_checkpoints_aside_never_deletes_them(tmp_path, capsys):
    for step in (2, 4):
        damage(fake_checkpoint(tmp_path, step))
    claim(tmp_path, resume_from_checkpoint="auto", overwrite_output_dir=True)
    assert names(tmp_path) == [] and abandoned(tmp_path) == ["checkpoint-2", "checkpoint-4"]
    assert "moved checkpoint-2, checkpoint-4 aside" in capsys.readouterr().err
    assert store.resolve_resume("auto", str(tmp_path)) is None  # a fresh start


def test_rotation_moves_a_damaged_checkpoint_aside(tmp_path):
    fake_checkpoint(tmp_path, 2)
    damage(fake_checkpoint(tmp_path, 4))
    for step in (6, 8):
        fake_checkpoint(tmp_path, step)
    store.rotate(tmp_path, 2, tmp_path / "checkpoint-8")
    assert names(tmp_path) == ["checkpoint-6", "checkpoint-8"] and abandoned(tmp_path) == ["checkpoint-4"]


# ---------------------------------------------------------------------- verified once
def test_the_resume_checkpoint_is_hashed_once(tmp_path, monkeypatch):
    """Rank 0 verifies at start-up; the engine takes that verdict instead of hashing again (other ranks get it
    broadcast: tests/test_fast_paths.py counts on two ranks)."""
    fake_checkpoint(tmp_path, 2)
    hashed = []
    real = manifest.sha256
    monkeypatch.setattr(manifest, "sha256", lambda p: hashed.append(p.name) or real(p))
    claimed = claim(tmp_path, resume_from_checkpoint="latest")  # rank 0's verdict, handed on, not stashed
    assert run_guard.agreed_resume("latest", str(tmp_path), claimed).name == "checkpoint-2"
    files = len(manifest.read(tmp_path / "checkpoint-2")["files"])
    assert len(hashed) == files, hashed


# ---------------------------------------------------------------------- a full disk, at write time
def tiny_training_state():
    import torch

    from anygpu.config.args import TrainArguments
    from anygpu.runtime import distributed
    from anygpu.train import optim

    distributed.init_distributed()  # a one-rank gloo group, as under plain python
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.ones(2, 64)).sum().backward()
    opt.step()  # AdamW's moments exist: the state a checkpoint holds
    sched = optim.build_scheduler(opt, TrainArguments(report_to=[]), 10)
    return model, opt, sched


def fill_the_disk_after(monkeypatch, nbytes: int) -> None:
    """DCP's writer puts `nbytes` of a shard on disk, then the device is full (as a real write fails)."""
    from torch.distributed.checkpoint import filesystem

    def write_item(transforms, stream, data, *a, **k):
        stream.write(b"\0" * nbytes)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(filesystem, "_write_item", write_item)


def needed_bytes(message: str) -> int:
    import re

    return int(re.search(r"needs about ([\d,]+) bytes", message).group(1).replace(",", ""))


@pytest.mark.parametrize("background", [False, True])
def test_a_full_disk_inside_the_checkpoint_writer_is_one_clear_error(tmp_path, monkeypatch, background):
    """ENOSPC raised where DCP writes a shard (which wraps it in a CheckpointException, from a thread when
    the save runs in the background): one SaveError naming the folder and the bytes needed; no partial
    folder under any name; the earlier checkpoint intact."""
    from anygpu.checkpoint import async_store
    from anygpu.runtime import parallel

    model, opt, sched = tiny_training_state()
    first = store.save(str(tmp_path), 1, model, opt, sched, {"global_step": 1}, 2, 0)
    fill_the_disk_after(monkeypatch, 100)
    with pytest.raises(SaveError) as e:
        if background:
            saver = async_store.AsyncCheckpointer(str(tmp_path), 2, 0, torch_device("cpu"))
            try:
                saver.save(2, model, opt, sched, {"global_step": 2})
                saver.wait()
            finally:
                saver.pending = None
                saver.close()
        else:
            store.save(str(tmp_path), 2, model, opt, sched, {"global_step": 2}, 2, 0)
    said = str(e.value)
    assert f"no space left on the device of {tmp_path} while writing checkpoint-2" in said, said
    assert needed_bytes(said) >= parallel.local_bytes(model, opt), said
    assert "checkpoint-1 is intact" in said and "Traceback" not in said
    assert names(tmp_path) == ["checkpoint-1"] and manifest.problem(first) is None
    assert not list(tmp_path.glob(".checkpoint-*"))


def test_free_space_is_checked_before_writing(tmp_path, monkeypatch):
    from anygpu.runtime import fs

    model, opt, sched = tiny_training_state()
    first = store.save(str(tmp_path), 1, model, opt, sched, {"global_step": 1}, 2, 0)
    size = sum(f["size"] for f in manifest.read(first)["files"].values())
    monkeypatch.setattr(fs, "free_bytes", lambda path: size // 2)
    with pytest.raises(SaveError, match=f"no space left on the device of {tmp_path}: checkpoint-2 needs about") as e:
        store.save(str(tmp_path), 2, model, opt, sched, {"global_step": 2}, 2, 0)
    assert needed_bytes(str(e.value)) >= size // 2 + 1
    assert names(tmp_path) == ["checkpoint-1"] and not list(tmp_path.glob(".checkpoint-*"))


def torch_device(name: str):
    import torch

    return torch.device(name)


@pytest.mark.parametrize("engine", ["fsdp", "hf"])
def test_both_engines_stop_on_auto_with_only_damaged_checkpoints(tmp_path, engine, capsys):
    """The engines' own entry points, which stop at start-up (exit 2) before any process group or model."""
    from conftest import TINY

    if engine == "fsdp":
        from anygpu.engines.fsdp import main
    else:
        from anygpu.engines.hf.engine import main
    for step in (2, 4):
        damage(fake_checkpoint(tmp_path, step))
    with pytest.raises(SystemExit) as e:
        main([*TINY, "--max_steps", "4", "--output_dir", str(tmp_path), "--resume_from_checkpoint", "auto"])
    err = capsys.readouterr().err
    assert (
        e.value.code == 2 and "no intact checkpoint" in err and "checkpoint-2: " in err and "checkpoint-4: " in err
    ), err
    assert names(tmp_path) == ["checkpoint-2", "checkpoint-4"]

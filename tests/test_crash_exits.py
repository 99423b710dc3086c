"""An error anywhere in a run ends the job: non-zero, with the error's message, and no process left behind.

The fault comes from outside anygpu, as a user's bug would: tests/scripts/user_bug/sitecustomize.py makes the N-th
call of a torch function raise in the launched processes (forward, backward, the optimizer step, an evaluation, a
checkpoint write, a loader worker's read, start-up). Each job is a real `torchrun` or `accelerate launch`, in a
session of its own; a hang is told from an exit by the launch's own timeout, not by a bound on its time. Every
process of a job carries a marker in its environment, so one that outlived its launcher is found wherever it was
re-parented.

Found so: a rank that raised while its step loader had a worker waited for that worker forever (the worker ignores
SIGTERM, which Python's exit handler sends its daemonic children before joining them)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from conftest import ROOT, TINY, env

pytestmark = pytest.mark.slow
LAUNCH_TIMEOUT = 150  # s: a tiny run that fails at its third step ends in ~15 s on 2 busy cores
USER_BUG = ROOT / "tests" / "scripts" / "user_bug"
RUN = [*TINY, "--max_steps", "6", "--export_final", "false", "--save_steps", "0"]

FORWARD = "torch.nn.functional:embedding:3:grad"  # the third training forward (the embedding's lookup)
BACKWARD = "torch.autograd:backward:3"
OPTIMIZER = "torch.optim.adamw:AdamW.step:2"
EVALUATION = "torch.nn.functional:embedding:2:nograd"  # the second evaluation batch
SAVE = "torch.distributed.checkpoint.filesystem:FileSystemWriter.write_data:1"  # checkpoint-2's shards
WORKER = "torch:tensor:3:worker"  # inside the loader worker's collation (elsewhere: inline reads)
START_UP = "torch.distributed:init_process_group:1"
HF_SAVE = "torch:save:1"  # the Trainer's optimizer/scheduler files


def marked_pids(marker: str) -> list[int]:
    """Every live process whose environment holds `marker` (the job's processes, wherever they were re-parented)."""
    found = []
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            if marker.encode() in environ.read_bytes():
                found.append(int(environ.parent.name))
        except OSError:
            continue
    return [pid for pid in found if pid != os.getpid()]


def wait_gone(marker: str, grace_s: float = 15) -> list[int]:
    """The job's processes still alive `grace_s` after its launcher ended. A grace, not zero: a loader worker whose
    rank a launcher SIGKILLed notices within torch's 5-s watchdog interval, and a process being reaped is briefly
    still listed."""
    deadline = time.monotonic() + grace_s
    while (left := marked_pids(marker)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


def launch(cmd: list[str], fault: str, tmp_path: Path) -> tuple[int, str]:
    """Run the job with the fault switched on; its exit code and output, or a failure if it did not end in time
    or left a process behind."""
    marker = f"ANYGPU_TEST_JOB={uuid.uuid4().hex}"
    key, value = marker.split("=")
    job_env = {
        **env(),
        "PYTHONPATH": os.pathsep.join(filter(None, [str(USER_BUG), os.environ.get("PYTHONPATH")])),
        "ANYGPU_TEST_RAISE": fault,
        key: value,
    }
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=job_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        out, _ = proc.communicate(timeout=LAUNCH_TIMEOUT)
    except subprocess.TimeoutExpired:
        left = marked_pids(marker)
        for pid in left:
            os.kill(pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"{fault}: the job still ran after {LAUNCH_TIMEOUT} s ({len(left)} processes):\n{out[-6000:]}")
    left = wait_gone(marker)  # the launcher has exited: anything of its job still alive is left behind
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert not left, f"{fault}: processes left behind after the job ended: {left}\n{out[-4000:]}"
    return proc.returncode, out


def torchrun(nproc: int, args: list[str]) -> list[str]:
    """The real torchrun, as a user starts the native engine."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
            "run_fsdp_standalone.py", *args]  # fmt: skip


def accelerate(nproc: int, args: list[str]) -> list[str]:
    """The real `accelerate launch` with the DDP config, as a user starts the HF engine."""
    return [sys.executable, "-m", "accelerate.commands.launch", "--config_file", "accelerate_configs/ddp.yaml",
            "--num_processes", str(nproc), "run_hf_standalone.py", *args]  # fmt: skip


def assert_ended_by(fault: str, code: int, out: str) -> None:
    name, attr, nth = fault.split(":")[:3]
    assert code != 0, f"{fault}: the job exited 0\n{out[-4000:]}"
    assert f"injected fault: call {nth} of {name}.{attr}" in out, (
        f"{fault}: the error's message is missing\n{out[-4000:]}"
    )


NATIVE_CASES = [  # (ranks, loader workers, fault, extra arguments)
    pytest.param(1, 1, FORWARD, [], id="forward-1rank-worker"),
    pytest.param(1, 1, BACKWARD, [], id="backward-1rank-worker"),
    pytest.param(1, 0, BACKWARD, [], id="backward-1rank-inline"),
    pytest.param(1, 1, OPTIMIZER, [], id="optimizer-1rank-worker"),
    pytest.param(1, 1, EVALUATION, ["--eval_steps", "2"], id="evaluation-1rank-worker"),
    pytest.param(1, 1, SAVE, ["--save_steps", "2"], id="save-1rank-worker"),
    pytest.param(1, 1, WORKER, [], id="worker-1rank"),
    pytest.param(1, 1, START_UP, [], id="startup-1rank"),
    pytest.param(2, 1, BACKWARD + ":rank1", [], id="backward-2ranks-workers"),
    pytest.param(2, 0, FORWARD + ":rank1", [], id="forward-2ranks-inline"),
    pytest.param(2, 1, SAVE + ":rank1", ["--save_steps", "2"], id="save-2ranks-workers"),
]


@pytest.mark.parametrize("nproc,workers,fault,extra", NATIVE_CASES)
def test_native_engine_ends_on_an_error(tmp_path, nproc, workers, fault, extra) -> None:
    args = [*RUN, "--dataloader_num_workers", str(workers), "--output_dir", str(tmp_path / "out"), *extra]
    code, out = launch(torchrun(nproc, args), fault, tmp_path)
    assert_ended_by(fault, code, out)


HF_CASES = [
    pytest.param(1, BACKWARD, [], id="backward-1rank"),
    pytest.param(1, EVALUATION, ["--eval_steps", "2"], id="evaluation-1rank"),
    pytest.param(2, OPTIMIZER + ":rank1", [], id="optimizer-2ranks"),
    pytest.param(2, HF_SAVE + ":rank1", ["--save_steps", "2"], id="save-2ranks"),
]


@pytest.mark.parametrize("nproc,fault,extra", HF_CASES)
def test_hf_engine_ends_on_an_error(tmp_path, nproc, fault, extra) -> None:
    args = [*RUN, "--output_dir", str(tmp_path / "out"), *extra]
    code, out = launch(accelerate(nproc, args), fault, tmp_path)
    assert_ended_by(fault, code, out)

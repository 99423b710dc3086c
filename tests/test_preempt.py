"""The preemption handler alone (real signals, a real process, no training): a healthy job in a long
step (forward passes, a long backward, a long optimizer step) or a long save always reaches its checkpoint;
only a process stuck in a collective exits fast."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT, env

from anygpu.reliability.run_guard import LOCK

SCRIPT = r"""
import os, signal, sys, time
from pathlib import Path
from anygpu.reliability import run_guard
from anygpu.reliability.preempt import Preemption
run_guard.take_lock(Path(sys.argv[3]))  # the run's --output_dir lock, as the engines take it
p = Preemption(save_on_preempt=sys.argv[2] == "true")
mode = sys.argv[1]
slow = mode in ("long-backward", "long-optimizer-step")
if slow:  # torch imported and the model built before the signal: an import under load can outlast the grace period
    import torch
if not slow and mode != "exiting":
    os.kill(os.getpid(), signal.SIGUSR1 if mode == "usr1" else signal.SIGTERM)
t0 = time.time()
if mode in ("long-step", "usr1"):  # forward passes keep beating for three grace periods
    while time.time() - t0 < 3:
        p.beat()
        time.sleep(0.05)
elif mode == "long-save":  # no beat at all, but inside a save (or an export)
    with p.progress.protected():  # the run's progress, which its watchdog reads
        time.sleep(3)
elif mode == "stuck":  # a collective that never returns (a peer is gone)
    time.sleep(30)
elif mode == "exiting":  # an error ended the main thread; an exit handler waits for a child that does not stop
    import atexit

    atexit.register(lambda: (os.kill(os.getpid(), signal.SIGTERM), time.sleep(30)))
    raise RuntimeError("a user's bug")
elif mode == "again":  # the launcher's forwarded copy (Slurm signalled both), during the step and after the run
    for delay in (0.1, 1.5):
        while time.time() - t0 < delay:
            p.beat()
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGTERM)
    while time.time() - t0 < 3:
        p.beat()
        time.sleep(0.05)
    p.close()  # the run has saved and ends: a copy now must not kill it (-15) before its exit code
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(0.2)
elif slow:  # 3 s without a forward pass after the signal

    class SlowBackward(torch.autograd.Function):  # a layer whose backward takes 0.4 s
        @staticmethod
        def forward(ctx, x):
            return x * 1

        @staticmethod
        def backward(ctx, grad):
            time.sleep(0.4)
            return grad

    class Layer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(2))

        def forward(self, x):
            return SlowBackward.apply(x * self.w)

    class Net(torch.nn.Module):
        _no_split_modules = ["Layer"]  # its decoder layers, as transformers names them

        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList(Layer() for _ in range(8))

        def forward(self, x):
            for layer in self.layers:
                x = layer(x)
            return x.sum()

    class SlowStep(torch.optim.SGD):  # a CPU-offloaded optimizer step of a large model
        def step(self, closure=None):
            time.sleep(3)
            return super().step(closure)

    model = Net()
    p.watch(model)  # as the engines do
    optimizer = SlowStep(model.parameters(), lr=0.1)  # made first: its first use imports torch._dynamo (seconds)
    loss = model(torch.ones(2))
    os.kill(os.getpid(), signal.SIGTERM)  # the forward is done: what follows makes no forward pass
    if mode == "long-backward":
        loss.backward()
    else:
        optimizer.step()
print("step boundary reached after", p.requested, flush=True)
"""


def run(mode: str, output_dir: Path, save_on_preempt: str = "true") -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", SCRIPT, mode, save_on_preempt, str(output_dir)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**env(), "ANYGPU_SIGTERM_GRACE_S": "1", "PYTHONPATH": str(ROOT)},
        timeout=60,
    )


def assert_lock_released(output_dir: Path) -> None:
    """An exit without a checkpoint still gives --output_dir back: the next run starts without a stale-lock warning."""
    assert not (output_dir / LOCK).exists(), "the exit left the output_dir lock behind"


@pytest.mark.parametrize(
    "mode",
    [
        "long-step",
        *(  # the same boundary from each other place a signal can land: the quick tier keeps one
            pytest.param(m, marks=pytest.mark.slow)
            for m in ("long-save", "usr1", "long-backward", "long-optimizer-step")
        ),
    ],
)
def test_a_healthy_job_always_reaches_its_step_boundary(mode, tmp_path):
    proc = run(mode, tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert f"step boundary reached after {'SIGUSR1' if mode == 'usr1' else 'SIGTERM'}" in proc.stdout


def test_a_process_stuck_in_a_collective_exits_fast_without_a_checkpoint(tmp_path):
    proc = run("stuck", tmp_path)  # had it waited out its 30-s "collective", it would have exited 0
    assert proc.returncode == 75, proc.returncode
    assert "no progress for 1 s, stuck in a collective" in proc.stderr
    assert_lock_released(tmp_path)


def test_a_process_stuck_on_its_way_out_is_not_blamed_on_a_peer(tmp_path):
    """A rank that raised and then waits in an exit handler (as one waited for its loader worker) is stuck on its
    way out, not in a collective: the watchdog's line says so."""
    proc = run("exiting", tmp_path)
    assert proc.returncode == 75, proc.returncode
    assert "RuntimeError: a user's bug" in proc.stderr
    assert "stuck on its way out (its main thread has ended" in proc.stderr, proc.stderr[-2000:]
    assert_lock_released(tmp_path)


def test_a_signal_again_is_the_same_request_not_a_harder_one(tmp_path):
    """Slurm's scancel signals every process of the job and each worker's launcher forwards what it got: the copy,
    early or late, even after the run has ended, is the same request. The job reaches its step boundary (and so
    its checkpoint and 143); it said once what the copy was (before: exit 75 and no checkpoint at all)."""
    proc = run("again", tmp_path)
    assert proc.returncode == 0 and "step boundary reached after SIGTERM" in proc.stdout, proc.stderr
    assert proc.stderr.count("SIGTERM again: the same request") == 1, proc.stderr


def test_save_on_preempt_false_exits_at_the_first_signal(tmp_path):
    proc = run("long-step", tmp_path, "false")
    assert proc.returncode == 75 and "--save_on_preempt false" in proc.stderr
    assert_lock_released(tmp_path)


def test_save_strategy_no_writes_no_checkpoint_at_the_end_or_on_a_signal():
    """--save_strategy no (a benchmark, a throwaway run): the schedule saves at no step, its last included, and
    a signal exits at once (75) saying why, as --save_on_preempt false does."""
    from anygpu.config.args import TrainArguments
    from anygpu.engines.trunk.schedule import Schedule
    from anygpu.reliability.preempt import Preemption

    args = TrainArguments(save_strategy="no", report_to=[], max_steps=10)
    assert not any(Schedule.of(args, 0, 10).should_save(s) for s in range(1, 11))
    assert Schedule.of(TrainArguments(report_to=[], max_steps=10), 0, 10).should_save(10)  # the default saves
    preemption = Preemption.of(args)
    try:
        assert not preemption.save_on_preempt and preemption.why_not == "--save_strategy no"
    finally:
        preemption.close()


def test_the_launchers_torchrun_reads_the_job_code_from_its_workers():
    """After a signal sent to torchrun: 143 only where every worker saved; 75 where one stopped without a checkpoint
    or was killed at the grace's end; torchrun's own report (None) where one failed or a code is unknown."""
    from anygpu.reliability.torchrun import job_code

    assert job_code([143, 143]) == 143
    assert job_code([143, 75]) == job_code([143, -9]) == 75
    assert job_code([143, 1]) is job_code([143, None]) is job_code([]) is None

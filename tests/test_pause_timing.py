"""tokens/s and MFU leave evaluations and saves out, but not the training work still queued on the GPU
when they start: the device is synchronised before a pause's clock starts (CPU: a device whose
`synchronize` takes the time the queued steps would)."""

from __future__ import annotations

import time
import types

import pytest
import torch
from datasets import Dataset

from anygpu.engines.hf.trainer import TrunkCallback
from anygpu.engines.trunk.log import RunLog
from anygpu.engines.trunk.schedule import Schedule

QUEUED = 0.3  # seconds of GPU work still in flight when the host reaches the pause


@pytest.fixture
def gpu_log(tmp_path, monkeypatch) -> RunLog:
    """A rank-0 RunLog on a 'cuda' device whose synchronize waits for QUEUED seconds of queued work."""
    queue = {"until": 0.0}
    monkeypatch.setattr(
        torch.cuda, "synchronize", lambda *a: time.sleep(max(0.0, queue["until"] - time.perf_counter()))
    )
    prep = types.SimpleNamespace(
        datasets={"train": Dataset.from_dict({"input_ids": [[1, 2, 3, 4]] * 8})},
        order=types.SimpleNamespace(steps_per_epoch=100),
        block_size=4,
        plan=types.SimpleNamespace(global_batch_size=8, world_size=1),
        total_steps=100,
    )
    args = types.SimpleNamespace(output_dir=str(tmp_path), report_to=[], disable_tqdm=True)
    schedule = Schedule(0, 100, 100, logging_steps=10, eval_steps=2, save_steps=0)
    log = RunLog(prep, args, schedule, 1, torch.device("cuda"), True, 1.0, None, resumed=False)
    log.queue = queue  # the test sets when the queued work ends
    log.window.reset()
    return log


def test_the_native_engines_pause_starts_after_the_queued_work(gpu_log):
    gpu_log.queue["until"] = time.perf_counter() + QUEUED  # the host ran ahead of the device
    with gpu_log.paused():
        torch.cuda.synchronize()  # an evaluation or a save of no time of its own: its first read waits for the queue
    assert gpu_log.window.paused < QUEUED / 3, f"{gpu_log.window.paused:.3f} s of training counted as a pause"


def test_the_hf_engines_pause_starts_after_the_queued_work(gpu_log):
    preemption = types.SimpleNamespace(requested=None, beat=lambda: None)
    callback = TrunkCallback(gpu_log.schedule, gpu_log, preemption, torch.device("cpu"))
    control = types.SimpleNamespace(
        should_evaluate=False, should_save=False, should_log=False, should_training_stop=False
    )
    gpu_log.queue["until"] = time.perf_counter() + QUEUED
    callback.on_step_end(None, types.SimpleNamespace(global_step=2), control)  # step 2 evaluates (eval_steps 2)
    assert control.should_evaluate
    torch.cuda.synchronize()  # Trainer's evaluation, of no time of its own: its first read waits for the queue
    callback.on_evaluate(None, types.SimpleNamespace(global_step=2), control, metrics={})  # Trainer's evaluation ran
    assert gpu_log.window.paused < QUEUED / 3, f"{gpu_log.window.paused:.3f} s of training counted as a pause"

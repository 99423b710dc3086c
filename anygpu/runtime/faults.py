"""Fault injection for the tests: one small registry of faults, each switched on by an environment variable
that a test sets for the processes it starts. Product code marks the few points where a fault matters
(`faults.at("save", step)`); with no variable set, a point does nothing."""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from typing import Callable


def _on_rank0() -> bool:
    return os.environ.get("RANK", "0") == "0"


def _sigterm_at(value: str, point: str, step: int) -> None:
    if value == f"{point}:{step}" and _on_rank0():
        os.kill(os.getpid(), signal.SIGTERM)


def _slow_save(value: str, point: str, step: int) -> None:
    at_step, seconds = value.split(":")
    if point == "save" and at_step in (str(step), "any"):
        time.sleep(float(seconds))


def _slow_export(value: str, point: str, step: int) -> None:
    if point == "export" and _on_rank0():
        time.sleep(float(value))


def _slow_rank0(value: str, point: str, step: int) -> None:
    if point == "refusal" and _on_rank0():
        time.sleep(float(value))


def _stall_transport(value: str, point: str, step: int) -> None:
    rank, _, seconds = value.partition(":")
    if point == "transport" and os.environ.get("RANK", "0") == rank:
        time.sleep(float(seconds))


def _slow_step(value: str, point: str, step: int) -> None:
    world_size, _, seconds = value.partition(":")
    if point == "step" and os.environ.get("WORLD_SIZE", "1") == world_size:
        time.sleep(float(seconds))


def _stall(value: str, point: str, step: int) -> None:
    rank, at_point, at_step, seconds = value.split(":")
    if point == at_point and str(step) == at_step and os.environ.get("RANK", "0") == rank:
        time.sleep(float(seconds))


@dataclass(frozen=True)
class Fault:
    variable: str  # the environment variable that switches it on, and its value's form
    what: str
    act: Callable[[str, str, int], None]  # (the variable's value, the point reached, the step)


REGISTRY: tuple[Fault, ...] = (
    Fault(
        "ANYGPU_TEST_SIGTERM_AT", "POINT:STEP, e.g. eval:4: rank 0 sends itself SIGTERM as it reaches it", _sigterm_at
    ),
    Fault(
        "ANYGPU_TEST_SLOW_SAVE",
        "STEP:SECONDS: sleep inside the write of checkpoint-STEP (after the shards, "
        "before the rename), so a test can kill the job mid-write; any:SECONDS: inside every checkpoint's",
        _slow_save,
    ),
    Fault(
        "ANYGPU_TEST_SLOW_EXPORT",
        "SECONDS: rank 0 sleeps at the end of the final export (written, the other ranks still waiting)",
        _slow_export,
    ),
    Fault(
        "ANYGPU_TEST_SLOW_RANK0",
        "SECONDS: rank 0 waits before printing a refusal, so a test sees the other ranks' exits race it",
        _slow_rank0,
    ),
    Fault(
        "ANYGPU_TEST_STALL_TRANSPORT",
        "RANK:SECONDS: that rank waits before joining the connectivity check's all-reduce, as a rank whose "
        "transport (a wrong interface, a broken fabric) does not come up",
        _stall_transport,
    ),
    Fault(
        "ANYGPU_TEST_SLOW_STEP",
        "WORLD_SIZE:SECONDS: every rank sleeps after each step while the job has that world size, so a test "
        "can add a node to an elastic job before it ends",
        _slow_step,
    ),
    Fault(
        "ANYGPU_TEST_STALL",
        "RANK:POINT:STEP:SECONDS, e.g. 1:step:2:60: that rank alone sleeps when it reaches POINT at STEP, as a rank "
        "that hangs (the others wait for it in their next collective)",
        _stall,
    ),
)
POINTS = ("eval", "save", "refusal", "transport", "export", "step")


def at(point: str, step: int = 0) -> None:
    """The run reached `point` (one of POINTS) at optimizer step `step`: act on any fault switched on."""
    assert point in POINTS, point
    for fault in REGISTRY:
        if value := os.environ.get(fault.variable):
            fault.act(value, point, step)

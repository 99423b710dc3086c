"""This process's progress, as the preemption watchdog reads it: a heartbeat, and the saves and exports in flight.

It sits below checkpoints and exports (which hold the watchdog off while they write) and below the
preemption handler (which reads it), so neither needs the other."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Iterator


@dataclass
class Progress:
    beats: int = 0
    protected_depth: int = 0


PROGRESS = Progress()


def beat(*_: Any) -> None:
    """One unit of progress (a decoder layer's forward, a step boundary); usable as a forward pre-hook."""
    PROGRESS.beats += 1


@contextlib.contextmanager
def protected() -> Iterator[None]:
    """A save or export in progress: the watchdog waits for it, however long it takes."""
    PROGRESS.protected_depth += 1
    try:
        yield
    finally:
        PROGRESS.protected_depth -= 1
        beat()

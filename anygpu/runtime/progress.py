"""A run's progress, as the preemption watchdog reads it: a heartbeat, and the saves and exports in flight.

It sits below checkpoints and exports (which hold the watchdog off while they write) and below the
preemption handler (which owns one and reads it), so neither needs the other."""

from __future__ import annotations

import contextlib
from typing import Any, Iterator


class Progress:
    """Heartbeats and the depth of saves/exports in progress; one per run (its `Preemption` holds it)."""

    def __init__(self) -> None:
        self.beats = 0
        self.protected_depth = 0

    def beat(self, *_: Any) -> None:
        """One unit of progress (a decoder layer's forward, a step boundary); usable as a forward pre-hook."""
        self.beats += 1

    @contextlib.contextmanager
    def protected(self) -> Iterator[None]:
        """A save or export in progress: the watchdog waits for it, however long it takes."""
        self.protected_depth += 1
        try:
            yield
        finally:
            self.protected_depth -= 1
            self.beat()


def protected(progress: Progress | None) -> contextlib.AbstractContextManager:
    """`progress.protected()`, or nothing where no watchdog runs (a save outside a run, as the tests make)."""
    return progress.protected() if progress is not None else contextlib.nullcontext()

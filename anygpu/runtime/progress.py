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
        """One unit of progress (a decoder layer's forward or backward, a step boundary); usable as a hook."""
        self.beats += 1

    def hold(self, *_: Any) -> None:
        """Work begins that the watchdog must wait for, however long (usable as an optimizer step pre-hook)."""
        self.protected_depth += 1

    def release(self, *_: Any) -> None:
        """That work is done: a unit of progress (usable as an optimizer step post-hook)."""
        self.protected_depth -= 1
        self.beat()

    @contextlib.contextmanager
    def protected(self) -> Iterator[None]:
        """A save or export in progress: the watchdog waits for it, however long it takes."""
        self.hold()
        try:
            yield
        finally:
            self.release()


def protected(progress: Progress | None) -> contextlib.AbstractContextManager:
    """`progress.protected()`, or nothing where no watchdog runs (a save outside a run, as the tests make)."""
    return progress.protected() if progress is not None else contextlib.nullcontext()

"""The project's error types and the one place that turns them into exit codes.

`UsageError` is a refusal of user input: one line naming the argument, the value and a valid
alternative, printed once (by rank 0), exit code 2. Every other exception keeps its traceback.
"""
from __future__ import annotations

import os
import sys
from typing import Callable

EXIT_USAGE = 2  # bad input, refused before any work
EXIT_PREEMPTED = 143  # SIGTERM/SIGUSR1: every rank saved a checkpoint of the step it finished, then stopped
EXIT_NO_CHECKPOINT = 75  # a second signal, or a collective stuck on a dead peer: stopped at once, no new checkpoint


class UsageError(ValueError):
    """Bad user input (arguments, data, output folder). Raised on every rank alike (checks that need other
    ranks' facts gather them first), so rank 0 alone prints it."""


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


def run_main(body: Callable[[], object], cleanup: Callable[[], None]) -> None:
    """Run an engine's `main` body: a UsageError is one line and exit 2; anything else keeps its traceback."""
    try:
        body()
    except UsageError as e:
        if rank() == 0:
            print(f"error: {e}", file=sys.stderr, flush=True)
        cleanup()
        sys.exit(EXIT_USAGE)


class SaveError(RuntimeError):
    """A checkpoint could not be written (full disk): says what is intact and what to do; keeps its traceback."""

"""The project's error types and the one place that turns them into exit codes.

`UsageError` is a refusal of user input: one line naming the argument, the value and a valid
alternative, printed once (by rank 0), exit code 2. `SaveError` (a full disk) is one line and exit code 1.
Every other exception keeps its traceback.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Callable

from anygpu.runtime import faults

EXIT_FAILURE = 1  # any other failure (a full disk while saving: one line, without a traceback)
EXIT_USAGE = 2  # bad input, refused before any work
EXIT_PREEMPTED = 143  # SIGTERM/SIGUSR1: every rank saved a checkpoint of the step it finished, then stopped
# --save_on_preempt false, or a collective stuck on a dead peer: stopped at once, no new checkpoint
EXIT_NO_CHECKPOINT = 75
# How long rank 0's node-mates wait before they exit on a refusal that rank 0 prints: their torchrun agent
# stops every rank of the node (SIGTERM) at the first exit, so one that exits first could cut rank 0 off
# before it prints. Rank 0's exit ends the wait (the agent stops the others); other nodes' agents do not
# stop rank 0 at once, so their ranks exit without waiting.
QUIET_RANK_GRACE_S = 10.0


class UsageError(ValueError):
    """Bad user input (arguments, data, output folder). Raised on every rank alike (checks that need other
    ranks' facts gather them first), so rank 0 alone prints it."""


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


def run_main(body: Callable[[], object], cleanup: Callable[[], None]) -> None:
    """Run an engine's `main` body: a UsageError is one line and exit 2, a SaveError one line and exit 1;
    anything else keeps its traceback."""
    try:
        body()
    except UsageError as e:
        exit_refused(e, cleanup)
    except SaveError as e:
        if rank() == 0 or not e.on_every_rank:
            print(f"error: {e}", file=sys.stderr, flush=True)
        cleanup()
        if e.on_every_rank:
            _let_rank0_speak()
        sys.exit(EXIT_FAILURE)


def exit_refused(e: UsageError, cleanup: Callable[[], None] = lambda: None) -> None:
    """Print a refusal once (rank 0) and exit 2, every rank."""
    faults.at("refusal")
    if rank() == 0:
        print(f"error: {e}", file=sys.stderr, flush=True)
    cleanup()
    _let_rank0_speak()
    sys.exit(EXIT_USAGE)


def _let_rank0_speak() -> None:
    """On a rank other than 0 on rank 0's node, wait before exiting so that rank 0's exit (after its one line)
    ends the job."""
    if rank() != 0 and os.environ.get("GROUP_RANK", "0") == "0":  # GROUP_RANK: torchrun's node rank
        time.sleep(QUIET_RANK_GRACE_S)


class SaveError(RuntimeError):
    """A checkpoint could not be written (full disk): one line saying which folder, how many bytes and what is
    intact, printed by the rank that raised it (by rank 0 alone when every rank raised it: `on_every_rank`)."""

    def __init__(self, message: str, on_every_rank: bool = False) -> None:
        super().__init__(message)
        self.on_every_rank = on_every_rank

"""torchrun, ending with the job's own exit code when a signal stops it: what the launchers run.

A signal sent to torchrun alone (Kubernetes signals a container's first process; a `kill` of the launcher's pid)
reaches the workers through torchrun, which waits for them (they save a checkpoint and exit 143,
docs/reliability.md), then raises its own `SignalException`: exit 1 and a traceback, which a requeue script reads
as a crash. Here that ending becomes the workers' code: 143 where every worker exited 143, 75 where one stopped
without a checkpoint (75, or killed after torchrun's grace period), else 1 with torchrun's report. Everything else is
torchrun's own (`python -m anygpu.reliability.torchrun` takes torchrun's arguments).
"""

from __future__ import annotations

import sys

from anygpu.errors import EXIT_NO_CHECKPOINT, EXIT_PREEMPTED

_CODES: list[int | None] = []  # the workers' exit codes, as torchrun's last process context closed them


def job_code(codes: list[int | None]) -> int | None:
    """The job's code from its workers' (None where torchrun's report should stand: a worker failed or is unknown)."""
    if not codes or any(c is None for c in codes):
        return None
    if all(c == EXIT_PREEMPTED for c in codes):
        return EXIT_PREEMPTED
    if all(c in (EXIT_PREEMPTED, EXIT_NO_CHECKPOINT) or c < 0 for c in codes):  # killed at the grace's end
        return EXIT_NO_CHECKPOINT
    return None


def _worker_codes(context) -> list[int | None]:
    handlers = getattr(context, "subprocess_handlers", None)  # workers started as programs (torchrun's script)
    if handlers is not None:
        return [h.proc.returncode for h in handlers.values()]
    pc = getattr(context, "_pc", None)  # as functions
    return [p.exitcode for p in pc.processes] if pc is not None else []


def _record_codes() -> None:
    """Keep the workers' codes as torchrun closes their context (its shutdown on a signal ends with that)."""
    from torch.distributed.elastic.multiprocessing import api

    close = api.PContext.close

    def recording_close(self, *args, **kwargs):
        try:
            return close(self, *args, **kwargs)
        finally:
            _CODES[:] = _worker_codes(self)

    api.PContext.close = recording_close


def main() -> None:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.run import main as torchrun

    _record_codes()
    try:
        torchrun()
    except SignalException as e:
        code = job_code(_CODES)
        if code is None:
            raise
        print(f"torchrun: {e.sigval.name} forwarded; the workers exited {sorted(set(_CODES))}: exit {code}",
              file=sys.stderr)  # fmt: skip
        sys.exit(code)


if __name__ == "__main__":
    main()

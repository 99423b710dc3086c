"""What torch.compile did: graphs, graph breaks and recompilations, from dynamo's own counters.

A graph break splits a compiled layer into pieces run by Python in between (each piece a separate graph, with
the host deciding between them); a recompilation after the first step usually means a guard fails every step
(a changing Python value, a shape marked static) and the compiled code is thrown away each time. Both cost
speed silently, so the engine logs them: once after the first step, and again whenever a later step compiled.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CompileCounts:
    frames: int  # frames dynamo compiled (each compilation and recompilation of a function, and each resume)
    graphs: int  # graphs it produced
    graph_breaks: int  # graph breaks met (each occurrence, while compiling)
    reasons: tuple[str, ...]  # the first line of each distinct graph-break reason

    def since(self, earlier: CompileCounts) -> CompileCounts:
        return CompileCounts(
            self.frames - earlier.frames,
            self.graphs - earlier.graphs,
            self.graph_breaks - earlier.graph_breaks,
            tuple(r for r in self.reasons if r not in earlier.reasons),
        )


NONE = CompileCounts(0, 0, 0, ())


def counts() -> CompileCounts:
    """Dynamo's counters now (all zero where nothing was compiled or dynamo was never imported)."""
    import sys

    if "torch._dynamo" not in sys.modules:
        return NONE
    from torch._dynamo.utils import counters

    # torch records graph breaks under "graph_break" (older releases) or "unimplemented" (newer), reason → count
    breaks = {**counters.get("graph_break", {}), **counters.get("unimplemented", {})}
    reasons = tuple(sorted({str(r).strip().splitlines()[0] for r in breaks}))
    return CompileCounts(
        int(counters["frames"].get("total", 0)),
        int(counters["stats"].get("unique_graphs", 0)),
        int(sum(breaks.values())),
        reasons,
    )


def first_step_line(c: CompileCounts) -> str:
    """The log line after the first (compiling) step."""
    line = f"torch.compile: {_n(c.graphs, 'graph')}, {_n(c.graph_breaks, 'graph break')}"
    if c.reasons:
        line += " (" + "; ".join(c.reasons[:3]) + (" …" if len(c.reasons) > 3 else "") + ")"
    return line


def _n(count: int, noun: str) -> str:
    return f"{count} {noun}{'' if count == 1 else 's'}"


def recompiled_line(c: CompileCounts, step: int, since_step: int) -> str:
    """The warning when steps after the first compiled again."""
    return (
        f"torch.compile compiled {c.frames} more frames between steps {since_step} and {step} (recompilations: the "
        "compiled code is being thrown away; TORCH_LOGS=recompiles prints why)"
        + (f", {_n(c.graph_breaks, 'new graph break')}" if c.graph_breaks else "")
    )


class CompileWatch:
    """The engine's view: `after_step(step)` returns (a line to log, whether it is a warning), or None when nothing
    was compiled since the last call."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.before = counts() if enabled else NONE  # dynamo's counters are the process's: this run's start
        self.seen: CompileCounts | None = None
        self.seen_at = 0

    def after_step(self, step: int) -> tuple[str, bool] | None:
        if not self.enabled:
            return None
        now = counts()
        if self.seen is None:
            self.seen, self.seen_at = now, step
            first = now.since(self.before)
            return first_step_line(first), first.graph_breaks > 0
        new = now.since(self.seen)
        if new.frames == 0 and new.graph_breaks == 0:
            return None
        line = recompiled_line(new, step, self.seen_at)
        self.seen, self.seen_at = now, step
        return line, True

"""The table of benchmarks/gpu_matrix.sh: one row per configuration from its metrics.jsonl and its log.

    python benchmarks/gpu_matrix_summary.py OUT NGPU PRESET BLOCK GBS TIME_LIMIT "name|command" ...

Tokens/s, tokens/s/GPU and MFU are medians over the logged windows after the first (which holds compilation and
warm-up), peak memory the largest logged. A configuration run with torch.compile also shows how many times
dynamo recompiled after step 2 (its log holds TORCH_LOGS=recompiles' lines): a recompile at every step means
the compiled code is thrown away each step (and past torch's cache limit the layers run uncompiled).
"""

from __future__ import annotations

import json
import re
import statistics
import sys
from pathlib import Path

# `step 2/30 | loss …`: the console line of a training step (evaluations say `eval_loss`, not `| loss`)
STEP_LINE = re.compile(r"^step (\d+)/\d+ \| loss ")
RECOMPILE = "Recompiling function"


def slug(name: str) -> str:
    return re.sub(r"-+", "-", re.sub(r"[^a-z0-9]", "-", name.lower())).strip("-")


def recompiles_after(log: str, step: int = 2) -> int | None:
    """Rank 0's recompiles after the console line of `step` and before the last training step's line (the final
    evaluation recompiles for no-grad mode: not a training step's); None when the log never reached `step`."""
    lines = log.splitlines()
    steps = [(i, int(m.group(1))) for i, ln in enumerate(lines) if (m := STEP_LINE.match(ln))]
    after = [i for i, s in steps if s >= step]
    if not after:
        return None
    start, end = after[0], steps[-1][0]
    rank0 = (ln for ln in lines[start:end] if RECOMPILE in ln and ("[rank" not in ln or "[rank0]" in ln))
    return sum(1 for _ in rank0)


def row(out: Path, name: str, command: str, time_limit: str) -> str:
    """One Markdown row: the figures, or why there are none (skipped, timed out, failed)."""
    base = out / slug(name)
    skipped = Path(f"{base}.skipped")
    if skipped.exists():
        return f"| {name} | skipped: {skipped.read_text().strip()} | | | | |"
    if Path(f"{base}.timeout").exists():
        return f"| {name} | timed out after {time_limit} s (see {base}.log) | | | | |"
    path = base / "metrics.jsonl"
    recs = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    recs = [r for r in recs if "tokens_per_second" in r][1:]
    if not recs:
        return f"| {name} | failed (see {base}.log) | | | | |"

    def med(key: str):
        values = [r[key] for r in recs if r.get(key) is not None]
        return statistics.median(values) if values else None

    tps, per, mfu = med("tokens_per_second"), med("tokens_per_second_per_device"), med("mfu")
    mem = max((r.get("max_memory_allocated_gb") or 0) for r in recs)
    recompiles = "—"
    log = Path(f"{base}.log")
    if "--torch_compile true" in command and log.exists():
        count = recompiles_after(log.read_text(errors="replace"))
        recompiles = "?" if count is None else str(count)
    mfu_text = f"{100 * mfu:.1f}%" if mfu else "n/a"
    return f"| {name} | {tps:,.0f} | {per:,.0f} | {mfu_text} | {mem:.1f} | {recompiles} |"


def main(argv: list[str]) -> int:
    out, ngpu, preset, block, gbs, time_limit, runs = Path(argv[0]), *argv[1:6], argv[6:]
    try:
        import torch

        gpu = torch.cuda.get_device_name(0)
    except Exception:
        gpu = "?"
    lines = [
        f"{ngpu} x {gpu}, preset {preset}, block {block}, global batch {gbs}, bf16, at most {time_limit} s per "
        "configuration (median over logged windows after the first)",
        "",
        "| configuration | tokens/s | tokens/s/GPU | MFU | peak memory (GB) | recompiles after step 2 |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for run in runs:
        name, command = run.split("|", 1)
        lines.append(row(out, name, command, time_limit))
    table = "\n".join(lines) + "\n"
    (out / "gpu_matrix.md").write_text(table)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

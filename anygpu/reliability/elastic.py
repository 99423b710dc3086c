"""What changed between two starts of a run's workers under torchrun (a restart, an elastic node count), in
one line from rank 0.

At each start every rank reports its node: the host and torchrun's agent process on it (its parent), which
also tells apart two nodes on one host. Rank 0 compares the nodes with those of the previous start of the same
torchrun job (`TORCHELASTIC_RUN_ID`), kept in `<output_dir>/.anygpu-nodes.json`, and says which nodes left and
which joined, the world size before and now and the step the run resumes from. Only for jobs that can
restart (`--max-restarts`, or an elastic node count); the gather (one small collective at start-up) is made by
every torchrun job, so that ranks whose nodes were started with different settings still agree.
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path
from typing import Any

from anygpu.checkpoint import store

NODES_FILE = ".anygpu-nodes.json"


def applies() -> bool:
    """A torchrun job whose workers may be restarted: the only kind where membership can change."""
    restarts = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0) > 0
    return bool(os.environ.get("TORCHELASTIC_RUN_ID")) and (restarts or bool(os.environ.get(store.ELASTIC_VARIABLE)))


def this_node() -> str:
    return f"{socket.gethostname()} (agent {os.getppid()})"


def nodes() -> list[str]:
    """Every rank's node, once each, in rank order; [] where it does not apply. A collective of every torchrun
    job (TORCHELASTIC_RUN_ID is set on all its ranks alike, unlike --max-restarts, which is each node's own)."""
    if not os.environ.get("TORCHELASTIC_RUN_ID"):
        return []
    import torch.distributed as dist

    found: list[Any] = [this_node()]
    if dist.is_initialized() and dist.get_world_size() > 1:
        found = [None] * dist.get_world_size()
        dist.all_gather_object(found, this_node())
    return list(dict.fromkeys(found)) if applies() else []


def event_line(output_dir: str, now: list[str], world_size: int, resumed_step: int | None) -> str | None:
    """Rank 0: the line saying what changed since the previous start of this job (None on its first start),
    and the record of this start for the next one."""
    if not now:
        return None
    path, job = Path(output_dir) / NODES_FILE, os.environ.get("TORCHELASTIC_RUN_ID", "")
    try:
        before = json.loads(path.read_text())
    except (OSError, ValueError):
        before = {}
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({"job": job, "nodes": now, "world_size": world_size}))
    tmp.replace(path)
    if before.get("job") != job or not (store.restarted() or resumed_step is not None):
        return None
    was = list(before.get("nodes", []))
    left, joined = [n for n in was if n not in now], [n for n in now if n not in was]
    what = (
        "; ".join([f"node {n} left" for n in left] + [f"node {n} joined" for n in joined])
        or f"workers restarted on the same {_count(len(now), 'node')}"
    )
    where = "from step 0 (no checkpoint yet)" if resumed_step is None else f"from checkpoint-{resumed_step}"
    return (
        f"elastic: {what}; now {_count(len(now), 'node')}, "
        f"{_count(world_size, 'rank')} (was {_count(len(was), 'node')}, "
        f"{_count(int(before.get('world_size', 0)), 'rank')}); resuming {where}"
    )


def _count(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"

"""Start-up guards of a run, both engines.

Before the process group (rank 0 only, filesystem only):
- one writer per --output_dir: a lock file holding host, pid and torchrun's run id; a stale lock of a dead
  process on this host, or of a worker of an earlier round of the same torchrun job (an elastic job whose
  rank 0 was on a lost node), is taken over with a warning;
- a checkpoint replaced half-way (`.checkpoint-N.old`) is repaired;
- a fresh run into an --output_dir that holds another run is refused (naming --overwrite_output_dir), unless
  it resumes; `--resume_from_checkpoint auto` (or a torchelastic restart) with no checkpoint at all starts
  fresh and clears the old files (an elastic job, ANYGPU_ELASTIC, does the same at every start); with damaged checkpoints only, it stops naming them, unless
  --overwrite_output_dir, which moves them aside to <output_dir>/abandoned/ (a damaged checkpoint is never
  deleted: it may be all that is left of the run);
- a rewind (resuming from a checkpoint older than the newest) is refused, naming the newer checkpoints and
  --allow_rewind, which moves them aside to <output_dir>/abandoned/ so that neither rotation nor `latest`
  can mix the two branches. Newer checkpoints that are damaged are moved aside the same way.

Once the process group exists (`check_ranks`, `check_data_agrees`, `agreed_resume`):
- a short connectivity check is the first collective: its failure names the backend and the missing ranks;
- every rank compares the resolved arguments, the package version and (after data preparation) the corpus
  fingerprint with rank 0's: a difference stops the job at once, naming the rank, its host and the field;
- every rank must see --output_dir as rank 0 does (a probe file): otherwise a multi-node checkpoint would
  hold only some nodes' shards;
- the checkpoint to resume is rank 0's verdict, reached once at start-up (hashing every file) and broadcast:
  the other ranks hash nothing.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import socket
import sys
import uuid
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

from anygpu.checkpoint import manifest, store
from anygpu.errors import UsageError

LOCK = ".anygpu.lock"
PER_NODE = ("data_cache_dir", "preprocessing_num_workers")  # may differ between nodes
RUN_FILES = ("metrics.jsonl", "runs", "mlruns", "loss.png", "final")  # what a run leaves besides its checkpoints


def warn(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------- before the process group
@dataclass(frozen=True)
class Claim:
    """Rank 0's verdict on --output_dir at start-up: whether it resolved the checkpoint to resume (hashing
    its files), and which (None: start fresh). `agreed_resume` hands it to every rank."""

    resolved: bool
    resume: Path | None = None


def claim_output_dir(train_args: Any, rank: int) -> Claim | None:
    """Rank 0's start-up checks and repairs of --output_dir (see the module docstring); None on other ranks."""
    if rank != 0:
        return None
    root = Path(train_args.output_dir)
    missing = [p for p in (root, *root.parents) if not p.exists()]
    root.mkdir(parents=True, exist_ok=True)
    _created.extend(missing)  # innermost first: removed again if the run leaves them empty
    take_lock(root)
    for line in checkpoint_repairs(root):
        warn(line)
    resume = train_args.resume_from_checkpoint
    restarted = store.restarted()
    if resume or restarted:
        target = store.resolve_resume(resume, str(root), warn=True)
        if target is not None and Path(target).resolve().parent != root.resolve():  # another run's checkpoint
            claim_for_another_runs(root, Path(target), train_args.overwrite_output_dir)
            return Claim(resolved=True, resume=target)
        if target is not None:
            # latest/auto resolved to the newest intact checkpoint: whatever is newer is damaged
            set_aside_newer(root, target, train_args.allow_rewind or resume in ("latest", "auto") or not resume)
            return Claim(resolved=True, resume=target)
        damaged = store.checkpoints(root)  # none is intact, or resolve_resume would have found it
        if damaged and not train_args.overwrite_output_dir:
            why = "; ".join(
                f"{c.name}: {manifest.problem(c, checksums=False) or 'does not match its checksums'}" for c in damaged
            )
            how = f"--resume_from_checkpoint {resume}" if resume else "a torchelastic restart or an elastic job"
            raise UsageError(
                f"{how}: no intact checkpoint in --output_dir {root}, only damaged ones ({why}). Nothing was deleted: "
                "resume one by path once repaired, or pass --overwrite_output_dir true to move them aside to "
                "<output_dir>/abandoned/ and start fresh."
            )
    if used(root):
        if train_args.overwrite_output_dir or resume == "auto" or restarted:
            clear(root)
        else:
            raise UsageError(
                f"--output_dir {root} already holds a run ({', '.join(used(root))}): a new run would mix its metrics "
                "with the old ones. Resume it with --resume_from_checkpoint latest, choose another --output_dir, or "
                "pass --overwrite_output_dir true to delete the old run."
            )
    return Claim(resolved=bool(resume or restarted))


def claim_for_another_runs(root: Path, target: Path, overwrite: bool) -> None:
    """A checkpoint outside --output_dir continues there as a fork of its run: into an empty folder, or one cleared
    by --overwrite_output_dir (its metrics and checkpoints would mix with the continuation's otherwise)."""
    if not used(root):
        return
    if overwrite:
        clear(root)
        return
    raise UsageError(
        f"--resume_from_checkpoint {target} continues another run, but --output_dir {root} already holds a run "
        f"({', '.join(used(root))}): the two would mix. Choose an empty --output_dir, or pass --overwrite_output_dir "
        "true to delete the one there."
    )


def checkpoint_repairs(root: Path) -> list[str]:
    return manifest.recover_half_replaced(root)


def used(root: Path) -> list[str]:
    """What another run left in `root` (its metrics, curves, export and checkpoints)."""
    found = [name for name in RUN_FILES if (root / name).exists()]
    return found + [c.name for c in store.checkpoints(root)]


def clear(root: Path) -> None:
    """Delete the old run's files and intact checkpoints; move its damaged checkpoints aside (never deleted)."""
    for name in RUN_FILES:
        path = root / name
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        elif path.exists():
            path.unlink()
    damaged = []
    for ckpt in store.checkpoints(root):
        if manifest.problem(ckpt, checksums=False) is None:
            shutil.rmtree(ckpt, ignore_errors=True)
        else:
            damaged.append(ckpt)
    store.set_aside(root, damaged, "damaged; --overwrite_output_dir starts a fresh run")


def set_aside_newer(root: Path, target: Path, allow_rewind: bool) -> None:
    """Checkpoints newer than the resumed one are moved to <output_dir>/abandoned/<time>/: damaged ones
    always, intact ones only with --allow_rewind (without it they refuse the rewind)."""
    step = store.step_of(target)
    newer = [c for c in store.checkpoints(root) if store.step_of(c) > step]
    intact = [c for c in newer if manifest.problem(c, checksums=False) is None]
    if intact and not allow_rewind:
        raise UsageError(
            f"--resume_from_checkpoint {target}: newer checkpoints exist ({', '.join(c.name for c in intact)}); "
            "resuming would start a second branch that rotation and 'latest' would mix with them. Pass "
            "--allow_rewind true to move them aside to <output_dir>/abandoned/, or resume with latest."
        )
    store.set_aside(root, newer, f"newer than the resumed {target.name}")


def _me() -> dict[str, Any]:
    """What a lock holds: host, pid and, under torchrun, the job's run id (the same in every round)."""
    me: dict[str, Any] = {"host": socket.gethostname(), "pid": os.getpid()}
    if os.environ.get("TORCHELASTIC_RUN_ID"):
        me["job"] = os.environ["TORCHELASTIC_RUN_ID"]
    return me


def _stale(holder: dict[str, Any] | None, me: dict[str, Any]) -> str | None:
    """Why a lock may be taken over: its process is gone (this host: a live one never is), or it is a worker
    of an earlier round of this same torchrun job on another host (its node was lost, or torchrun stopped it,
    before this round started: the rendezvous admits one round at a time)."""
    if not holder:
        return None
    if holder.get("host") == me["host"]:
        return None if _alive(int(holder.get("pid", 0))) else "which is gone"
    if me.get("job") and holder.get("job") == me["job"] and store.restarted():
        return f"a worker of an earlier round of this torchrun job ({me['job']}) on another node"
    return None


def take_lock(root: Path) -> None:
    """One writer per output_dir; released when this process exits."""
    path = root / LOCK
    me = _me()
    for _ in range(2):
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            holder = _read_lock(path)
            if holder == me:
                return
            why = _stale(holder, me)
            if why:
                warn(f"taking over the lock {path} of process {holder['pid']} on {holder['host']}, {why}")
                path.unlink(missing_ok=True)
                continue
            who = f"process {holder['pid']} on {holder['host']}" if holder else "an unknown process"
            raise UsageError(
                f"--output_dir {root} is in use by another run ({who}, lock file {path}): choose another "
                "--output_dir, or wait for that run to end (if it is gone, delete the lock file)."
            ) from None
        with os.fdopen(fd, "w") as f:
            json.dump(me, f)
        _held.add(root)
        return
    raise UsageError(f"--output_dir {root}: could not take the lock {path}; delete it if no run uses the folder.")


_held: set[Path] = set()
_created: list[Path] = []  # folders this process made for --output_dir, innermost first


@atexit.register
def release_locks() -> None:
    """Release the locks this process holds (at the end of a run, on an error and at exit)."""
    while _held:
        path = _held.pop() / LOCK
        if _read_lock(path) == _me():
            path.unlink(missing_ok=True)
    while _created:  # a refused or failed run leaves no empty output folder behind
        try:
            _created.pop(0).rmdir()  # only succeeds on an empty folder
        except OSError:
            _created.clear()  # something was written there (or in a parent): keep it all


def _read_lock(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _alive(pid: int) -> bool:
    """Whether `pid` runs on this host: not a zombie (a killed rank whose parent died too waits for init to reap
    it, seconds in some containers, yet answers signal 0)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True  # no /proc (macOS): signal 0 is all there is


# ---------------------------------------------------------------------- once the process group exists
def check_connectivity(timeout_s: float | None = None, device: Any = None) -> None:
    """The first collectives: a barrier over gloo, then a tiny all-reduce over the training backend on `device`
    (NCCL/RCCL on GPUs); each names the ranks that did not make it instead of hanging."""
    import torch
    import torch.distributed as dist

    from anygpu.runtime import distributed

    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return
    timeout_s = timeout_s or float(os.environ.get("ANYGPU_CONNECT_TIMEOUT_S", "120"))
    backend = dist.get_backend()
    group = None if backend == "gloo" else dist.new_group(backend="gloo")
    try:
        dist.monitored_barrier(group=group, timeout=timedelta(seconds=timeout_s), wait_all_ranks=True)
    except RuntimeError as e:
        raise RuntimeError(
            f"connectivity check failed (backend {backend}, {dist.get_world_size()} ranks, {timeout_s:.0f} s): "
            f"{str(e).splitlines()[0]}. Check that every node runs the same command and reaches MASTER_ADDR."
        ) from e
    device = device or (torch.device("cpu") if backend == "gloo" else torch.device("cuda", torch.cuda.current_device()))
    problem = distributed.probe_transport(device, timeout_s)
    if problem:
        abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
        if backend != "gloo" and abort is not None:
            abort()  # the pending NCCL/RCCL all-reduce would otherwise hold the process at exit
        raise RuntimeError(
            f"transport check failed (backend {backend} on {device.type}, {dist.get_world_size()} ranks): {problem}. "
            "Check the network interface (--ifname, NCCL_SOCKET_IFNAME) and the fabric (NCCL_IB_HCA; NCCL_DEBUG=INFO "
            "says which transport NCCL/RCCL picked)."
        )


def _gather(record: dict[str, Any]) -> list[dict[str, Any]]:
    import torch.distributed as dist

    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return [record]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, record)
    return out


def _first_difference(records: list[dict[str, Any]], what: str) -> None:
    base = records[0]["fields"]
    for r in records[1:]:
        diff = [k for k in sorted(set(base) | set(r["fields"])) if base.get(k) != r["fields"].get(k)]
        if diff:
            k = diff[0]
            raise UsageError(
                f"rank {r['rank']} on host {r['host']} was started with different {what} than rank 0 on host "
                f"{records[0]['host']}: {k} = {r['fields'].get(k)!r} there, {base.get(k)!r} on rank 0"
                + (f" (and {len(diff) - 1} more: {', '.join(diff[1:4])})" if len(diff) > 1 else "")
                + ". Start every node with the same command line, arguments and anygpu version."
            )


def check_ranks(info: Any, resolved: dict[str, Any], output_dir: str) -> None:
    """Connectivity, same arguments and version on every rank, and a shared --output_dir."""
    import torch.distributed as dist

    from anygpu import __version__

    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return
    check_connectivity(device=info.device)
    host = socket.gethostname()
    fields = {k: json.dumps(v, sort_keys=True, default=str) for k, v in resolved.items() if k not in PER_NODE}
    fields["anygpu version"] = __version__
    _first_difference(_gather({"rank": info.rank, "host": host, "fields": fields}), "arguments")
    probe = Path(output_dir) / f".probe-{uuid.uuid4().hex[:12]}"
    if info.rank == 0:
        probe.write_text(host)
    from anygpu.runtime import distributed

    probe = Path(distributed.broadcast_object(str(probe)))
    seen = _gather({"rank": info.rank, "host": host, "sees": probe.exists()})
    dist.barrier()
    if info.rank == 0:
        probe.unlink(missing_ok=True)
    blind = [r for r in seen if not r["sees"]]
    if blind:
        hosts = sorted({r["host"] for r in blind})
        raise UsageError(
            f"--output_dir {output_dir} is not shared: rank(s) {', '.join(str(r['rank']) for r in blind)} on "
            f"{', '.join(hosts)} do not see the file rank 0 wrote there, so checkpoints would hold only some "
            "nodes' shards. Put --output_dir on a filesystem every node mounts (NFS, Lustre, GPFS, …)."
        )


def check_data_agrees(info: Any, corpus_fingerprint: str) -> None:
    """After data preparation: every rank read the same corpus."""
    _first_difference(
        _gather(
            {"rank": info.rank, "host": socket.gethostname(), "fields": {"corpus fingerprint": corpus_fingerprint[:16]}}
        ),
        "data",
    )


# ---------------------------------------------------------------------- the checkpoint to resume, verified once
def agreed_resume(value: str | None, output_dir: str, claim: Claim | None = None) -> Path | None:
    """The checkpoint to resume (see `store.resolve_resume`), the same on every rank: rank 0's verdict from
    `claim_output_dir` (which hashed the files), or rank 0 resolves now; the others receive it (every rank
    hashing the same files would multiply the start-up's reads by the number of ranks)."""
    from anygpu.runtime import distributed

    verdict: tuple[str, str | None] = ("ok", None)
    if int(os.environ.get("RANK", "0")) == 0:
        try:
            resolved = claim is not None and claim.resolved
            target = claim.resume if resolved else store.resolve_resume(value, output_dir, warn=False)
            verdict = ("ok", None if target is None else str(target))
        except UsageError as e:
            verdict = ("refused", str(e))
    kind, text = distributed.broadcast_object(verdict)
    if kind == "refused":
        raise UsageError(text)
    return None if text is None else Path(text)

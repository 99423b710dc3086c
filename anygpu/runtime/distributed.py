"""Process-group set-up and the few collectives the engines need; the only module that
decides ranks, devices and backends (models and data know nothing of distribution)."""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import socket
import tempfile
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Iterator

import torch
import torch.distributed as dist

from anygpu.errors import UsageError
from anygpu.launch.detect import VISIBILITY_VARIABLES
from anygpu.runtime import faults, hardware


@dataclass(frozen=True)
class DistInfo:
    rank: int
    local_rank: int
    world_size: int
    device: torch.device
    owns_group: bool = False  # this run made the process group (and so ends it); a caller's group outlives the run

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def is_local_main(self) -> bool:
        return self.local_rank == 0


def backend_for(device: torch.device) -> str:
    # "nccl" is RCCL on ROCm builds of torch.
    return "nccl" if device.type == "cuda" else "gloo"


def check_local_rank() -> int:
    """This process's LOCAL_RANK, refused in one line when it names no GPU this process can see (more
    processes on the node than visible GPUs), instead of CUDA's "invalid device ordinal" later."""
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if hardware.vendor() == "cpu":
        return local_rank
    count = torch.cuda.device_count()
    if local_rank >= count:
        shown = (
            ", ".join(f"{k}={os.environ[k]!r}" for k in VISIBILITY_VARIABLES if k in os.environ)
            or "no visibility variable set"
        )
        per_node = os.environ.get("LOCAL_WORLD_SIZE", str(local_rank + 1))
        raise UsageError(
            f"LOCAL_RANK {local_rank}: this process sees only {count} GPU(s) ({shown}) but {per_node} processes "
            f"run on this node: start at most {count} per node (--nproc {count}), or make more GPUs visible."
        )
    return local_rank


def init_distributed(timeout_s: int = 1800, cpu_only: bool = False) -> DistInfo:
    """Join the job's process group (torchrun / accelerate launch), or make a 1-rank one for plain python.
    `cpu_only`: gloo on the CPU whatever the node has (a tool that uses no GPU, such as `anygpu prepare`)."""
    local_rank = int(os.environ.get("LOCAL_RANK", 0)) if cpu_only else check_local_rank()
    if hardware.vendor() != "cpu" and not cpu_only:
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    owns = not dist.is_initialized()
    if owns:
        timeout = timedelta(seconds=timeout_s)
        if "MASTER_ADDR" in os.environ:
            dist.init_process_group(
                backend_for(device), timeout=timeout, device_id=device if device.type == "cuda" else None
            )
        else:  # plain `python script.py`: a one-rank group, so FSDP2 and DCP work the same
            dist.init_process_group(
                backend_for(device), init_method=f"file://{_one_rank_store()}", rank=0, world_size=1, timeout=timeout
            )
    return DistInfo(dist.get_rank(), local_rank, dist.get_world_size(), device, owns)


def _one_rank_store() -> str:
    """A file for a one-rank group's store, in a folder removed when the process exits (the store is used
    until then: torch reopens the file on every operation)."""
    folder = tempfile.mkdtemp(prefix="anygpu-pg-")
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    return os.path.join(folder, "store")


_KEEP_TIMEOUT: list = []  # groups that keep the process group's first timeout (a background checkpoint writer's)


def keep_timeout(group) -> None:
    """`group`'s collectives keep their timeout whatever `set_collective_timeout` sets for the others."""
    _KEEP_TIMEOUT.append(group)


def set_collective_timeout(seconds: float) -> None:
    """Every process group of this process (the default one, the mesh's, the CP and CPU groups) times out after
    `seconds` from now on, but those in `keep_timeout`."""
    if not dist.is_initialized():
        return
    from torch.distributed import distributed_c10d as c10d

    timeout = timedelta(seconds=seconds)
    for group in list(c10d._world.pg_map):
        if any(group is kept for kept in _KEEP_TIMEOUT):
            continue
        with contextlib.suppress(ValueError):  # a group this rank is not in
            c10d._set_pg_timeout(timeout, group)


class CollectiveTimeout:
    """The run's collective timeout: `long_s` (--ddp_timeout) until the first step is done, then `train_s`
    (--train_timeout; 0: stay long), so a rank that hangs mid-training ends the job within minutes; the long one
    again inside `long()` (checkpoints, the export: a rank may wait there for another's write)."""

    def __init__(self, long_s: float, train_s: float) -> None:
        self.long_s, self.train_s, self.training = long_s, train_s, False

    def first_step_done(self) -> None:
        if self.train_s and not self.training:
            self.training = True
            set_collective_timeout(self.train_s)

    @contextlib.contextmanager
    def long(self) -> Iterator[None]:
        if not self.training:
            yield
            return
        set_collective_timeout(self.long_s)
        try:
            yield
        finally:
            set_collective_timeout(self.train_s)


def world_size_from_env() -> int:
    """The world size the launcher started, before any process group exists."""
    return int(os.environ.get("WORLD_SIZE", 1))


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _next_key(store, kind: str) -> str:
    """A fresh key for this rank's next wait of `kind`: a per-rank counter held in the job's store, so it lives
    exactly as long as the process group (every rank enters the same waits in the same order)."""
    return f"anygpu/{kind}/{store.add(f'anygpu/{kind}/count/{dist.get_rank()}', 1)}"


@contextlib.contextmanager
def local_main_first(info: DistInfo) -> Iterator[None]:
    """Let local rank 0 of each node do the work (and fill the cache) before the others read it.

    The others wait for as long as it takes (tokenizer training and packing of a large corpus can
    outlast --ddp_timeout), polling the job's key-value store and saying so once a minute, instead
    of waiting in a barrier that the collective timeout would end."""
    store = _store()
    if store is None:  # no process group (tests, plain python): nothing to wait for
        yield
        return
    key = f"{_next_key(store, 'local_main_done')}/{info.rank - info.local_rank}"
    if not info.is_local_main:
        wait_for_key(store, key, "local rank 0 of this node to prepare the tokenizer and the packed data")
        outcome = store.get(key).decode()
        if outcome.startswith("refused:"):  # bad input local rank 0 found: every rank refuses it alike
            raise UsageError(outcome.removeprefix("refused:"))
        if outcome != "ok":
            raise RuntimeError("local rank 0 of this node failed while preparing the data (see its error above)")
    try:
        yield
    except BaseException as e:
        if info.is_local_main:
            store.set(key, f"refused:{e}" if isinstance(e, UsageError) else "failed")
        raise
    if info.is_local_main:
        store.set(key, "ok")


def _store():
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return None
    from torch.distributed import distributed_c10d

    return distributed_c10d._get_default_store()


def wait_for_key(store, key: str, what: str, poll_s: float = 0.5, say_every_s: float = 60.0) -> None:
    """Poll `store` for `key` without a time limit (a dead peer ends the job through the launcher)."""
    import logging
    import time

    start = last = time.monotonic()
    while not store.check([key]):
        time.sleep(poll_s)
        if time.monotonic() - last >= say_every_s:
            last = time.monotonic()
            logging.getLogger("anygpu").warning(
                "rank %d: still waiting for %s (%.0f s)", dist.get_rank(), what, last - start
            )


def wait_for_all(what: str) -> None:
    """A barrier without the collective timeout: every rank posts a key and waits for all of them."""
    store = _store()
    if store is None:
        return
    key = _next_key(store, "all")
    store.set(f"{key}/{dist.get_rank()}", "ok")
    for r in range(dist.get_world_size()):
        wait_for_key(store, f"{key}/{r}", f"rank {r} to finish {what}")


CRASHED = "crashed"


def first_refusal(refusal: str | None, what: str) -> str | None:
    """Every rank's outcome of `what` (None: it went well; a message: bad input it found; "crashed": another
    error, raised there), waited for without a time limit: the first refusal in rank order, so that every rank
    refuses with the same line (rank 0 prints it), or raises when a rank crashed."""
    store = _store()
    if store is None:
        return refusal
    key = _next_key(store, "outcome")
    store.set(f"{key}/{dist.get_rank()}", "ok" if refusal is None else f"no:{refusal}")
    if refusal == CRASHED:  # this rank raises its own error at once; the others learn of it here
        return refusal
    found = None
    for r in range(dist.get_world_size()):
        wait_for_key(store, f"{key}/{r}", f"rank {r} to finish {what}")
        value = store.get(f"{key}/{r}").decode()
        if value == f"no:{CRASHED}":
            raise RuntimeError(f"rank {r} failed while {what} (see its error above)")
        if found is None and value.startswith("no:"):
            found = value[3:]
    return found


def same_on_every_rank(kind: str, value: str, within_s: float) -> bool:
    """Post `value` under a fresh key of `kind` and wait at most `within_s` for every rank to post the same: for a
    rank that may be alone in a failure while the others wait in a collective (which no collective can ask). True
    without a process group. Only the ranks that call it count their keys: they agree only when all of them do."""
    store = _store()
    if store is None:
        return True
    key = _next_key(store, kind)
    store.set(f"{key}/{dist.get_rank()}", value)
    keys = [f"{key}/{r}" for r in range(dist.get_world_size())]
    deadline = time.monotonic() + within_s
    while not store.check(keys):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)
    return all(store.get(k).decode() == value for k in keys)


def probe_transport(device: torch.device, timeout_s: float) -> str:
    """A one-element all-reduce over the training backend on `device` (NCCL/RCCL on GPUs), waited for at most
    `timeout_s`: '' when it completes with the right sum, else what failed, naming the ranks. Each rank reports
    through the job's store, which works whatever the transport does, so a hang names its ranks at once
    instead of waiting for the collective's own timeout (the watchdog's, half an hour by default)."""
    store = _store()
    if store is None:
        return ""
    rank, world = dist.get_rank(), dist.get_world_size()
    key = _next_key(store, "transport")
    faults.at("transport")
    store.set(f"{key}/{rank}", socket.gethostname())
    value = torch.ones(1, device=device)
    work = dist.all_reduce(value, async_op=True)
    deadline = time.monotonic() + timeout_s
    while not work.is_completed() and time.monotonic() < deadline:
        time.sleep(0.01)  # polled, not waited: the wait would block until the backend's own timeout
    if work.is_completed():
        got = value.item()
        return "" if got == world else f"rank {rank} got {got:g} from an all-reduce of ones (expected {world})"
    hosts = {r: store.get(f"{key}/{r}").decode() for r in range(world) if store.check([f"{key}/{r}"])}
    missing = [str(r) for r in range(world) if r not in hosts]
    if missing:
        return f"rank(s) {', '.join(missing)} did not join the all-reduce within {timeout_s:.0f} s"
    return (
        f"every rank joined, but the all-reduce did not complete within {timeout_s:.0f} s: the transport between "
        f"hosts {', '.join(sorted(set(hosts.values())))} fails"
    )


def all_reduce_sum(value: torch.Tensor) -> torch.Tensor:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(value, op=dist.ReduceOp.SUM)
    return value


def any_rank(flag: bool, device: torch.device) -> bool:
    """True on every rank if it is true on one (e.g. a SIGTERM seen by one process).

    Called every step, so it never touches the GPU: one process answers at once, several agree over
    a gloo group on the CPU (a NCCL all-reduce plus `.item()` would make the host wait for the step).
    """
    return any_ranks([flag], device)[0]


def any_ranks(flags: list[bool], device: torch.device) -> list[bool]:
    """`any_rank` of several flags in one collective (e.g. a signal seen, a time-based checkpoint due)."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return list(flags)
    t = torch.tensor([1.0 if f else 0.0 for f in flags])
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=_cpu_group())
    return [bool(v) for v in t.tolist()]


_CPU_GROUP: list = []


def _cpu_group():
    """The default group when it is gloo, else a gloo group over the same ranks (made once, by every rank)."""
    if dist.get_backend() == "gloo":
        return None
    if not _CPU_GROUP:
        _CPU_GROUP.append(dist.new_group(backend="gloo"))
    return _CPU_GROUP[0]


def broadcast_object(obj: object, src: int = 0) -> object:
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def all_gather_object(obj: object) -> list[object]:
    """Every rank's `obj`, in rank order (over the CPU group: small Python values, no device sync)."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return [obj]
    out: list[object] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj, group=_cpu_group())
    return out


def leave(info: DistInfo) -> None:
    """The end of a run: end the process group if the run made it; a caller's group (several runs in one
    process, as the tests make) stays, once every rank has finished this run."""
    if info.owns_group:
        destroy()
    else:
        barrier()


_ENDED_GROUPS: list = []  # every group ended by `destroy` or after `keep_groups`, until the process exits
# released by an exit handler, before the interpreter's own teardown: a group torch frees there (or never)
# aborts the process ("terminate called without an active exception", 12 exits in 30 of `anygpu.tools.collective`)
atexit.register(_ENDED_GROUPS.clear)


def destroy(sync: bool = True) -> None:
    """Leave the process group; `sync` waits for every rank first (a rank that tears gloo down
    while a peer is still in it aborts that peer). Error paths pass sync=False: a peer may never come."""
    if dist.is_initialized():
        if sync and dist.get_world_size() > 1:
            dist.barrier()
        keep_groups()
        dist.destroy_process_group()


def keep_groups() -> None:
    """Keep a Python reference to every process group made so far, for as long as the process lives: call before
    ending groups.

    A gloo group's destructor joins its worker threads. Freed by a DDP reducer (a finished trainer's model), it
    runs with the GIL held, while a worker may still be freeing its last work's tensors, whose Python objects
    need the GIL: a deadlock at the end of a finished run. With this reference, torch's own holder, which frees
    the group without the GIL, is the last one, at exit (tests/test_teardown.py)."""
    from torch.distributed import distributed_c10d as c10d

    _ENDED_GROUPS.extend(c10d._world.pg_map)

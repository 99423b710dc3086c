"""Preparing a corpus's units, spread over every rank of the job (and the processes of each rank), or over the
processes of `anygpu prepare` ahead of it.

Every rank computes the same assignment of all units (largest first, each to the least loaded rank: a pure
function of the file list) and prepares those of its share not found done; a bad file found by any rank is
refused by every rank with the same line. A cache that is not shared between nodes (a local disk) is found
incomplete afterwards: the missing units are then split among the ranks of each node. Rank 0 reports progress
(files and bytes done, rate, time left) while it lasts, and refuses before starting when the cache's disk
cannot hold the estimate of what is to be written."""

from __future__ import annotations

import concurrent.futures
import heapq
import logging
import multiprocessing
import os
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

from anygpu.data import token_units
from anygpu.data.corpus import CorpusPlan
from anygpu.data.readers import ReadStats, documents
from anygpu.data.token_units import Encoder, Unit, is_done, prepare_unit, read_meta, units_folder
from anygpu.data.tokenizer import tokenizer_key
from anygpu.errors import UsageError
from anygpu.runtime import distributed

logger = logging.getLogger("anygpu")

PROGRESS_EVERY_S = 30.0
SAMPLE_BYTES = 64 << 10  # text tokenised to estimate the tokens per byte of each source
EXPANSION = 4.0  # text bytes per file byte assumed for compressed and parquet files (the estimate's only guess)
DISK_MARGIN = 1.1
PIECES_PER_PROCESS = 8  # work items per process at least where a rank has few units: the processes end together
MIN_PIECE_BYTES = 1 << 20  # a piece's own cost (reopening its file, its temporary files, the join) stays under 1%


@dataclass
class PreparedUnits:
    """Every unit of a corpus, done: its key, its meta (token counts, skipped rows), where its files are."""

    units: list[Unit]
    keys: list[str]
    metas: list[dict[str, Any]]
    folder: Path
    dtype: np.dtype
    prepared_now: list[int]  # the units prepared now by the job's ranks (the others were found done)
    seconds: float
    summary: str = ""  # what this start did: prepared some (how much, how fast), or found all done

    def files(self, i: int, split: str) -> Path:
        return self.folder / f"{self.keys[i]}.{split}.bin"

    @property
    def disk_bytes(self) -> int:
        return sum(sum(m["tokens"].values()) for m in self.metas) * self.dtype.itemsize

    def stats(self, source: str) -> ReadStats:
        out = ReadStats()
        for u, m in zip(self.units, self.metas):
            if u.source == source:
                out.add(ReadStats(m["documents"], m["null_rows"], m["bad_rows"], m["bad_files"], m["first_bad"]))
        return out


def assign(sizes: list[int], world: int) -> list[list[int]]:
    """Unit indices per rank: largest first, each to the least loaded rank (ties: the lower rank)."""
    loads = [(0, r) for r in range(world)]
    shares: list[list[int]] = [[] for _ in range(world)]
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        load, r = heapq.heappop(loads)
        shares[r].append(i)
        heapq.heappush(loads, (load + sizes[i], r))
    return [sorted(s) for s in shares]


def run_units(
    todo: list[int], units: list[Unit], keys: list[str], folder: Path, encoder: Encoder, workers: int
) -> None:
    """Prepare units `todo` here: inline, or in `workers` processes (spawned: a rank may hold a GPU context).

    A unit larger than 1/PIECES_PER_PROCESS of a process's share is cut into pieces of about that size (at least
    MIN_PIECE_BYTES; `token_units.pieces`) that the processes tokenise apart and this one joins in order: one file of
    24 MB (one unit) is every process's work, not one's, and they end together. The units' bytes do not depend on it."""
    share = sum(units[i].input_bytes for i in todo) // (max(workers, 1) * PIECES_PER_PROCESS)
    pieces = {i: token_units.pieces(units[i], max(share, MIN_PIECE_BYTES)) for i in todo}
    items = sum(len(cut) for cut in pieces.values())
    if workers <= 1 or items <= 1:
        for i in todo:
            prepare_unit(units[i], encoder, folder, keys[i])
        return
    encoder_file = token_units.write_encoder(encoder, folder)
    try:
        with concurrent.futures.ProcessPoolExecutor(
            min(workers, items), mp_context=multiprocessing.get_context("spawn"),
            initializer=token_units.init_worker, initargs=(encoder_file,),
        ) as pool:  # fmt: skip
            _run_pieces(pool, pieces, units, keys, folder, encoder)
    finally:
        os.unlink(encoder_file)


def _run_pieces(
    pool, pieces: dict[int, list[Unit]], units: list[Unit], keys: list[str], folder: Path, encoder: Encoder
) -> None:
    """Units whole (one piece: the worker publishes it) or in pieces (joined here, in order, once all are done)."""
    futures = {
        i: [pool.submit(token_units.work_piece, piece, folder, keys[i]) for piece in cut]
        if len(cut) > 1
        else [pool.submit(token_units.work, units[i], folder, keys[i])]
        for i, cut in pieces.items()
    }
    try:
        for i, done in futures.items():
            results = [future.result() for future in done]  # the first failure (a bad file) is raised here
            if len(pieces[i]) > 1:
                token_units.join_pieces(units[i], encoder.dtype, folder, keys[i], results)
    except BaseException:
        pool.shutdown(cancel_futures=True)  # the rest is not started; the pieces done are removed
        for i, done in futures.items():
            if len(pieces[i]) > 1:
                token_units.remove_pieces([f.result() for f in done if not f.cancelled() and not f.exception()])
        raise


class Progress(threading.Thread):
    """Rank 0's report every PROGRESS_EVERY_S while units are prepared (it reads the cache: every rank's work)."""

    def __init__(self, units: list[Unit], keys: list[str], folder: Path, every_s: float = PROGRESS_EVERY_S) -> None:
        super().__init__(daemon=True)
        self.units, self.keys, self.folder, self.every_s = units, keys, folder, every_s
        self.stop = threading.Event()
        self.start_time = time.monotonic()
        self.done_at_start = self.scan()

    def scan(self) -> list[bool]:
        return [is_done(self.folder, k) for k in self.keys]

    def line(self, done: list[bool]) -> str:
        files: dict[str, bool] = {}
        for u, d in zip(self.units, done):
            files[u.file.path] = files.get(u.file.path, True) and d
        total = sum(u.input_bytes for u in self.units)
        finished = sum(u.input_bytes for u, d in zip(self.units, done) if d)
        new = sum(u.input_bytes for u, d, was in zip(self.units, done, self.done_at_start) if d and not was)
        rate = new / max(time.monotonic() - self.start_time, 1e-9)
        left = (total - finished) / rate if rate > 0 else float("nan")
        return (
            f"preparing the data: {sum(files.values())} of {len(files)} files, {finished / 1e9:.2f} of "
            f"{total / 1e9:.2f} GB done, {rate / 1e6:.1f} MB/s, {describe_seconds(left)} left"
        )

    def run(self) -> None:
        while not self.stop.wait(self.every_s):
            logger.info(self.line(self.scan()))


def describe_seconds(seconds: float) -> str:
    if seconds != seconds:  # NaN: no rate yet
        return "time still unknown"
    minutes = round(seconds / 60)
    if seconds < 90:
        return f"about {seconds:.0f} s"
    return f"about {minutes // 60} h {minutes % 60} min" if minutes >= 60 else f"about {minutes} min"


def sample_texts(units: list[Unit], limit: int = SAMPLE_BYTES) -> dict[str, list[str]]:
    """The first documents of each source's first unit among `units`, up to `limit` bytes each."""
    found: dict[str, list[str]] = {}
    for u in units:
        if u.source not in found:
            found[u.source], size = [], 0
            for text in documents(u.reading, u.file, u.part, ReadStats()):
                found[u.source].append(text)
                size += len(text.encode("utf-8", errors="replace"))
                if size >= limit:
                    break
    return found


def estimate_bytes(units: list[Unit], samples: dict[str, list[str]], encoder: Encoder) -> int:
    """Disk the token files of `units` will take: tokens per text byte measured on each source's sample, file
    bytes as text bytes (times EXPANSION for compressed and parquet files)."""
    per_byte = {}
    for source, texts in samples.items():
        size = sum(len(t.encode("utf-8", errors="replace")) for t in texts)
        per_byte[source] = sum(len(x) + 1 for x in encoder(texts)) / max(size, 1) if texts else 1.0
    expanded = lambda u: EXPANSION if u.file.compression or u.file.builder == "parquet" else 1.0  # noqa: E731
    return int(sum(u.input_bytes * expanded(u) * per_byte[u.source] for u in units) * encoder.dtype.itemsize)


def check_room(folder: Path, needed: int, cache_dir: str, num_units: int) -> None:
    probe = next(p for p in (folder, *folder.parents) if p.exists())
    free = shutil.disk_usage(probe).free
    if needed * DISK_MARGIN > free:
        raise UsageError(
            f"--data_cache_dir {cache_dir}: the {num_units} file part(s) still to prepare need about "
            f"{needed * DISK_MARGIN / 1e9:.2f} GB there and its disk has {free / 1e9:.2f} GB free: free space, or give "
            "a --data_cache_dir on a larger disk."
        )


def _agreed(step: Callable[[], None], what: str) -> None:
    """Run `step` on this rank; every rank then refuses with the first refusal any rank met."""
    try:
        step()
        refusal = None
    except UsageError as e:
        refusal = str(e)
    except BaseException:
        distributed.first_refusal(distributed.CRASHED, what)
        raise
    found = distributed.first_refusal(refusal, what)
    if found is not None:
        raise UsageError(found)


def _job() -> tuple[int, int, int, int]:
    """(rank, processes, local rank, processes on this node) as the launcher set them (DataParallel's one
    process driving several GPUs is one process)."""
    env = os.environ
    return (
        int(env.get("RANK", 0)),
        int(env.get("WORLD_SIZE", 1)),
        int(env.get("LOCAL_RANK", 0)),
        int(env.get("LOCAL_WORLD_SIZE", 1)),
    )


def prepare_units(plan: CorpusPlan, tokenizer, cache_dir: str, workers: int) -> PreparedUnits:
    """Every unit of `plan` prepared (by this job's ranks together) or found done; each rank returns them all."""
    start, tok_id = time.monotonic(), tokenizer_key(tokenizer)
    units, folder, dtype = plan.units(), units_folder(cache_dir, tok_id), token_units.token_dtype(tokenizer)
    keys = [u.key(tok_id) for u in units]
    rank, world, local_rank, local_world = _job()
    if (metas := token_units.read_index(folder, keys)) is not None:  # all done before: one read, whatever the parts
        prepared = PreparedUnits(units, keys, metas, folder, dtype, [], time.monotonic() - start)
        prepared.summary = summary(prepared, plan, world, workers)
        return prepared
    missing = {i for i, k in enumerate(keys) if not is_done(folder, k)}
    encoder: list[Encoder] = []

    def room() -> None:  # also: how to tokenise (the sample tells whether the tokenizer's backend alone will do)
        if missing:
            samples = sample_texts([units[i] for i in sorted(missing)])
            encoder.append(Encoder(tokenizer, [t for texts in samples.values() for t in texts[:64]]))
            check_room(folder, estimate_bytes([units[i] for i in sorted(missing)], samples, encoder[0]), cache_dir,
                       len(missing))  # fmt: skip

    _agreed(room, "checking the cache's disk")
    progress = Progress(units, keys, folder) if rank == 0 and missing else None
    if progress is not None:
        token_units.remove_stale_temps(folder)
        progress.start()
    try:
        share = [i for i in assign([u.input_bytes for u in units], world)[rank] if i in missing]
        _agreed(lambda: run_units(share, units, keys, folder, encoder[0] if encoder else None, workers),
                "preparing the data")  # fmt: skip
        # a cache that is not shared between nodes: what the other nodes wrote is missing here
        still = [i for i, k in enumerate(keys) if not is_done(folder, k)]
        mine = [still[j] for j in assign([units[i].input_bytes for i in still], local_world)[local_rank]]
        if mine and not encoder:  # found missing only now (another node's share, on a disk of this node's own)
            encoder.append(Encoder(tokenizer, []))
        _agreed(lambda: run_units(mine, units, keys, folder, encoder[0] if encoder else None, workers),
                "preparing the data on this node")  # fmt: skip
    finally:
        if progress is not None:
            progress.stop.set()
    metas = [read_meta(folder, k) for k in keys]
    if local_rank == 0:  # the next start reads this one file (each node: its cache may be its own)
        token_units.write_index(folder, keys, metas)
    prepared = PreparedUnits(units, keys, metas, folder, dtype, sorted(missing), time.monotonic() - start)
    prepared.summary = summary(prepared, plan, world, workers)
    if rank == 0:
        logger.info("prepared data: %s, in %s", prepared.summary, folder.parent)
    return prepared


def summary(prepared: PreparedUnits, plan: CorpusPlan, world: int, workers: int) -> str:
    """What this start did to the data: prepared some of it (how much, how fast), or found it all done."""
    if not prepared.prepared_now:
        return f"all {plan.num_files} files found done ({prepared.seconds:.1f} s to check)"
    new_bytes = sum(prepared.units[i].input_bytes for i in prepared.prepared_now)
    found = len(prepared.units) - len(prepared.prepared_now)
    return (
        f"{len(prepared.prepared_now)} file part(s), {new_bytes / 1e9:.3f} GB, tokenised in {prepared.seconds:.1f} s "
        f"by {world} rank(s) × {max(1, workers)} process(es) ({new_bytes / 1e6 / max(prepared.seconds, 1e-9):.1f} MB/s)"
        + (f"; {found} found done" if found else "")
    )

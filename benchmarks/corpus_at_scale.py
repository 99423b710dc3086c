"""Raw text at scale, two measurements on jsonl files of the embedded standard-library text (cycled, each pass
numbered, in files of about 1 MB):

1. Preparation throughput per core: ours (tokenising the files' parts into the cache, as every rank and
   `anygpu prepare` do) in 1 process and in one per core, against `datasets` in one process (`load_dataset("json")`
   of the same files, then `map` of the same tokenizer call: what a run_clm-style script does). Fresh caches.
   Per core is MB per CPU-second (worker processes included): on cores shared with other jobs, wall time
   measures their load; wall-clock MB/s is printed too.
2. After preparation, a run on a corpus `--scale` times larger (and in as many times more files): each rank's peak
   resident memory (its whole process) and the time from process start to the end of the first step (rank 0's
   CPU seconds, and wall seconds), 2 ranks, the data found prepared. Targets: memory ≤ 1.2×, start-up ≤ 1.3×.

    .venv/bin/python benchmarks/corpus_at_scale.py [--base_mb 10] [--scale 20] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import anygpu  # noqa: E402
from _scratch import scratch_folder

anygpu.set_offline_defaults()
# The library is imported inside the functions: preparation's worker processes are spawned, and each imports
# this module again (it must stay light, as the engines' entry points are).
FILE_MB = 1.0


def write_corpus(mb: float, folder: Path) -> float:
    """`mb` MB of standard-library text as jsonl files of about FILE_MB each; the MB of text written."""
    from anygpu.data import sources

    folder.mkdir(parents=True)
    texts = sources.stdlib_corpus(5.0)["train"]["text"]
    total, size, files, rnd, out = 0, 0, 0, 0, None
    while total < mb * 1e6:
        for t in texts:
            if total >= mb * 1e6:
                break
            if out is None or size >= FILE_MB * 1e6:
                if out is not None:
                    out.close()
                out, size, files = open(folder / f"part{files:05d}.jsonl", "w"), 0, files + 1
            text = t if rnd == 0 else f"# pass {rnd}\n{t}"
            out.write(json.dumps({"text": text}) + "\n")
            size, total = size + len(text), total + len(text)
        rnd += 1
    out.close()
    return total / 1e6


def tokenizer_folder(tmp: Path) -> Path:
    from anygpu.data import sources
    from anygpu.data import tokenizer as tok_lib

    texts = sources.stdlib_corpus(5.0, max_mb=4)["train"]["text"]
    tok = tok_lib.train_bpe(texts, 8192)
    tok.save_pretrained(str(tmp / "tokenizer"))
    return tmp / "tokenizer"


def timed(work) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process and of the children it waited for) of `work()`."""
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu, wall = time.process_time(), time.perf_counter()
    work()
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    spent = after.ru_utime + after.ru_stime - children.ru_utime - children.ru_stime
    return time.perf_counter() - wall, time.process_time() - cpu + spent


def ours(folder: Path, tok, cache: Path, workers: int) -> tuple[float, float]:
    """(wall, CPU) seconds to prepare every part of `folder` into a fresh `cache`."""
    from anygpu.config.args import parse_args
    from anygpu.data import corpus, shared_prep

    args = parse_args(["--train_file", str(folder), "--data_cache_dir", str(cache)])[1]
    return timed(lambda: shared_prep.prepare_units(corpus.plan_corpus(args), tok, str(cache), workers))


def with_datasets(folder: Path, tok, cache: Path) -> tuple[float, float]:
    """(wall, CPU) seconds of `load_dataset("json")` of the files and a one-process `map` tokenising them."""
    from datasets import load_dataset

    def work() -> None:
        ds = load_dataset("json", data_files=sorted(str(p) for p in folder.glob("*.jsonl")), split="train",
                          cache_dir=str(cache))  # fmt: skip
        ds.map(lambda b: {"input_ids": tok(b["text"], add_special_tokens=False)["input_ids"]}, batched=True,
               remove_columns=["text"])  # fmt: skip

    return timed(work)


def run_two_ranks(folder: Path, tok_dir: Path, cache: Path, out: Path) -> tuple[float, float, list[int]]:
    """(wall and CPU seconds of rank 0 from process start to the end of the first step, each rank's peak
    resident bytes)."""
    cmd = [str(Path(sys.executable).parent / "torchrun"), "--standalone", "--nproc-per-node", "2",
           "benchmarks/_rank_peak.py", "--config_name", "tiny", "--train_file", str(folder), "--tokenizer_name",
           str(tok_dir), "--data_cache_dir", str(cache), "--block_size", "256", "--global_batch_size", "8",
           "--max_steps", "3", "--eval_steps", "0", "--max_eval_samples", "8", "--export_final", "false",
           "--save_strategy", "no", "--report_to", "none", "--disable_tqdm", "true", "--output_dir", str(out),
           "--overwrite_output_dir", "true"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, check=False)
    text = proc.stdout + proc.stderr
    first = re.search(r"first step done ([\d.]+) s after the process started \(([\d.]+) s of CPU\)", text)
    if proc.returncode != 0 or first is None:
        raise SystemExit(f"the run failed ({proc.returncode}):\n{text[-4000:]}")
    assert "found done" in text, "the data was not found prepared"
    peaks = [int(b) for _, b in sorted(re.findall(r"^PEAK (\d+) (\d+)$", text, flags=re.MULTILINE))]
    return float(first.group(1)), float(first.group(2)), peaks


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base_mb", type=float, default=10)
    p.add_argument("--scale", type=int, default=20)
    p.add_argument("--rounds", type=int, default=2)
    a = p.parse_args()
    from anygpu.data import tokenizer as tok_lib

    tmp = Path(scratch_folder("anygpu-scale-"))
    cores = len(os.sched_getaffinity(0))
    base_mb = write_corpus(a.base_mb, tmp / "base")
    big_mb = write_corpus(a.base_mb * a.scale, tmp / "big")
    tok_dir = tokenizer_folder(tmp)
    tok = tok_lib.load_or_train(str(tok_dir), lambda: [], "", 0, str(tmp), True)
    print(f"corpora: {base_mb:.1f} MB in {len(list((tmp / 'base').iterdir()))} files, {big_mb:.1f} MB in "
          f"{len(list((tmp / 'big').iterdir()))} files; tokenizer: byte-level BPE, 8192 tokens; {cores} cores", flush=True)  # fmt: skip

    runs: dict[str, list[tuple[float, float]]] = {"datasets, 1 process": [], "ours, 1 process": [],
                                                   f"ours, {cores} processes": []}  # fmt: skip
    for r in range(a.rounds):  # alternating, so load from other jobs hits each
        runs["datasets, 1 process"].append(with_datasets(tmp / "base", tok, tmp / f"hf{r}"))
        runs["ours, 1 process"].append(ours(tmp / "base", tok, tmp / f"one{r}", 1))
        runs[f"ours, {cores} processes"].append(ours(tmp / "base", tok, tmp / f"all{r}", cores))
    per_core = {}
    for name, values in runs.items():
        per_core[name] = statistics.median(base_mb / cpu for _, cpu in values)
        print(f"{name}: {per_core[name]:.2f} MB per CPU-second (rounds {', '.join(f'{base_mb / c:.2f}' for _, c in values)}); "
              f"wall {statistics.median(base_mb / w for w, _ in values):.2f} MB/s")  # fmt: skip
    ours_core = per_core["ours, 1 process"]
    print(f"per core, ours / datasets = {ours_core / per_core['datasets, 1 process']:.2f}; 1 TB on 64 cores at "
          f"{ours_core:.2f} MB/s a core: {1e6 / (64 * ours_core) / 3600:.1f} h")  # fmt: skip

    wall, cpu = ours(tmp / "big", tok, tmp / "cache-big", cores)
    print(
        f"prepared the {big_mb:.0f} MB corpus in {wall:.1f} s with {cores} processes ({big_mb / cpu:.2f} MB per CPU-second)"
    )
    ours(tmp / "base", tok, tmp / "cache-base", cores)
    starts: dict[str, list[tuple[float, float]]] = {"base": [], "big": []}
    peaks: dict[str, list[float]] = {"base": [], "big": []}
    for r in range(a.rounds):
        for name in ("base", "big"):
            wall, cpu, ranks = run_two_ranks(tmp / name, tok_dir, tmp / f"cache-{name}", tmp / f"out-{name}")
            starts[name].append((wall, cpu))
            peaks[name].append(max(ranks) / 2**20)
            print(f"round {r + 1}, {name}: first step done {wall:.1f} s after start ({cpu:.1f} s of CPU); peak per "
                  f"rank {', '.join(f'{b / 2**20:.0f}' for b in ranks)} MiB", flush=True)  # fmt: skip
    mem = statistics.median(peaks["big"]) / statistics.median(peaks["base"])
    cpu = statistics.median(c for _, c in starts["big"]) / statistics.median(c for _, c in starts["base"])
    wall = statistics.median(w for w, _ in starts["big"]) / statistics.median(w for w, _ in starts["base"])
    print(f"{a.scale}x corpus after preparation / 1x: peak memory per rank {mem:.3f} (target <= 1.2), time to the "
          f"first step {cpu:.3f} in CPU seconds, {wall:.3f} in wall seconds (target <= 1.3)")  # fmt: skip


if __name__ == "__main__":
    main()

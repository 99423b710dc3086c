"""Preparing text: what `--extra_mb` more text costs the engine's preparation (tokenise + pack, with its
default worker processes) against what a one-process `datasets.map` tokenisation of that text takes.
Target (2 cores): extra time <= 0.67x the one-process time; in general about 1 / cores.

Both corpora are the embedded standard-library text (cycled past its ~12 MB), saved to disk first (file-backed, as a user's
corpus is: `datasets.map` then streams its output to Arrow cache files). Fresh caches, no reuse. With `--jsonl`, each
corpus is one jsonl file given as `--train_file` is: its parts tokenised into memory-mapped token streams by the
run's worker processes (`shared_prep`), then cut into rows.

    .venv/bin/python benchmarks/prepare_text.py [--base_mb 2] [--extra_mb 24] [--rounds 2] [--jsonl]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import anygpu
from _scratch import scratch_folder

anygpu.set_offline_defaults()  # before datasets is imported
# The library is imported inside the functions: --jsonl's worker processes are spawned, and each imports this
# module again (it must stay light, as the engines' entry points are).


def corpus(mb: float, folder: str):
    """`mb` MB of standard-library text (the library cycled, each pass numbered, past its ~12 MB), in a
    fresh folder: datasets keeps `map` results next to the data, so a reused folder would hit that cache."""
    from datasets import Dataset, DatasetDict, load_from_disk

    from anygpu.data import sources

    full = sources.stdlib_corpus(5.0)
    texts, size, rnd = [], 0, 0
    while size < mb * 1e6:
        for t in full["train"]["text"]:
            if size >= mb * 1e6:
                break
            texts.append(t if rnd == 0 else f"# pass {rnd}\n{t}")
            size += len(texts[-1])
        rnd += 1
    DatasetDict(train=Dataset.from_dict({"text": texts}), validation=full["validation"]).save_to_disk(folder)
    return load_from_disk(folder)


def jsonl_file(raw, path: str) -> str:
    """The training texts of `raw` as one jsonl file (its validation documents are then held out by the corpus
    path's own share)."""
    with open(path, "w") as f:
        for text in raw["train"]["text"]:
            f.write(json.dumps({"text": text}) + "\n")
    return path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base_mb", type=float, default=2)
    p.add_argument("--extra_mb", type=float, default=24)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--jsonl", action="store_true", help="each corpus as one jsonl file (the --train_file path)")
    a = p.parse_args()
    from datasets import load_from_disk

    from anygpu.config.args import parse_args
    from anygpu.data import corpus as corpus_lib
    from anygpu.data import corpus_rows, formats, packing, shared_prep
    from anygpu.data import tokenizer as tok_lib
    from anygpu.data.prepare import preprocessing_workers, rank_workers

    logging.basicConfig(level=logging.INFO, format="[%(levelname)s] %(message)s")
    tmp = scratch_folder("anygpu-prep-")
    base, big = corpus(a.base_mb, f"{tmp}/base"), corpus(a.base_mb + a.extra_mb, f"{tmp}/big")
    fresh = lambda ds, name: (ds.save_to_disk(f"{tmp}/{name}"), load_from_disk(f"{tmp}/{name}"))[1]  # noqa: E731
    tok = tok_lib.train_bpe(formats.training_texts(base["train"], formats.TEXT, "text"), 8192)
    mb = lambda d: sum(ds.data.nbytes for ds in d.values()) / 1e6  # noqa: E731
    if a.jsonl:  # the run's own process count (one per core, none idle on a small corpus), for the larger corpus
        files = {name: jsonl_file(raw, f"{tmp}/{name}.jsonl") for name, raw in (("base", base), ("big", big))}
        workers = rank_workers(None, os.path.getsize(files["big"]))
    else:
        files, workers = {}, preprocessing_workers(None, big["train"].data.nbytes)

    def prepare(raw, name: str) -> float:
        start = time.perf_counter()
        packing.pack(raw, tok, 256, "text", f"bench-{name}", f"{tmp}/cache-{name}", workers)
        return time.perf_counter() - start

    def prepare_file(path: str, name: str) -> float:
        args = parse_args(["--train_file", path, "--data_cache_dir", f"{tmp}/cache-{name}"])[1]
        start = time.perf_counter()
        plan = corpus_lib.plan_corpus(args)
        prepared = shared_prep.prepare_units(plan, tok, args.data_cache_dir, workers)
        corpus_rows.source_rows(prepared, plan, 256, args.validation_split_percentage)
        return time.perf_counter() - start

    extra_mb = mb(big) - mb(base)
    # the reference: one process tokenising the extra text with datasets.map, nothing else
    extra = big["train"].select(range(len(base["train"]), len(big["train"])))

    def tokenize(batch: dict) -> dict:
        return {"input_ids": tok(batch["text"], add_special_tokens=False)["input_ids"]}

    def one_process(name: str) -> float:
        start = time.perf_counter()
        extra.map(tokenize, batched=True, remove_columns=["text"], cache_file_name=f"{tmp}/one-process-{name}.arrow")
        return (time.perf_counter() - start) * extra_mb / (extra.data.nbytes / 1e6)  # scaled to all the extra text

    ratios = []
    what = "one-file jsonl" if a.jsonl else "saved data set"
    for r in range(a.rounds):  # alternating, so load from other jobs hits both
        one = one_process(str(r))
        if a.jsonl:
            t_base, t_big = prepare_file(files["base"], f"base{r}"), prepare_file(files["big"], f"big{r}")
        else:
            t_base, t_big = prepare(fresh(base, f"base{r}"), f"base{r}"), prepare(fresh(big, f"big{r}"), f"big{r}")
        added = t_big - t_base
        ratios.append(added / one)
        print(
            f"round {r + 1} ({what}): {mb(base):.1f} MB in {t_base:.1f} s, {mb(big):.1f} MB in {t_big:.1f} s with "
            f"{workers} processes: {extra_mb:.1f} MB more cost {added:.1f} s ({extra_mb / added:.2f} MB/s); "
            f"one-process datasets.map of it {one:.1f} s ({extra_mb / one:.2f} MB/s); ratio {added / one:.2f}",
            flush=True,
        )
    print(
        f"preparing {extra_mb:.1f} MB more text ({what}) with {workers} processes / one-process datasets.map "
        f"tokenisation = {statistics.median(ratios):.2f} (median of {a.rounds}; target <= 0.67)"
    )


if __name__ == "__main__":
    main()

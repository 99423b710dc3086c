"""Raw text at scale, in one process: files, folders, globs and compressed files; parts of a file that together
read every document once; preparation that resumes after an interruption and redoes an edited file alone;
memory-mapped rows; the mixture's order; the refusals of bad sources and mixtures. (Runs on several ranks, the
losses and the mixture measured from what was trained: tests/test_mixture_runs.py.)"""

from __future__ import annotations

import gzip
import json
import os
import random
import re
import time

import numpy as np
import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from anygpu.config.args import parse_args
from anygpu.config.batch import plan_batch
from anygpu.config.mixture import exact_weight
from anygpu.data import corpus, files, readers, shared_prep, token_units
from anygpu.data import tokenizer as tok_lib
from anygpu.data.mixture_order import MixtureOrder, permute
from anygpu.data.readers import Reading, ReadStats
from anygpu.data.token_rows import Concatenation, TokenBlocks
from anygpu.errors import UsageError

WORDS = "alpha beta gamma delta epsilon zeta theta iota kappa lambda sigma omega".split()


def sentence(rng: random.Random, low: int = 3, high: int = 40) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(low, high)))


def write_corpus(root, files_count: int = 4, rows: int = 120, seed: int = 0) -> None:
    """A folder of jsonl files, a .txt of paragraphs, a gzip-compressed jsonl and a parquet file."""
    rng = random.Random(seed)
    root.mkdir(parents=True, exist_ok=True)
    for i in range(files_count):
        (root / f"part{i}.jsonl").write_text("".join(json.dumps({"text": sentence(rng)}) + "\n" for _ in range(rows)))
    (root / "notes.txt").write_text("\n\n".join(f"{sentence(rng)}\n{sentence(rng)}" for _ in range(rows)))
    with gzip.open(root / "more.jsonl.gz", "wt") as f:
        f.writelines(json.dumps({"text": sentence(rng)}) + "\n" for _ in range(rows))
    pd.DataFrame({"text": [sentence(rng) for _ in range(rows)]}).to_parquet(root / "table.parquet", row_group_size=17)
    (root / "README.md").write_text("not data")


def data_args(*extra: str):
    return parse_args(["--config_name", "tiny", *extra])[1]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    rng = random.Random(5)
    return tok_lib.train_bpe((sentence(rng) for _ in range(500)), 300)


# ---------------------------------------------------------------------- files and parts
def test_a_folder_a_glob_and_a_file_expand_to_readable_files_in_order(tmp_path):
    write_corpus(tmp_path / "c")
    folder = [os.path.basename(f.path) for f in files.expand(str(tmp_path / "c"), "--train_file")]
    assert folder == ["more.jsonl.gz", "notes.txt", "part0.jsonl", "part1.jsonl", "part2.jsonl", "part3.jsonl",
                      "table.parquet"]  # fmt: skip
    glob = files.expand(str(tmp_path / "c" / "part*.jsonl"), "--train_file")
    assert [os.path.basename(f.path) for f in glob] == folder[2:6]
    gz = files.expand(str(tmp_path / "c" / "more.jsonl.gz"), "--train_file")[0]
    assert (gz.builder, gz.compression, gz.num_parts) == ("json", "gzip", 1)


@pytest.mark.parametrize("layout", ["lines", "paragraphs", "jsonl", "parquet"])
@settings(max_examples=12, deadline=None)
@given(part_bytes=st.integers(16, 400), piece_bytes=st.integers(4, 200), seed=st.integers(0, 10**6))
def test_the_parts_of_a_file_read_every_document_once_in_order(tmp_path_factory, layout, part_bytes, piece_bytes, seed):
    rng = random.Random(seed)
    docs = [sentence(rng, 1, 12) for _ in range(rng.randint(2, 40))]  # 2+: one paragraph alone reads as lines
    path = tmp_path_factory.mktemp("parts") / {"lines": "a.txt", "paragraphs": "a.txt", "jsonl": "a.jsonl",
                                                "parquet": "a.parquet"}[layout]  # fmt: skip
    if layout == "lines":
        path.write_text("\n".join(docs) + "\n")
    elif layout == "paragraphs":  # two lines per paragraph, separated by one or more blank lines
        path.write_text("".join(f"{d}\n{d.upper()}\n" + "\n" * rng.randint(1, 3) for d in docs))
        docs = [f"{d}\n{d.upper()}" for d in docs]
    elif layout == "jsonl":
        path.write_text("".join(json.dumps({"text": d}) + "\n" + "\n" * rng.randint(0, 1) for d in docs))
    else:
        pd.DataFrame({"text": docs}).to_parquet(path, row_group_size=rng.randint(1, 5))
    f = files.data_file(str(path), part_bytes)
    reading = Reading("--train_file", "text", "auto", False)
    read = [t for p in range(f.num_parts) for t in readers.documents(reading, f, p, ReadStats())]
    assert read == docs and (f.num_parts > 1 or f.size <= part_bytes)
    # and so do the pieces that worker processes tokenise apart, part by part
    units = [token_units.Unit("train", f, p, reading, 0) for p in range(f.num_parts)]
    cut = [piece for u in units for piece in token_units.pieces(u, piece_bytes)]
    assert [t for piece in cut for t in readers.documents(reading, piece.file, piece.part, ReadStats())] == docs


# ---------------------------------------------------------------------- bad rows
def bad_reading(tmp_path, content: bytes, name: str = "a.jsonl", skip: bool = False):
    path = tmp_path / name
    path.write_bytes(content)
    f = files.data_file(str(path))
    stats = ReadStats()
    return lambda: list(readers.documents(Reading("--train_file", "text", "auto", skip), f, 0, stats)), stats


@pytest.mark.parametrize(
    "content, expected",
    [
        (b'{"text": "fine"}\n{"text": "also fine"}\n{"text": broken\n', "a.jsonl line 3: not JSON"),
        (b'{"text": "fine"}\n\n{"text": 7}\n', "a.jsonl line 3: --text_column 'text' holds int64 values, not text"),
        (b'{"text": "fine"}\n["a list"]\n', "a.jsonl line 2: a list, not an object with a 'text' key"),
        (b'{"text": "caf\xe9"}\n', "a.jsonl line 1: not JSON (UnicodeDecodeError"),
    ],
)
def test_a_bad_row_is_refused_naming_the_file_and_line_or_dropped_and_counted(tmp_path, content, expected):
    read, _ = bad_reading(tmp_path, content)
    with pytest.raises(UsageError, match=re.escape(expected)) as e:
        read()
    assert "--skip_bad_rows true" in str(e.value) and "\n" not in str(e.value)
    read, stats = bad_reading(tmp_path, content, skip=True)
    assert read() == [t for t in ("fine", "also fine") if f'"{t}"'.encode() in content]
    assert stats.bad_rows == 1 and expected.split(": ")[0] in stats.first_bad


def test_a_json_file_without_the_text_key_is_refused_and_rows_without_it_are_null(tmp_path):
    """A file of a folder whose rows all lack the column is refused, as a parquet or CSV file without it (it was read
    as null rows: the folder trained on its other files alone); rows without it among rows with it stay null rows."""
    for name, content in (("b.jsonl", b'{"content": "x"}\n{"content": "y"}\n'), ("c.json", b'[{"content": "x"}]')):
        read, _ = bad_reading(tmp_path, content, name)
        with pytest.raises(
            UsageError, match=re.escape(f"{name}: --text_column 'text' is not one of its columns ['content']")
        ):
            read()
    read, stats = bad_reading(tmp_path, b'{"text": "fine"}\n{"content": "y"}\n')
    assert read() == ["fine"] and stats.null_rows == 1


def test_a_bad_file_in_parts_is_counted_once_and_read_by_none(tmp_path):
    path = tmp_path / "a.jsonl"
    path.write_bytes(b"\0" + b'{"text": "after a NUL byte"}\n' * 40)
    f, stats = files.data_file(str(path), 64), ReadStats()
    reading = Reading("--train_file", "text", "auto", True)
    assert [t for p in range(f.num_parts) for t in readers.documents(reading, f, p, stats)] == []
    assert f.num_parts > 10 and (stats.bad_files, stats.bad_rows, stats.documents) == (1, 0, 0)


def test_a_truncated_compressed_file_is_refused_or_kept_as_far_as_it_reads(tmp_path):
    whole = gzip.compress("".join(json.dumps({"text": f"row {i}"}) + "\n" for i in range(5000)).encode())
    read, _ = bad_reading(tmp_path, whole[: len(whole) // 2], "a.jsonl.gz")
    with pytest.raises(UsageError, match="a.jsonl.gz cannot be read past document"):
        read()
    read, stats = bad_reading(tmp_path, whole[: len(whole) // 2], "a.jsonl.gz", skip=True)
    assert 0 < len(read()) < 5000 and stats.bad_files == 1


# ---------------------------------------------------------------------- refusals before any work
def refusal(argv: list[str]) -> str:
    with pytest.raises(UsageError) as e:
        args = parse_args(argv)[1]
        corpus.plan_corpus(args)
    message = str(e.value)
    assert "\n" not in message
    return message


def mixture(tmp_path, *entries: dict) -> list[str]:
    return ["--dataset_mixture", json.dumps({"datasets": list(entries)})]


def test_bad_sources_and_mixtures_are_refused_in_one_line(tmp_path):
    write_corpus(tmp_path / "c")
    (tmp_path / "empty").mkdir()
    (tmp_path / "chat.jsonl").write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    (tmp_path / "body.jsonl").write_text(json.dumps({"body": "text"}) + "\n")
    web = {"name": "web", "path": str(tmp_path / "c" / "part*.jsonl")}
    cases = {
        "--train_file": ["--train_file", str(tmp_path / "nothing-*.jsonl")],
        "holds no text file": ["--train_file", str(tmp_path / "empty")],
        "weight -0.2: give a number ≥ 0": mixture(
            tmp_path, web, {"name": "x", "path": str(tmp_path / "c"), "weight": -0.2}
        ),  # fmt: skip
        "the weights sum to 0": mixture(tmp_path, {**web, "weight": 0}),
        "unknown key(s) columns": mixture(tmp_path, {**web, "columns": ["text"]}),
        "two sources are named 'web'": mixture(tmp_path, web, web),
        "no file matches it": mixture(tmp_path, {"name": "gone", "path": str(tmp_path / "gone/*.txt")}),
        "--text_column 'text' is not a column": mixture(
            tmp_path, web, {"name": "b", "path": str(tmp_path / "body.jsonl")}
        ),
        "holds messages rows: a mixture's sources are raw text": mixture(
            tmp_path, web, {"name": "chat", "path": str(tmp_path / "chat.jsonl")}
        ),
        "both name the data": [*mixture(tmp_path, web), "--train_file", str(tmp_path / "chat.jsonl")],
    }
    for expected, argv in cases.items():
        assert expected in refusal(argv), (expected, refusal(argv))


def test_a_run_config_holds_the_mixture_as_trl_writes_it(tmp_path):
    write_corpus(tmp_path / "c")
    cfg = tmp_path / "run.yaml"
    cfg.write_text(
        "config_name: tiny\ndataset_mixture:\n  datasets:\n"
        f"    - {{name: web, path: {tmp_path}/c/part*.jsonl, weight: 0.7}}\n"
        f"    - {{name: table, path: {tmp_path}/c/table.parquet, weight: 0.3, text_column: text}}\n"
    )
    plan = corpus.plan_corpus(parse_args([str(cfg), "--validation_split_percentage", "10"])[1])
    assert plan.mixture and [(s.name, s.weight, len(s.files)) for s in plan.sources] == [("web", 0.7, 4),
                                                                                         ("table", 0.3, 1)]  # fmt: skip


def test_weights_in_exponent_form_and_sources_without_a_name_are_taken(tmp_path):
    """1e-3 and 1e-05 are numbers (YAML 1.1 reads them as text: a YAML file's and a run config's, which reaches the
    command line as JSON written by json.dumps); an unnamed source is named by its path up to any glob, made valid."""
    write_corpus(tmp_path / "c")
    (tmp_path / "my data.jsonl").write_text(json.dumps({"text": "the sky is blue " * 40}) + "\n")
    glob_source = {"path": str(tmp_path / "c" / "part*.jsonl"), "weight": 1e-05}
    cfg = tmp_path / "run.yaml"
    cfg.write_text(
        f"config_name: tiny\ndataset_mixture:\n  datasets:\n    - {{path: {tmp_path}/c/table.parquet, weight: 1e-3}}\n"
    )
    for argv in (mixture(tmp_path, glob_source, {"path": str(tmp_path / "my data.jsonl")}), [str(cfg)]):
        plan = corpus.plan_corpus(parse_args([*argv, "--validation_split_percentage", "10"])[1])
        assert {s.name: s.weight for s in plan.sources} in ({"part": 1e-05, "my_data": 1.0}, {"table": 1e-3}), argv


# ---------------------------------------------------------------------- preparation
def prepared(tmp_path, tokenizer, *extra: str, cache: str = "cache"):
    args = data_args("--train_file", str(tmp_path / "c"), "--data_cache_dir", str(tmp_path / cache), *extra)
    plan = corpus.plan_corpus(args)
    return plan, shared_prep.prepare_units(plan, tokenizer, args.data_cache_dir, workers=1)


def bin_files(folder) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.glob("*.bin"))}


def test_an_interrupted_preparation_resumes_where_it_stopped(tmp_path, tokenizer, monkeypatch):
    write_corpus(tmp_path / "c")
    _, whole = prepared(tmp_path, tokenizer, cache="whole")
    monkeypatch.setenv("ANYGPU_TEST_INTERRUPT_PREPARE", str(token_units._prepared_here[0] + 3))
    with pytest.raises(KeyboardInterrupt):
        prepared(tmp_path, tokenizer)  # Ctrl-C in the third unit, its token files written but not in place
    folder = tmp_path / "cache" / whole.folder.relative_to(tmp_path / "whole")
    assert len(list(folder.glob("*.json"))) == 2 and not list(folder.glob(".*.tmp"))
    monkeypatch.delenv("ANYGPU_TEST_INTERRUPT_PREPARE")
    _, resumed = prepared(tmp_path, tokenizer)
    assert len(resumed.prepared_now) == len(whole.units) - 2  # the two done are not redone
    assert bin_files(folder) == bin_files(whole.folder)


def test_worker_processes_write_the_bytes_one_process_writes_and_a_start_after_reads_one_index(tmp_path, tokenizer):
    write_corpus(tmp_path / "c")
    _, one = prepared(tmp_path, tokenizer, cache="one")
    args = data_args("--train_file", str(tmp_path / "c"), "--data_cache_dir", str(tmp_path / "two"))
    two = shared_prep.prepare_units(corpus.plan_corpus(args), tokenizer, args.data_cache_dir, workers=2)  # spawned
    assert bin_files(two.folder) == bin_files(one.folder) and len(bin_files(one.folder)) == 14
    assert len(list((two.folder.parent / "corpora").glob("*.json"))) == 1
    for meta in two.folder.glob("*.json"):
        meta.unlink()  # a start after preparation reads the corpus's index, not the parts' files
    again = shared_prep.prepare_units(corpus.plan_corpus(args), tokenizer, args.data_cache_dir, workers=2)
    assert again.prepared_now == [] and again.metas == two.metas and "found done" in again.summary


def test_one_file_is_cut_into_pieces_of_one_size_enough_for_every_process():
    f = files.DataFile("/data/corpus.jsonl", 24_000_000, 0, "json", None)  # one 24 MB file: one unit
    unit = token_units.Unit("train", f, 0, Reading("--train_file", "text", "auto", False), 0)
    for workers in (2, 3, 8):
        share = f.size // (workers * shared_prep.PIECES_PER_PROCESS)
        sizes = [p.input_bytes for p in token_units.pieces(unit, max(share, shared_prep.MIN_PIECE_BYTES))]
        assert sum(sizes) == f.size and len(set(sizes[:-1])) == 1 and sizes[-1] <= sizes[0]
        assert len(sizes) >= min(workers * shared_prep.PIECES_PER_PROCESS, f.size // shared_prep.MIN_PIECE_BYTES)


def test_pieces_from_worker_processes_join_to_the_bytes_and_counts_of_one_process(tmp_path, tokenizer, monkeypatch):
    write_corpus(tmp_path / "c")
    _, one = prepared(tmp_path, tokenizer, cache="one")
    monkeypatch.setattr(shared_prep, "MIN_PIECE_BYTES", 1024)  # pieces of a few kB
    args = data_args("--train_file", str(tmp_path / "c"), "--data_cache_dir", str(tmp_path / "two"))
    plan = corpus.plan_corpus(args)
    share = sum(u.input_bytes for u in plan.units()) // (2 * shared_prep.PIECES_PER_PROCESS)
    cut = [len(token_units.pieces(u, max(share, 1024))) > 1 for u in plan.units()]
    assert sum(cut) == 5  # the four .jsonl files and the .txt; the gzip and parquet files whole
    two = shared_prep.prepare_units(plan, tokenizer, args.data_cache_dir, workers=2)  # spawned
    assert bin_files(two.folder) == bin_files(one.folder) and not list(two.folder.glob(".*.tmp"))
    without_seconds = lambda metas: [{k: v for k, v in m.items() if k != "seconds"} for m in metas]  # noqa: E731
    assert without_seconds(two.metas) == without_seconds(one.metas)


def test_a_bad_row_in_a_piece_is_refused_and_the_pieces_leave_no_files(tmp_path, tokenizer, monkeypatch):
    rng = random.Random(3)
    rows = [json.dumps({"text": sentence(rng)}) for _ in range(400)]
    rows[300] = '{"text": broken'
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "one.jsonl").write_text("\n".join(rows) + "\n")
    monkeypatch.setattr(shared_prep, "MIN_PIECE_BYTES", 1024)
    args = data_args("--train_file", str(tmp_path / "c"), "--data_cache_dir", str(tmp_path / "cache"))
    with pytest.raises(UsageError, match="one.jsonl line 301: not JSON"):
        shared_prep.prepare_units(corpus.plan_corpus(args), tokenizer, args.data_cache_dir, workers=2)
    assert not [p.name for p in (tmp_path / "cache").rglob("*") if p.is_file()]


def test_an_edited_file_is_prepared_again_alone(tmp_path, tokenizer):
    write_corpus(tmp_path / "c")
    plan, first = prepared(tmp_path, tokenizer)
    before = {p.name: p.stat().st_mtime_ns for p in first.folder.glob("*.bin")}
    time.sleep(0.01)
    with open(tmp_path / "c" / "part2.jsonl", "a") as f:
        f.write(json.dumps({"text": "one more document about alpha"}) + "\n")
    plan, again = prepared(tmp_path, tokenizer)
    assert [again.units[i].file.path for i in again.prepared_now] == [str(tmp_path / "c" / "part2.jsonl")]
    after = {p.name: p.stat().st_mtime_ns for p in again.folder.glob("*.bin")}
    assert len(set(after) - set(before)) == 2  # the edited file's two streams, under a new key
    assert all(after[n] == before[n] for n in before)  # every other unit's untouched
    assert again.metas[again.prepared_now[0]]["documents"] == 121


def test_a_cache_disk_without_room_is_refused_before_any_tokenising(tmp_path, tokenizer, monkeypatch):
    write_corpus(tmp_path / "c")
    monkeypatch.setattr(shared_prep.shutil, "disk_usage", lambda path: _usage(1000))
    with pytest.raises(UsageError, match=r"--data_cache_dir .*cache: the 7 file part\(s\) still to prepare need about"):
        prepared(tmp_path, tokenizer)
    assert not list((tmp_path / "cache").rglob("*.json"))


def _usage(free: int):
    import collections

    return collections.namedtuple("usage", "total used free")(free, 0, free)


def test_progress_says_files_and_bytes_done_the_rate_and_the_time_left(tmp_path, tokenizer):
    write_corpus(tmp_path / "c")
    plan = corpus.plan_corpus(data_args("--train_file", str(tmp_path / "c")))
    units = plan.units()
    progress = shared_prep.Progress(units, [f"k{i}" for i in range(len(units))], tmp_path)
    progress.start_time -= 10
    line = progress.line([True, True, False, False, False, False, False])
    done_mb = (units[0].input_bytes + units[1].input_bytes) / 1e6
    assert re.fullmatch(
        r"preparing the data: 2 of 7 files, 0\.00 of 0\.\d\d GB done, (\d+\.\d) MB/s, about \d+ (s|min) left", line
    ), line
    assert float(re.search(r"([\d.]+) MB/s", line).group(1)) == pytest.approx(done_mb / 10, abs=0.06)


# ---------------------------------------------------------------------- rows and the mixture's order
def test_rows_are_the_concatenated_streams_cut_into_blocks(tmp_path):
    streams = [np.arange(n, dtype=np.uint16) + 1000 * i for i, n in enumerate((5, 0, 17, 3, 40))]
    paths = []
    for i, s in enumerate(streams):
        paths.append(tmp_path / f"{i}.bin")
        s.tofile(paths[-1])
    rows = TokenBlocks(paths, [len(s) for s in streams], "uint16", 6)
    flat = np.concatenate(streams)
    assert len(rows) == len(flat) // 6
    assert np.array_equal(rows[list(range(len(rows)))]["input_ids"], flat[: len(rows) * 6].reshape(-1, 6))
    both = Concatenation([rows.select(range(2, 5)), rows.select([0, 9])])
    assert np.array_equal(both[[4, 0, 3]]["input_ids"], rows[[9, 2, 0]]["input_ids"])


def mixture_order(sizes=(500, 300, 40), weights=("0.7", "0.2", "0.1"), G=12, seed=1) -> MixtureOrder:
    return MixtureOrder(sizes, tuple(exact_weight(float(w)) for w in weights), ("web", "code", "math")[: len(sizes)],
                        G, seed)  # fmt: skip


@settings(max_examples=25, deadline=None)
@given(step=st.integers(0, 3000), seed=st.integers(0, 50))
def test_a_mixture_global_batch_is_the_same_whatever_the_world_size(step, seed):
    order = mixture_order(seed=seed)
    batch = order.global_batch(step)
    for W in (1, 2, 3, 4, 6):
        got = [i for r in range(W) for mb in order.micro_batches(step, plan_batch(12, W), r) for i in mb]
        assert got == batch


def test_a_mixture_draws_exact_shares_and_each_source_whole_epochs():
    order = mixture_order(G=64)
    steps = 4 * order.window // 64  # four whole windows
    indices = np.array([i for s in range(steps) for i in order.global_batch(s)])
    source = np.searchsorted([0, 500, 800, 840], indices, side="right") - 1
    counts = np.bincount(source)
    assert all(abs(c - len(indices) * w) < 3 for c, w in zip(counts, (0.7, 0.2, 0.1))), counts
    assert order.drawn(steps) == dict(zip(("web", "code", "math"), counts.tolist()))
    for s, (low, n) in enumerate(((0, 500), (500, 300), (800, 40))):
        drawn = indices[source == s]
        for e in range(len(drawn) // n):  # each epoch of a source: every row once
            assert sorted(drawn[e * n : (e + 1) * n].tolist()) == list(range(low, low + n))
    begun = [(s, e) for s in range(1, 20) for e in order.epochs_begun(s)]
    first_past = next(s for s in range(1, 20) if order.drawn(s)["math"] > 40)  # math gives 6.4 rows a step
    assert begun[0] == (first_past, ("math", 2)) and [e for _, (n, e) in begun if n == "math"][:2] == [2, 3]


def test_an_evaluated_only_source_adds_nothing_to_an_epoch_and_is_named_with_its_own_weight():
    """A weight-0 source (its validation blocks evaluated, never trained on) left the epoch longer: the trained sources
    then ran past their epoch under --num_train_epochs. A source with no full block is named with the weight given."""
    from fractions import Fraction

    from anygpu.data.mixture_order import MixtureOrder

    order = MixtureOrder((500, 300, 40), (Fraction(7), Fraction(3), Fraction(0)), ("web", "code", "eval"), 64, 0)
    assert order.num_samples == 800 and order.steps_per_epoch == 12
    with pytest.raises(UsageError, match="source 'math' has weight 1 but no full block"):
        MixtureOrder((500, 0), (Fraction(1), Fraction(1)), ("web", "math"), 64, 0)


def test_the_feistel_permutation_is_a_permutation():
    for n in (1, 2, 3, 5, 64, 100, 4097):
        assert sorted(permute(np.arange(n), n, 7).tolist()) == list(range(n))


def test_files_as_editors_and_exporters_write_them_read_as_their_documents(tmp_path):
    """A UTF-8 byte-order mark, CRLF line ends, a CSV cell over two lines, a JSON array, dictionary-encoded parquet
    strings, and a link from a subfolder back up to the folder (followed once)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "a.jsonl").write_bytes(b'\xef\xbb\xbf{"text": "first"}\r\n{"text": "second"}\r\n')
    (tmp_path / "b.txt").write_bytes(b"\xef\xbb\xbfline one\r\nline two\r\n")
    (tmp_path / "c.csv").write_bytes(b'\xef\xbb\xbftext,id\r\n"two\nlines",1\r\nplain,2\r\n')
    (tmp_path / "d.json").write_bytes(b'\xef\xbb\xbf[{"text": "item one"}, {"text": "item two"}]')
    pq.write_table(pa.table({"text": pa.array(["x y", "z"]).dictionary_encode()}), tmp_path / "e.parquet")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "up").symlink_to(tmp_path)
    reading = Reading("--train_file", "text", "auto", False)
    found = {os.path.basename(f.path): list(readers.documents(reading, f, 0, ReadStats()))
             for f in files.expand(str(tmp_path), "--train_file")}  # fmt: skip
    assert found == {
        "a.jsonl": ["first", "second"],
        "b.txt": ["line one", "line two"],
        "c.csv": ["two\nlines", "plain"],
        "d.json": ["item one", "item two"],
        "e.parquet": ["x y", "z"],
    }


def test_a_validation_file_is_the_validation_set_and_no_training_document_is_held_out(tmp_path, tokenizer):
    from anygpu.data import corpus_rows

    write_corpus(tmp_path / "c")
    (tmp_path / "val.txt").write_text("\n".join(f"omega omega {i}" for i in range(400)))
    args = data_args("--train_file", str(tmp_path / "c" / "part*.jsonl"), "--validation_file",
                     str(tmp_path / "val.txt"), "--data_cache_dir", str(tmp_path / "cache"))  # fmt: skip
    plan = corpus.plan_corpus(args)
    done = shared_prep.prepare_units(plan, tokenizer, args.data_cache_dir, workers=1)
    rows = corpus_rows.source_rows(done, plan, 16, 5.0)
    train, validation = rows.train[corpus.SINGLE], rows.validation[corpus.SINGLE]
    assert sum(m["tokens"]["validation"] for m in done.metas[:4]) == 0  # the training files hold nothing out
    eos = tokenizer.eos_token
    texts = [tokenizer.decode(r).replace(eos, " ") for r in validation[list(range(len(validation)))]["input_ids"]]
    assert len(validation) > 10 and all(set(t) <= set("omega 0123456789\n") for t in texts)  # blocks cut words
    assert len(train) * 16 == sum(m["tokens"]["train"] for m in done.metas) // 16 * 16

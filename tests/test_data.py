"""Data: every file format, the embedded corpus, caching, tokenizer reuse, the global order."""

import json
import logging

import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from anygpu.config.args import DataArguments
from anygpu.config.batch import plan_batch
from anygpu.data import formats, order, packing, sources
from anygpu.data import tokenizer as tok_lib

DOCS = [f"def f{i}(x):\n    return x * {i} + {i % 7}  # doc {i}\n" * (3 + i % 5) for i in range(120)]


def write(tmp_path, fmt: str, column: str = "text"):
    path = tmp_path / f"corpus.{fmt}"
    if fmt == "txt":
        path.write_text("\n\n".join(DOCS))
    elif fmt == "jsonl":
        path.write_text("".join(json.dumps({column: d, "id": i}) + "\n" for i, d in enumerate(DOCS)))
    elif fmt == "csv":
        pd.DataFrame({column: DOCS}).to_csv(path, index=False)
    elif fmt == "parquet":
        pd.DataFrame({column: DOCS}).to_parquet(path)
    return path


@pytest.mark.parametrize("fmt,column", [("txt", "text"), ("jsonl", "content"), ("csv", "body"), ("parquet", "text")])
def test_file_formats_pack_into_blocks(tmp_path, fmt, column):
    path = write(tmp_path, fmt, column)
    args = DataArguments(train_file=str(path), text_column=column, data_cache_dir=str(tmp_path / "cache"))
    raw, is_default = sources.load_raw_text(args)
    assert not is_default and len(raw["validation"]) >= 1 and len(raw["train"]) > len(raw["validation"])
    fp = sources.fingerprint(raw, column)
    tok = tok_lib.train_bpe(formats.training_texts(raw["train"], formats.TEXT, column), 400)
    packed = packing.pack(raw, tok, 16, column, fp, args.data_cache_dir)
    blocks = packed["train"]["input_ids"]
    assert blocks and all(len(b) == 16 for b in blocks)
    # no text lost but the final partial block: tokens = documents' tokens + one EOS each
    n_tokens = sum(len(tok(t, add_special_tokens=False)["input_ids"]) + 1 for t in raw["train"][column] if t)
    assert len(blocks) == n_tokens // 16


def test_wrong_text_column_is_named(tmp_path):
    path = write(tmp_path, "jsonl", "content")
    with pytest.raises(ValueError, match="--text_column 'text' is not a column .*'content'"):
        sources.load_raw_text(DataArguments(train_file=str(path), data_cache_dir=str(tmp_path)))


def test_packing_and_tokenizer_are_cached(tmp_path, caplog):
    path = write(tmp_path, "txt")
    args = DataArguments(train_file=str(path), data_cache_dir=str(tmp_path / "c"))
    raw, _ = sources.load_raw_text(args)
    fp = sources.fingerprint(raw, "text")
    texts = lambda: formats.training_texts(raw["train"], formats.TEXT, "text")  # noqa: E731
    with caplog.at_level(logging.INFO):
        tok = tok_lib.load_or_train(None, texts, fp, 400, args.data_cache_dir, True)
        packing.pack(raw, tok, 16, "text", fp, args.data_cache_dir)
        assert "training a byte-level BPE" in caplog.text and "from cache" not in caplog.text
        caplog.clear()
        tok2 = tok_lib.load_or_train(None, texts, fp, 400, args.data_cache_dir, True)
        again = packing.pack(raw, tok2, 16, "text", fp, args.data_cache_dir)
    assert "training a byte-level BPE" not in caplog.text and "packed data from cache" in caplog.text
    assert tok2.get_vocab() == tok.get_vocab() and len(again["train"]) > 0
    # another corpus gets another tokenizer
    raw2, _ = sources.load_raw_text(DataArguments(train_file=str(write(tmp_path, "csv")), data_cache_dir=str(tmp_path)))
    assert sources.fingerprint(raw2, "text") != fp


def test_embedded_corpus_is_the_stdlib_split_deterministically():
    a = sources.stdlib_corpus(5.0, max_mb=2)
    b = sources.stdlib_corpus(5.0, max_mb=2)
    assert a["train"]["text"] == b["train"]["text"] and a["validation"]["text"] == b["validation"]["text"]
    assert 0 < len(a["validation"]) < len(a["train"])
    assert not set(a["validation"]["text"]) & set(a["train"]["text"])
    assert any("def " in t for t in a["train"]["text"])
    full = sum(p.stat().st_size for p in sources.stdlib_files())
    assert full > 5e6  # megabytes of real text on every machine


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(1, 300), G=st.sampled_from([1, 2, 4, 6, 8, 12, 24]), step=st.integers(0, 50), seed=st.integers(0, 5)
)
def test_global_batch_is_the_same_whatever_the_split(n, G, step, seed):
    if n < G:
        with pytest.raises(ValueError, match="--global_batch_size"):
            order.GlobalOrder(n, G, seed)
        return
    go = order.GlobalOrder(n, G, seed)
    batch = go.global_batch(step)
    assert len(batch) == G and len(set(batch)) == G
    for W in [w for w in (1, 2, 3, 4, 6) if G % w == 0]:
        plan = plan_batch(G, W)
        got = [i for r in range(W) for mb in go.micro_batches(step, plan, r) for i in mb]
        assert got == batch
    # within an epoch no sample repeats
    if step < go.steps_per_epoch:
        seen = [i for s in range(go.steps_per_epoch) for i in go.global_batch(s)]
        assert len(seen) == len(set(seen))


def test_eval_shards_cover_every_sample_once_with_equal_batch_counts():
    for n, W, bs in [(10, 3, 2), (7, 4, 8), (3, 4, 1), (256, 2, 8)]:
        shards = [order.eval_shards(n, W, r, bs) for r in range(W)]
        assert len({len(s) for s in shards}) == 1
        assert sorted(i for s in shards for b in s for i in b) == list(range(n))

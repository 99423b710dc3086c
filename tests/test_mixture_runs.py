"""A mixture of three raw-text sources (jsonl files, gzip-compressed jsonl with its own text column, parquet),
trained for real: the same losses on 1, 2 and 3 ranks and resumed from 2 ranks on 3; the shares measured from the
rows that were trained; preparation split over 2 and 3 ranks writing the very bytes one process writes; the
HF engine on the same data with the same losses and keys. Four launches, shared by every test here."""

from __future__ import annotations

import gzip
import json
import random
from pathlib import Path

import pandas as pd
import pytest
from conftest import TINY, assert_close, losses, python, records, torchrun

pytestmark = pytest.mark.slow

GREEK = "alpha beta gamma delta epsilon zeta theta iota kappa lambda sigma omega".split()
NUMBERS = "one two three four five six seven eight nine".split()
WEIGHTS = {"web": 0.5, "code": 0.3, "math": 0.2}
STEPS, G = 12, 6


def write_sources(root: Path) -> dict:
    """Three sources with vocabularies of their own, so a trained row's text says which one it came from."""
    rng = random.Random(0)
    (root / "web").mkdir(parents=True)
    (root / "code").mkdir()
    for i in range(3):
        docs = [" ".join(rng.choice(GREEK) for _ in range(rng.randint(4, 30))) for _ in range(150)]
        (root / "web" / f"w{i}.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    for i in range(2):
        with gzip.open(root / "code" / f"c{i}.jsonl.gz", "wt") as f:
            for _ in range(120):
                body = " + ".join(f"x{rng.randint(0, 9)}" for _ in range(rng.randint(2, 12)))
                f.write(json.dumps({"content": f"def f(x): return {body}"}) + "\n")
    math = [" ".join(f"{rng.choice(NUMBERS)} plus {rng.choice(NUMBERS)}" for _ in range(3)) for _ in range(30)]
    pd.DataFrame({"text": math}).to_parquet(root / "math.parquet")
    return {
        "datasets": [
            {"name": "web", "path": str(root / "web" / "*.jsonl"), "weight": WEIGHTS["web"]},
            {"name": "code", "path": str(root / "code"), "weight": WEIGHTS["code"], "text_column": "content"},
            {"name": "math", "path": str(root / "math.parquet"), "weight": WEIGHTS["math"]},
        ]
    }


def source_of(text: str) -> str:
    """A 32-token row of code always holds a '+' or a 'def', one of math a 'plus'; web's hold neither."""
    if "plus" in text:
        return "math"
    if "+" in text or "def" in text:
        return "code"
    assert any(w in text for w in GREEK), text
    return "web"


def run_args(root: Path, out: str, cache: str, *extra: str) -> list[str]:
    at = TINY.index("--max_corpus_mb")
    base = TINY[:at] + TINY[at + 2 :]  # the data is given
    return [
        *base,
        *("--block_size", "32", "--global_batch_size", str(G), "--vocab_size", "400", "--max_steps", str(STEPS)),
        *("--eval_steps", "6", "--output_dir", str(root / out), "--data_cache_dir", str(root / cache), *extra),
    ]


def args(root: Path, out: str, cache: str, *extra: str) -> list[str]:
    return [*run_args(root, out, cache, *extra), "--dataset_mixture", str(root / "mixture.json")]


def outputs(proc) -> str:
    return proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[Path, dict[str, str]]:
    """Each launch's stdout and stderr: r1 (1 rank, cache c1), hf (the HF engine, c1 found done), r2 (2 ranks to
    step 4, c2), then in one launch of 3 ranks r3 (c3) and r2 resumed (c3 found done)."""
    root = tmp_path_factory.mktemp("mixture")
    (root / "mixture.json").write_text(json.dumps(write_sources(root / "data")))
    out = {"r1": outputs(python("run_fsdp_standalone.py", args(root, "r1", "c1")))}
    out["hf"] = outputs(python("run_hf_standalone.py", args(root, "hf", "c1")))
    script = "tests/scripts/fsdp_runs.py"
    out["r2"] = outputs(torchrun(2, script, args(root, "r2", "c2", "--save_steps", "4", "--stop_at_step", "4")))
    resumed = args(root, "r2", "c3", "--resume_from_checkpoint", "latest")
    out["r3+resumed"] = outputs(torchrun(3, script, [*args(root, "r3", "c3"), ":::", *resumed]))
    return root, out


def test_a_mixture_trains_the_same_losses_on_1_2_and_3_ranks_and_resumed_on_another(runs):
    root, out = runs
    reference = losses(root / "r1")
    assert sorted(reference) == list(range(1, STEPS + 1))
    assert_close(reference, losses(root / "r3"), rel=1e-5)
    assert_close(reference, losses(root / "r2"), rel=1e-5)  # steps 1-4 on 2 ranks, 5-12 resumed on 3
    assert "at step 4 (was 2 ranks, now 3" in out["r3+resumed"]
    evals = {run: [r for r in records(root / run) if "eval_loss" in r] for run in ("r1", "r3")}
    assert [r["step"] for r in evals["r1"]] == [6, 12]
    for a, b in zip(evals["r1"], evals["r3"]):
        for key in ("eval_loss", "eval_loss/web", "eval_loss/code", "eval_loss/math"):
            assert a[key] == pytest.approx(b[key], rel=1e-5), key
        per_source = [a[f"eval_loss/{n}"] for n in WEIGHTS]
        assert min(per_source) <= a["eval_loss"] <= max(per_source)  # the token mean over all of them


def test_the_shares_measured_from_the_trained_rows_follow_the_weights(runs):
    import torch

    from anygpu.config.args import parse_args
    from anygpu.data.prepare import prepare
    from anygpu.runtime.distributed import DistInfo

    root, out = runs
    m, d, t = parse_args(args(root, "replay", "c1"))
    prep = prepare(m, d, t, DistInfo(0, 0, 1, torch.device("cpu")))  # the run's data, found prepared
    counts = dict.fromkeys(WEIGHTS, 0)
    for step in range(STEPS):
        for row in prep.datasets["train"][prep.order.global_batch(step)]["input_ids"]:
            counts[source_of(prep.tokenizer.decode(row))] += 1
    logged = [r for r in records(root / "r1") if "loss" in r][-1]
    assert {n: logged[f"samples/{n}"] for n in WEIGHTS} == counts
    n = STEPS * G
    for name, weight in WEIGHTS.items():  # a draw without replacement from the window's quotas: within 3 σ
        assert abs(counts[name] / n - weight) <= 3 * (weight * (1 - weight) / n) ** 0.5, counts
    assert [r for r in records(root / "r3") if "loss" in r][-1]["samples/math"] == counts["math"]
    assert "source math: every block drawn once;" in out["r1"] and "begins its epoch 2" in out["r1"]


def test_preparation_split_over_ranks_writes_the_bytes_one_process_writes(runs):
    root, out = runs

    def units(cache: str) -> dict[str, bytes]:
        return {p.name: p.read_bytes() for p in sorted((root / cache).glob("prepared/*/units/*.bin"))}

    one = units("c1")
    assert len(one) == 2 * 6 and units("c2") == one and units("c3") == one  # 6 files, 2 streams each
    assert "by 1 rank(s)" in out["r1"] and "by 2 rank(s)" in out["r2"] and "by 3 rank(s)" in out["r3+resumed"]
    assert "all 6 files found done" in out["r3+resumed"] and "all 6 files found done" in out["hf"]


def test_the_hf_engine_trains_the_mixture_as_the_native_one(runs):
    root, _ = runs
    assert_close(losses(root / "r1"), losses(root / "hf"), rel=1e-4)
    keys = lambda run: {k for r in records(root / run) for k in r if "/" in k}  # noqa: E731
    assert keys("hf") == keys("r1") == {f"{p}/{n}" for p in ("samples", "eval_loss") for n in WEIGHTS}


def test_a_bad_row_in_another_ranks_share_is_refused_once_by_the_job(tmp_path):
    """The corrupt file is the smaller one: the assignment (largest first) gives it to rank 1, which finds the
    row; every rank refuses with its line, which rank 0 alone prints."""
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "a.jsonl").write_text(
        "".join(json.dumps({"text": "alpha beta " * 30}) + "\n" for _ in range(200))
    )
    (tmp_path / "data" / "b.jsonl").write_text(json.dumps({"text": "gamma delta"}) + "\n" + '{"text": broken\n')
    tok = tmp_path / "tokenizer"
    from anygpu.data.tokenizer import train_bpe

    train_bpe(["alpha beta gamma delta"] * 20, 300).save_pretrained(str(tok))
    proc = torchrun(
        2,
        "run_fsdp_standalone.py",
        [*run_args(tmp_path, "out", "cache"), "--train_file", str(tmp_path / "data"), "--tokenizer_name", str(tok)],
        check=False,
    )  # fmt: skip
    errors = [line for line in (proc.stdout + proc.stderr).splitlines() if line.startswith("error: ")]
    assert proc.returncode != 0 and len(errors) == 1, proc.stderr[-3000:]
    assert "b.jsonl line 2: not JSON" in errors[0] and "--skip_bad_rows true" in errors[0]

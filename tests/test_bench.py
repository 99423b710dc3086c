"""`anygpu bench --nproc 1,2` on CPU: one short fixed job per process count (the launcher's own
command, with the engine arguments given after `--`), a table of tokens/s, per process and scaling efficiency,
and the PNG plot."""

from __future__ import annotations

import json

import pytest
from conftest import python


@pytest.mark.slow
def test_bench_one_and_two_processes(tmp_path):
    out = tmp_path / "bench"
    proc = python(  # the runs forked from a process that has imported the engines (tests/scripts/warm_tool.py)
        "tests/scripts/warm_tool.py",
        [
            "bench",
            "--engine",
            "fsdp",
            "--nproc",
            "1,2",
            "--config_name",
            "tiny",
            "--block_size",
            "64",
            "--max_steps",
            "3",
            "--output_dir",
            str(out),
            "--",  # engine arguments, after bench's own
            "--lr_scheduler_type",
            "constant",
        ],
        check=False,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [ln.split() for ln in proc.stdout.splitlines() if ln.strip()[:1].isdigit()]
    assert [r[0] for r in rows] == ["1", "2"] and rows[0][3] == "100.0%"
    results = json.loads((out / "bench.json").read_text())
    assert [r["nproc"] for r in results] == [1, 2]
    for r in results:
        assert r["tokens_per_second"] > 0 and r["mfu"] is None  # no MFU on CPU
        assert r["tokens_per_second_per_process"] == pytest.approx(r["tokens_per_second"] / r["nproc"])
        assert r["scaling_efficiency"] == pytest.approx(
            r["tokens_per_second_per_process"] / results[0]["tokens_per_second"]
        )
    png = out / "bench.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # each run trained the same global batch
    for n in (1, 2):
        recs = [json.loads(ln) for ln in (out / f"nproc{n}" / "metrics.jsonl").read_text().splitlines()]
        steps = [r for r in recs if "loss" in r]
        assert len(steps) == 3 and {(r["global_batch_size"], r["world_size"]) for r in steps} == {(8, n)}
        assert len({r["learning_rate"] for r in steps}) == 1 and steps[0]["learning_rate"] > 0  # `-- …` reached it
        assert not list((out / f"nproc{n}").glob("checkpoint-*"))  # a measurement writes no checkpoint


def test_bad_counts_are_refused():
    from anygpu.tools import bench

    assert bench.main(["--nproc", "0,2"]) == 2
    assert bench.parse_counts("4,1,2,2") == [1, 2, 4]


def test_a_model_given_after_the_separator_is_not_overridden_by_the_default_preset():
    from anygpu.tools import bench

    args = bench.build_parser().parse_args([])
    assert bench.engine_args(args, 8, bench.Path("o"))[:2] == ["--config_name", "default"]
    args.engine_args = ["--model_name_or_path", "Qwen/Qwen3-30B-A3B", "--ep", "8"]
    built = bench.engine_args(args, 8, bench.Path("o"))
    assert "--config_name" not in built and built[-4:] == args.engine_args
    args.engine_args = ["--model_name_or_path=Qwen/Qwen3-30B-A3B"]  # argparse's other spelling
    assert "--config_name" not in bench.engine_args(args, 8, bench.Path("o"))
    args.config_name = "moe.json"  # given: kept
    assert bench.engine_args(args, 8, bench.Path("o"))[:2] == ["--config_name", "moe.json"]

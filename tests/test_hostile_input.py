"""Hostile input gets our one-line error (UsageError: exit 2, printed once) or a valid configuration;
never a crash deep in a worker, never a silent empty run. Every other error keeps its traceback."""

from __future__ import annotations

import json
import subprocess

import pytest
import yaml
from conftest import ROOT, TINY, WARM, env
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from anygpu.config.args import DataArguments, ModelArguments, TrainArguments, parse_args
from anygpu.engines.fsdp import main
from anygpu.errors import UsageError


def refuse(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1 and err.rstrip().endswith(lines[0]) and "Traceback" not in err, (
        err
    )  # datasets' bars may precede it
    return lines[0]


@pytest.mark.parametrize(
    "option,value",
    [
        ("per_device_eval_batch_size", "0"),
        ("stop_at_step", "-3"),
        ("max_train_samples", "-5"),
        ("ddp_timeout", "0"),
        ("max_corpus_mb", "-1"),
        ("learning_rate", "nan"),
        ("learning_rate", "inf"),
        ("weight_decay", "-0.1"),
        ("adam_beta2", "1.0"),
        ("adam_epsilon", "0"),
        ("max_grad_norm", "nan"),
        ("seed", "-1"),
        ("num_train_epochs", "nan"),
        ("global_batch_tokens", "0"),
        ("preprocessing_num_workers", "0"),
        ("save_total_limit", "0"),
        ("vocab_size", "10"),
    ],
)
def test_numeric_options_out_of_range_are_refused(option, value, capsys, tmp_path):
    err = refuse([*TINY, f"--{option}", value, "--output_dir", str(tmp_path)], capsys)
    assert f"--{option} {value}" in err and "e.g." in err, err


def hostile_files(tmp_path):
    return {
        "empty": ("a.txt", b"", "is empty"),
        "whitespace": ("a.txt", b"  \n\n\t \n" * 100, "only whitespace"),
        "binary junk": ("a.txt", bytes(range(256)) * 20, "looks binary"),
        "invalid utf-8": (
            "a.txt",
            b"hello world\n\ncaf\xe9 au lait\n",
            "not valid UTF-8 (byte 0xe9 at offset 16, line 3)",
        ),
        "json text not a string": ("a.jsonl", b'{"text": 5}\n{"text": 7}\n', "holds int64 values, not text"),
        "json text mixed types": ("a.jsonl", b'{"text": "a"}\n{"text": 7}\n', "not text"),
        "not parquet": ("a.parquet", b"hello", "not a parquet file"),
        "smaller than one global batch": (
            "a.txt",
            b"a few more words of text, each paragraph its own.\n\n" * 60,
            "fewer than --global_batch_size 64",
        ),
        "too short for one block": ("a.txt", b"a few words.\n\n" * 3, "no full 32-token block"),
    }


@pytest.mark.parametrize("case", list(hostile_files(None)))
def test_hostile_training_files_are_refused_in_one_line(case, tmp_path, capsys):
    name, data, expected = hostile_files(tmp_path)[case]
    path = tmp_path / name
    path.write_bytes(data)
    argv = [
        "--config_name",
        "tiny",
        "--train_file",
        str(path),
        "--block_size",
        "32",
        "--vocab_size",
        "300",
        "--global_batch_size",
        "64",
        "--output_dir",
        str(tmp_path / "out"),
        "--report_to",
        "none",
    ]
    err = refuse(argv, capsys)
    assert expected in err, err


def test_null_rows_are_skipped_and_counted(tmp_path, caplog):
    from anygpu.data.sources import load_raw_text

    path = tmp_path / "a.jsonl"
    path.write_text("".join(json.dumps({"text": None if i % 4 == 0 else f"row {i}"}) + "\n" for i in range(40)))
    (_, d, _) = parse_args(["--train_file", str(path), "--validation_split_percentage", "50"])
    raw, _ = load_raw_text(d)
    assert len(raw["train"]) + len(raw["validation"]) == 40
    assert "skipping" in caplog.text and "whose 'text' is null" in caplog.text


@pytest.mark.parametrize(
    "text", ["- a\n- b\n", "42\n", "just a string\n", "learning_rate: [1, {a: 2}]\n", "{unclosed: [\n"]
)
def test_a_config_file_that_is_not_a_mapping_is_refused(text, tmp_path):
    cfg = tmp_path / "run.yaml"
    cfg.write_text(text)
    with pytest.raises(UsageError, match="run.yaml|--learning_rate"):
        parse_args([str(cfg)])


def test_runtime_errors_keep_their_traceback(monkeypatch, tmp_path):
    """Only refusals of user input become one line: a ValueError deep in training propagates."""
    import anygpu.engines.fsdp as fsdp

    def broken(*a, **k):
        raise ValueError("a bug deep inside")

    monkeypatch.setattr(fsdp, "prepare", broken)
    with pytest.raises(ValueError, match="a bug deep inside"):
        main([*TINY, "--max_steps", "1", "--output_dir", str(tmp_path)])


@pytest.mark.slow
def test_a_refusal_is_printed_once_not_once_per_rank(tmp_path):
    """Once, even when rank 0 is the last to reach it (torchrun stops every rank at the first exit)."""
    proc = subprocess.run(
        [
            *WARM,  # torchrun's agent, the ranks forked from it
            "torchrun",
            "--standalone",
            "--nproc-per-node=2",
            "run_fsdp_standalone.py",
            *TINY,
            "--per_device_eval_batch_size",
            "0",
            "--output_dir",
            str(tmp_path),
        ],
        cwd=ROOT,
        env={**env(), "ANYGPU_TEST_SLOW_RANK0": "2"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0
    assert (proc.stdout + proc.stderr).count("error: --per_device_eval_batch_size 0") == 1, proc.stderr[-2000:]


# ---------------------------------------------------------------------- random input to the parser
FIELDS = [f for cls in (ModelArguments, DataArguments, TrainArguments) for f in cls.__dataclass_fields__]
VALUES = st.one_of(
    st.integers(-(10**6), 10**6).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(str),
    st.sampled_from(
        ["true", "false", "none", "", "-1", "0", "1e-3", "nan", "latest", "cosine", "tiny", "/nonexistent"]
    ),
    st.text(max_size=12),
)
YAML_SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-1000, 1000), st.floats(), st.text(max_size=10))
YAML_VALUES = st.recursive(
    YAML_SCALARS,
    lambda kids: st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=5), kids, max_size=3),
    max_leaves=6,
)


def parse_or_refuse(argv: list[str]) -> None:
    try:
        parsed = parse_args(argv)
    except UsageError:
        return
    assert len(parsed) == 3  # a valid configuration


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.lists(st.tuples(st.sampled_from(FIELDS), VALUES), max_size=4))
def test_random_option_values_parse_or_are_refused(pairs):
    parse_or_refuse([w for name, value in pairs for w in (f"--{name}", value)])


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    st.one_of(
        YAML_VALUES,
        st.dictionaries(
            st.sampled_from(FIELDS) | st.text(max_size=8).filter(lambda k: k not in ("help", "h")),
            YAML_VALUES,
            max_size=4,
        ),
    ),
    st.sampled_from([".yaml", ".json"]),
)
def test_random_config_files_parse_or_are_refused(tmp_path_factory, content, suffix):
    path = tmp_path_factory.mktemp("cfg") / f"run{suffix}"
    path.write_text(json.dumps(content) if suffix == ".json" else yaml.safe_dump(content))
    parse_or_refuse([str(path)])
